// xpm/planner/fit.hpp — fit a CostFormula's coefficients to measured peak bytes with Ceres.
//
//   CostFormula f("a*bs*l^2 + b*bs*l + c", {"a","b","c"}, {"bs","l"});
//   std::vector<Measurement> m = {{{1, 64}, 1.027e6}, {{4, 128}, 1.285e6}, {{8, 256}, 2.663e6},
//                                 {{2, 512}, 2.356e6}, {{16, 64}, 1.438e6}};  // dims, peak bytes
//   std::vector<InfeasibleBound> oom = {{{64, 256}, 8e6}};  // ran out of memory under an 8 MB cap
//   FitOptions options;
//   options.batch_size_variable = "bs";     // refuse a model that shrinks as bs grows
//   FitResult r = fit_coefficients(f, m, oom, options);  // bytes per unit of each term
//   if (!r.summary.usable) std::cerr << r.summary.brief_report();
//
// Method. Residual i is relative, (predicted_i - measured_i) / measured_i, so a 1 MB probe and a
// 1 GB probe weigh the same; an optional robust loss (Huber, Cauchy) on it limits what one bad
// probe can do. Coefficients are non-negative by default: memory terms cannot be negative, and
// the bound stops the fit trading one term against another.
//  - Linear formulas (CostFormula::is_linear()): linear least squares solved by Ceres (DENSE_QR,
//    trust region) on scaled columns: the solver sees x_k = coefficient_k * s_k / Y with
//    s_k = max_i |basis_ik| and Y the largest measurement, so every parameter is O(1), starting
//    from the exact (non-negative) least-squares solution. Before solving, the scaled
//    design matrix must have full column rank: a coefficient the probe shapes cannot separate
//    from the others is an IdentifiabilityError naming it, never a silent minimum-norm answer.
//  - Other formulas (max(...), l^p, ...): non-linear least squares, Ceres Levenberg-Marquardt
//    with central numeric differences of CostFormula::predict. The start is
//    FitOptions::initial_values (1 for a coefficient not listed) when any is given; otherwise
//    an automatic start (FitOptions::automatic_start): a coarse-to-fine search over the
//    coefficients in exponents (l^p), each candidate completed by non-negative least squares
//    over the coefficients that enter linearly, max(...) resolved by the argument that wins at
//    each point (see docs/formula.md, "Non-linear fits"). Ceres then runs from that start and
//    from the plain start (1 each) and keeps the lower cost. The solver works on
//    x_k = coefficient_k / s_k with s_k = |start value| (1 when the start is 0).
//    Identifiability is checked at the solution (numeric Jacobian); a coefficient the probes
//    cannot identify there makes the fit not usable, with the reason.
// Infeasible probes. A probe that ran out of memory at dims d under a capacity C says that the
// true peak at d exceeds C. A linear formula without a robust loss is then solved exactly as
// least squares with every predicted(d) >= C (and coefficients >= 0 when non-negative) as
// constraints (Lawson and Hanson's LSI; no Ceres, 0 iterations, solver_report says so). Else,
// or when those constraints cannot all hold, each InfeasibleBound adds a one-sided (hinge)
// residual
//   w * max(0, (C - predicted(d)) / C)
// (w = FitOptions::infeasible_bound_weight), zero when the prediction is at or above C, to the
// Ceres problem. When a bound is still violated at the solution
// the fit is solved again with 10x the weight, up to 4 times. A bound still violated then makes
// the fit not usable, with a reason naming its dims. Bounds never count as points for the
// identifiability check, the error statistics or leave-one-out (each left-out refit keeps them).
// Diagnostics: per-point relative errors, max/mean, held-out (leave-one-shape-out) error, the
// bounds, and a usable flag with the reasons when not (no convergence, max relative error or
// held-out error above a limit, violated infeasible bound, prediction that decreases as the
// batch size grows).
#pragma once

#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "xpm/planner/formula.hpp"

