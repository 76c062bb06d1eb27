// xpm/planner/floor_model.hpp — the floor of a phase-aware memory model: a constant, or a
// formula of its own when the optimizer-step peaks grow with the dims.
//
//   std::vector<Measurement> optimizer_peaks = ...;  // one per feasible probe: dims, bytes
//   FloorFit floor = fit_floor(formula, optimizer_peaks, static_bytes, FloorOptions{});
//   MemoryModel model(formula, coefficients, floor.constant_bytes, "bs");
//   if (floor.formula) model.set_floor_formula(*floor.formula);
//   std::cout << floor.report;  // which floor, and why
//
// Why. The step's peak is max(forward/backward peak, optimizer-step peak). In the bundled tasks
// the optimizer step runs after every tensor of the step is freed, so its peak is the same at
// every shape (weights, gradients, optimizer state, update temporaries): a constant. In user
// code the optimizer step often runs while tensors of the step are still alive (logits, loss,
// saved inputs), so its peak grows with the shape; a constant floor (the largest probe's) then
// over-predicts small shapes and under-predicts shapes beyond the probes.
//
// Rule (FloorMode::kAutomatic). spread = (max - min) / max of the optimizer-step peaks. When it
// is at most FloorOptions::constant_spread (0.1 %), the floor is the constant max(static bytes,
// largest peak). Otherwise the peaks are fitted (non-negative linear least squares, relative
// residuals) with the floor formula, and the formula is the floor when its fit is usable and
// its max relative error is below the constant's; the constant otherwise. The floor formula is
// FloorOptions::formula, or by default the model's own formula with every coefficient renamed
// floor_<name> when that formula is linear (a*bs*l^2 + b*bs*l + c: floor_a*bs*l^2 +
// floor_b*bs*l + floor_c), else floor_d * (the product of every variable) + floor_f.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/memory_model.hpp"

namespace xpm {

enum class FloorMode {
  kAutomatic,  // constant unless the peaks grow (see the file comment)
  kConstant,   // always the largest optimizer-step peak
  kFormula,    // always the floor formula
};

struct FloorOptions {
  FloorMode mode = FloorMode::kAutomatic;
  /// Floor formula over the model's variables; "" derives it from the model's formula (above).
  std::string formula;
  /// Its coefficient names; empty: every name of the formula that is not a variable, in order.
  std::vector<std::string> coefficient_names;
  double constant_spread = 0.001;  // kAutomatic: at most this spread keeps the constant
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

struct FloorFit {
  double constant_bytes = 0;           // max(static bytes, largest optimizer-step peak), or the
                                       // static bytes alone when the formula is the floor
  std::optional<FloorFormula> formula;  // the fitted floor formula when it is the floor
  double spread = 0;                   // (max - min) / max of the optimizer-step peaks
  double constant_max_rel_error = 0;   // of the constant floor on the peaks
  double formula_max_rel_error = -1;   // of the floor formula on the peaks; -1: not fitted
  /// One sentence: which floor, and why, e.g. "floor: formula floor_d*bs*l + floor_f fitted to
  /// the optimizer-step peaks, which grow 12.4 % across the probes (max error 0.02 %; a
  /// constant would miss by 11 %)".
  std::string report;
};

/// The floor formula FloorOptions gives or derives for `formula` (see the file comment).
/// Throws FormulaError for a bad FloorOptions::formula.
CostFormula floor_formula_for(const CostFormula& formula, const FloorOptions& options);

/// Chooses and fits the floor from `optimizer_step_peaks` (dims in formula variable order,
/// bytes > 0; at least one). Throws std::invalid_argument for bad options or measurements, and
/// when FloorMode::kFormula is asked and the floor formula cannot be fitted (too few points,
/// coefficients the probes cannot separate). Pure function.
FloorFit fit_floor(const CostFormula& formula, const std::vector<Measurement>& optimizer_step_peaks,
                   double static_bytes, const FloorOptions& options = {});

/// A plateau of the forward/backward peaks. Below some size a shape-independent moment of
/// backward sets the peak (the dense gradient of the largest parameter, alive while it is added
/// into .grad: the bundled tagger's 10.24 MB embedding gradient), so several probes peak within
/// a small fraction of the smallest peak whatever their dims. Above the constant floor it is a
/// floor of its own (measured: a rank holding 1/3 of the AdamW state, plateau 43.28 MB against
/// an optimizer step of 41.04 MB), or a piece of the formula: a fit tries both (PredictiveBatcher
/// and `xpm-plan fit --above-floor-only` keep the one whose model misses the step peaks least).
struct PeakPlateau {
  double floor_bytes = 0;        // the smallest forward/backward peak
  double top_bytes = 0;          // floor_bytes * (1 + fraction): peaks up to it lie on the plateau
  std::size_t measurements = 0;  // how many peaks lie on it (>= 2)
};

/// The plateau of `forward_backward_peak_bytes` (the feasible probes' peaks, bytes): when at
/// least two lie within `fraction` of the smallest and the smallest lies above
/// `constant_floor_bytes`; none otherwise (or without peaks). Tried only under
/// FloorMode::kAutomatic (kConstant and kFormula keep the floor they name). Pure function.
std::optional<PeakPlateau> find_peak_plateau(const std::vector<double>& forward_backward_peak_bytes,
                                             double constant_floor_bytes, double fraction = 0.01);

/// The largest relative error of `model` over `step_peaks` (each shape's step peak, bytes > 0:
/// the larger of its forward/backward and optimizer-step peaks), the floor included: what
/// plateau_fit_kept compares. 0 without peaks. Pure function.
double max_step_peak_rel_error(const MemoryModel& model, const std::vector<Measurement>& step_peaks);

/// Whether a fit over the plateau is kept against one over the floor: `plateau_error` and
/// `floor_error` are each model's largest relative error over the step peaks. The smaller
/// wins; within 1e-9 of each other (rounding: the worst shape is often one both fits predict
/// alike) the plateau's.
bool plateau_fit_kept(double plateau_error, double floor_error);

/// The floor report of a plateau kept as the floor: "floor: the plateau of the forward/backward
/// peaks, 6340180 bytes (2 probes within 1 % of the smallest, not fitted), above the
/// optimizer-step peaks' 4691084 bytes".
std::string plateau_floor_report(const PeakPlateau& plateau, double constant_floor_bytes);

std::string to_string(FloorMode mode);  // "auto" | "constant" | "formula"
/// Throws std::invalid_argument "<source> must be 'auto', 'constant' or 'formula', got '<text>'".
FloorMode parse_floor_mode(const std::string& text, const std::string& source);

}  // namespace xpm