namespace xpm {

/// One probe result: dims in the formula's variable_names() order, measured peak bytes.
struct Measurement {
  std::vector<double> dims;  // one value per formula variable
  double bytes = 0;          // measured peak allocated bytes, > 0
};

/// A probe that ran out of memory: the true peak at `dims` is above `exceeds_bytes` (the capacity
/// the probe ran under). Used by the fit as a lower bound on the prediction there.
struct InfeasibleBound {
  std::vector<double> dims;  // one value per formula variable
  double exceeds_bytes = 0;  // capacity the probe ran out of, bytes, > 0
};

/// The probe shapes cannot separate some coefficients: at every measurement, the term of one
/// coefficient is a combination of the terms of others (e.g. every probe has l = 64, so
/// a*bs*l^2 and b*bs*l move together), or is zero. what() names them and says why, e.g.
/// "fit: coefficients a and b cannot be separated by the probe shapes: every probe has l = 64 ...".
class IdentifiabilityError : public std::invalid_argument {
 public:
  IdentifiabilityError(const std::string& message, std::vector<std::string> coefficients,
                       std::string dependent);
  /// Every coefficient involved, in declared order.
  const std::vector<std::string>& coefficients() const { return coefficients_; }
  /// The coefficient whose term depends on the others' (the last one, in declared order, that
  /// the probe shapes cannot tell apart from those before it).
  const std::string& dependent() const { return dependent_; }

 private:
  std::vector<std::string> coefficients_;
  std::string dependent_;
};

/// The loss on each relative residual: squared, or one that bends at robust_loss_scale so that
/// one bad probe weighs less (Ceres's HuberLoss, CauchyLoss).
enum class RobustLoss { kNone, kHuber, kCauchy };
std::string to_string(RobustLoss loss);  // "none" | "huber" | "cauchy"
/// Throws std::invalid_argument "<source> must be 'none', 'huber' or 'cauchy', got '<text>'".
RobustLoss parse_robust_loss(const std::string& text, const std::string& source);

/// Options of fit_coefficients (Ceres-style plain struct).
struct FitOptions {
  bool non_negative = true;            // lower bound 0 on every coefficient (false: any sign)
  int max_iterations = 200;            // Ceres max_num_iterations
  double function_tolerance = 1e-14;   // Ceres function_tolerance
  double gradient_tolerance = 1e-16;   // Ceres gradient_tolerance
  double parameter_tolerance = 1e-14;  // Ceres parameter_tolerance
  RobustLoss robust_loss = RobustLoss::kNone;  // on the relative residuals
  double robust_loss_scale = 0.01;     // relative residual where the robust loss bends (0.01: 1 %)
  std::map<std::string, double> initial_values;  // non-linear fit start, bytes per unit; default 1
  bool automatic_start = true;         // non-linear fit without initial_values: search a start
  double infeasible_bound_weight = 100;  // weight w of an infeasible bound's hinge residual, > 0
  std::string batch_size_variable;     // "": no check; else refuse a decreasing prediction in it
  /// The fit is usable only when its max relative error at the fitted points and its held-out
  /// (leave-one-shape-out) max relative error where the other shapes surround the one left out
  /// (FitSummary::surrounded_held_out_max_rel_error) are both at most this. Error at the probes
  /// is not prediction error: a fit exact at its probes can miss between them.
  double usable_max_rel_error = 0.05;
  /// Held-out error: every group of points with the same dims is left out in turn, the rest
  /// refitted and the group predicted (one refit per distinct shape). false: not computed, and
  /// usability rests on the fit error alone.
  bool leave_one_out = true;
  double identifiability_tolerance = 1e-9;  // relative distance of a unit column to the others'
                                            // span below which it counts as dependent
  /// With batch_size_variable set: when no fit of every point explains the probes at batch
  /// size 1 (the fit of all points misses some point by more than 1 %), every one of them lies
  /// below the fit of the others or on it (under-predicted by at most 0.1 %), one of them by
  /// 0.2 % or more, and leaving them out lowers both the max relative error and the held-out
  /// error, they are left out of the fit (FitSummary::left_out says so). A probe that some
  /// fit explains is never left out: it may be the only one where a max() piece wins. In PyTorch a
  /// microbatch of one record often peaks below the trend of larger ones (other kernels, copies
  /// of a transposed size-1 batch dimension skipped); fitted with them, a formula misses the
  /// others. Predictions at batch size 1 then err on the safe side, unless those probes follow
  /// the formula on their own: at least two more distinct shapes than coefficients, a usable
  /// fit of them alone within 1 % at each, fitted and left out, and not below any out-of-memory
  /// bound at batch size 1. Then FitSummary::single_record_coefficients hold that fit, and
  /// batch size 1 is predicted by the smaller of the two fits (measured: a padded LM's
  /// attention mask is not built for a batch without padding, so one record lacks that term).
  /// Probes at batch size 1 above the trend are left out the same way (every one above the fit
  /// of the others or on it, over-predicted by at most 0.1 %, one of them under-predicted by
  /// more than 1 %: a convolution's im2col path at batch 1), and
  /// FitSummary::single_record_factor (> 1) scales every prediction at batch size 1 to the
  /// largest measured / predicted ratio among them. false: fit every point.
  bool single_record_regime = true;
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// Diagnostics of a fit on the fitted points.
struct FitSummary {
  bool converged = false;              // Ceres reported CONVERGENCE, or solved exactly
  int iterations = 0;                  // Ceres iterations (0 when solved exactly)
  bool linear = true;                  // linear least squares (else non-linear)
  std::size_t coefficient_count = 0;   // fitted coefficients
  RobustLoss robust_loss = RobustLoss::kNone;  // FitOptions::robust_loss used
  double max_rel_error = 0;            // max_i |pred_i - meas_i| / meas_i
  double mean_rel_error = 0;           // mean of the same
  std::vector<double> rel_errors;      // signed (pred - meas) / meas, one per measurement
  /// Held-out error: max_i |pred_{-i}(dims_i) - meas_i| / meas_i, with pred_{-i} fitted without
  /// every point of the same dims as point i (leave-one-shape-out), over the points that have a
  /// figure (held_out_undetermined have none); NaN when not computed (see leave_one_out_note) or
  /// no point has one. `usable` rests on its surrounded part (surrounded_held_out_max_rel_error).
  double leave_one_out_max_rel_error = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> leave_one_out_rel_errors;  // signed, one per measurement; empty: not computed
  /// The same max over the points whose dims lie within the range of the other shapes' in every
  /// variable (predicted by interpolation, as plans inside the probed range are); NaN when none
  /// does or not computed. `usable` rests on it: a shape at the edge, predicted from the others
  /// by extrapolation, is reported but does not make the fit unusable.
  double surrounded_held_out_max_rel_error = std::numeric_limits<double>::quiet_NaN();
  std::size_t surrounded_held_out_count = 0;  // points with a figure where the others surround them
  /// Points with a held-out figure outside the range of the other shapes in some variable:
  /// their figure is extrapolation, reported apart (extrapolated_held_out_max_rel_error, the
  /// largest |error| among them; NaN when none) and not deciding `usable`.
  std::vector<std::size_t> held_out_extrapolated;
  double extrapolated_held_out_max_rel_error = std::numeric_limits<double>::quiet_NaN();
  /// Points with no held-out figure (NaN in leave_one_out_rel_errors): without their shape the
  /// other shapes do not determine the prediction there (its gradient in the coefficients is
  /// not a combination of theirs), e.g. a max() piece left with fewer shapes where it wins than
  /// it has coefficients. The refit's value there is arbitrary, so no figure decides `usable`;
  /// held_out_note says how many shapes the prediction rests on and how many it needs
  /// ("no held-out figure at 3 of 12 shapes: without point (bs = 8, l = 128) the fit rests on
  /// 2 other shapes where a, b and c act and needs 3"); "" when every shape has a figure.
  std::vector<std::size_t> held_out_undetermined;
  std::string held_out_note;
  std::string leave_one_out_note;      // why leave-one-out was not computed; "" when it was
  /// The coefficients of each leave-one-shape-out refit (per distinct dims, in order of first
  /// appearance; two for a non-linear fit whose refits from the full solution and from the
  /// automatic start explain the rest equally well, the held-out error then being the worse
  /// one's): candidate models that the data explain about as well as the fit; where they
  /// disagree, a probe is informative (the adaptive probe design uses them).
  std::vector<std::vector<double>> leave_one_out_coefficients;
  bool usable = false;                 // converged, accurate enough, non-decreasing in bs
  std::vector<std::string> reasons;    // why not usable (one sentence each); empty when usable
  std::string solver_report;           // Ceres BriefReport(), or how it was solved exactly
  std::string start;                   // non-linear fits: where Ceres started ("" when linear)
  /// "" or a note that the residuals' signs are grouped along a variable (runs test), with a
  /// suggested max() of pieces; informative, it does not change `usable`.
  std::string residual_structure;
  /// Measurements left out of the fit (FitOptions::single_record_regime), indices; their
  /// rel_errors are the fit's errors there. max/mean_rel_error are over the fitted points.
  std::vector<std::size_t> left_out;
  std::string left_out_note;           // why they were left out ("" when none)
  /// Batch size 1 above the trend (FitOptions::single_record_regime): the formula's prediction
  /// at batch size 1 times this (MemoryModel::single_record_factor); 1 otherwise.
  double single_record_factor = 1;
  /// Batch size 1 below the trend and fitted on its own (FitOptions::single_record_regime): the
  /// coefficients that predict batch size 1 (MemoryModel::single_record_coefficients), in
  /// coefficient_names() order; empty otherwise.
  std::vector<double> single_record_coefficients;
  /// Coefficients of a non-linear fit that have no effect at any measurement at the fitted point:
  /// a max() argument that never wins there, whose zeroing changes no prediction at the
  /// measurements, and which a sibling argument of the same shape covers (e.g. the second of two
  /// quadratic pieces when one explains every probe). Set to 0, so the prediction between
  /// measurements follows the piece the data support. Names, in declared order; dormant_note
  /// says it in a sentence ("" when none). Any other such coefficient (a floor no probe reached)
  /// makes the fit unusable.
  std::vector<std::string> dormant_coefficients;
  std::string dormant_note;
  std::string batch_size_variable;     // FitOptions::batch_size_variable of the fit
  std::size_t infeasible_bound_count = 0;  // InfeasibleBounds given to the fit
  std::vector<double> infeasible_bound_predicted_bytes;  // prediction at each bound's dims
  std::vector<bool> infeasible_bound_satisfied;  // predicted >= exceeds_bytes, one per bound
  double infeasible_bound_weight = 0;  // hinge weight of the last solve (after any increase)
  /// One paragraph, no newline: converged?, iterations, points, method, max/mean relative
  /// error, leave-one-out error (or why not computed), infeasible bounds (when any), usable or
  /// the reasons.
  std::string brief_report() const;
  /// The held-out part of brief_report(): the error where the other shapes surround the one
  /// left out, by extrapolation, and held_out_note.
  std::string held_out_sentence() const;
  /// brief_report() and then one line per point (relative error and leave-one-out error), one
  /// per infeasible bound (predicted bytes, satisfied or not), the start and the residual
  /// structure note.
  std::string full_report() const;
};

struct FitResult {
  std::vector<double> coefficients;  // formula.coefficient_names() order, bytes per term unit
  FitSummary summary;
};

/// Fits the coefficients of `formula` to `measurements` (feasible probes).
/// Throws std::invalid_argument when: there are fewer measurements than coefficients, a
/// measurement has the wrong number of dims, non-finite dims or non-positive/non-finite bytes
/// (the message names the measurement index and the value), the formula has no coefficient,
/// options.batch_size_variable is not a variable of the formula, options.initial_values names
/// something that is not a coefficient or gives a negative start with non_negative; and
/// IdentifiabilityError (an invalid_argument) when the formula is linear and the probe shapes
/// cannot separate its coefficients.
/// Pure function; thread-safe.
FitResult fit_coefficients(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options = {});

/// Same, with the probes that ran out of memory as lower bounds on the prediction (see the file
/// comment). Also throws std::invalid_argument naming the bound ("infeasible bound 2") when one
/// has the wrong number of dims, non-finite dims, or exceeds_bytes not finite and > 0.
FitResult fit_coefficients(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const std::vector<InfeasibleBound>& infeasible_bounds,
                           const FitOptions& options = {});

}  // namespace xpm
