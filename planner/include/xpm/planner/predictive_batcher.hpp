// xpm/planner/predictive_batcher.hpp — probe, fit, then split every outer batch into
// microbatches predicted to fit the memory budget.
//
//   PredictiveBatcherOptions options;              // formula a*bs*l^2 + b*bs*l + c by default
//   options.formula = CostFormula::with_variables("a*bs*l + b*bs + c", {"bs", "l"});
//   options.budget.capacity_bytes = cap;
//   options.budget.memory_fraction = 0.9;
//   options.variable_max = {{"bs", 64}, {"l", 180}};  // ranges for the automatic probe design
//   AdaptivePackerOptions packing;
//   packing.sort_by = "l";                          // heaviest first by this dim
//   PredictiveBatcher batcher(options, std::make_shared<AdaptivePacker>(packing));
//   batcher.probe_and_fit(executor);                // rank 0 only, before DDP wrapping
//   MicrobatchPlan plan = batcher.plan(record_dims); // every step, on every rank
//
// Model: the formula is fitted to the forward/backward peaks of the probes (the phase that
// grows with the dims); the floor is the largest optimizer-step peak and the static bytes, or,
// when the optimizer-step peaks grow with the dims, a floor formula fitted to them
// (floor_model.hpp); prediction is max(floor, formula) (docs/design.md, section 3). The model
// records the probed range of every variable (MemoryModel::extrapolation). Probes that ran out of memory are
// upper bounds, never dropped: each is an InfeasibleBound of the fit (the prediction at its dims
// must reach the capacity it ran under) and an infeasible probe of the model (no plan dominates
// its dims; MemoryModel::fits).
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "xpm/planner/budget.hpp"
#include "xpm/planner/calibration.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/floor_model.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/formula_selection.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/probe.hpp"

namespace xpm {

/// Why the adaptive probe design stopped.
enum class AdaptiveStop {
  kNotRun,        // not run: explicit probe points, or max_probes = 0
  kAgreed,        // the candidate models agree within the tolerance everywhere in range
  kProbeCount,    // AdaptiveDesignOptions::max_probes probes added
  kNoCandidates,  // no held-out refits to compare (too few probes), or no shape left to probe
};

/// After the initial design, probe next where candidate models disagree most: the fit and its
/// leave-one-shape-out refits (models the probes explain about as well), over a grid of shapes
/// inside the design's range whose predicted peak fits the budget. Each added probe joins the
/// fit (with the formula chosen from the probes, the rivals alone are refitted after each, and
/// every candidate again before the loop stops); the loop stops when they agree within
/// `tolerance`, or at its budget of probes. Nothing in it reads a clock: the same probes give
/// the same design on every machine and rank.
struct AdaptiveDesignOptions {
  int max_probes = 8;        // probes added at most (0: no adaptive design)
  double tolerance = 0.01;   // relative disagreement below which the models agree
  int grid_steps = 8;        // grid values per non-batch-size variable
  void validate() const;     // throws std::invalid_argument naming the field
};

/// What the adaptive probe design did.
struct AdaptiveDesignReport {
  AdaptiveStop stop = AdaptiveStop::kNotRun;
  int added_probes = 0;
  double elapsed_s = 0;
  /// The largest relative disagreement between the candidate models at the last check, and
  /// where (formula variable order); NaN and empty when never computed.
  double disagreement = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> disagreement_dims;
  /// One sentence: "added 3 probes in 4.2 s; stopped: the models agree within 1 % (largest
  /// disagreement 0.4 % at bs = 12, l = 96)".
  std::string describe(const CostFormula& formula) const;
};

std::string to_string(AdaptiveStop stop);  // "not run" | "agreed" | "probe count" | ...

/// "PredictiveBatcher: the fitted memory model is not usable: " and the summary's reasons.
std::string not_usable_message(const FitSummary& summary);

/// Where the cost formula comes from.
enum class FormulaChoice {
  kGiven,      // PredictiveBatcherOptions::formula
  kAutomatic,  // chosen from the probes (formula_selection.hpp); `formula` names the variables
};

std::string to_string(FormulaChoice choice);                   // "given" | "auto"

struct PredictiveBatcherOptions {
  /// The cost formula (bytes): its variables are the dims of every record and probe point, in
  /// its variable_names() order.
  CostFormula formula = CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"});
  /// kAutomatic: the formula is chosen from the probes (select_formula over
  /// formula.variable_names(), e.g. formula = CostFormula::with_variables("c", {"bs", "l"})),
  /// after the initial design (the other formulas the probes explain join the adaptive design's
  /// candidate models), again among those rivals after every adaptive probe, and among every
  /// candidate before the adaptive design stops (it goes on when that choice's rivals
  /// disagree); fit_summary() is the chosen
  /// formula's, selection_report() says what was tried; the floor formula defaults to every
  /// candidate term (all_terms_formula).
  FormulaChoice formula_choice = FormulaChoice::kGiven;
  FormulaSelectionOptions selection;  // kAutomatic (its batch size, fit and floor set here)
  std::string batch_size_variable = "bs";                      // the microbatch size variable
  std::map<std::string, DimAggregation> aggregation;           // non-bs variables; default max
  std::vector<ProbePoint> probe_points;                        // empty: automatic design
  std::map<std::string, double> variable_max;                  // upper ends for the design
  /// Records like the training data (each record's dims in formula variable order, its
  /// batch-size column 1), e.g. a few thousand drawn from the dataset. Given, the automatic
  /// design probes mixes of them rather than equal records (ProbeExecutor::run_probe_records):
  /// for every design fraction f (of the records, ordered by their summed variables, then the
  /// others), one sweep of the microbatch size over the m records just below the f-quantile,
  /// or below the last record whose first ordering variable is at most f of the largest where
  /// that comes first and holds records enough for the largest microbatch probed (a sample
  /// mostly cut at one length), the near-equal mixes a sorting packer makes, and one over m
  /// records spread evenly up to it (an unsorted mix); then, with two or more variables
  /// besides the batch size (each a microbatch's max), for each of them the record that most
  /// exceeds the others in it (its share of that variable's largest value less its largest
  /// share of another's, when at least kLopsidedShare), swept repeated: a long source with a
  /// short target (a classification label) is a shape the quantiles' mixes, whose lengths grow
  /// together, never reach, and a fit of them cannot tell the source's own terms (encoder
  /// attention, bs*ls^2) from terms of both (bs*ls*lt): measured on a T5, 39 % under at one
  /// such record. The adaptive design probes the quantiles' mixes too. A summed variable
  /// (DimAggregation::kSum, e.g. real tokens) needs it beside the padded length it moves
  /// with: equal records make the two proportional, so the fit cannot tell them apart, and a
  /// formula of the sum alone under-predicts mixes. The sample sets every variable's range
  /// but the batch size's (variable_max then names the batch size only).
  std::vector<std::vector<double>> record_dims_sample;
  std::vector<double> design_fractions = {1.0, 0.75, 0.5};     // of each non-bs variable's max
  AdaptiveDesignOptions adaptive;                              // after the automatic design
  MemoryBudget budget;                                         // the plan's budget
  FitOptions fit;                                              // Ceres options
  FloorOptions floor;                                          // constant or fitted floor
  /// Throws std::invalid_argument naming the bad field (formula errors are FormulaError).
  void validate() const;
};

/// A record that is at least this share of one variable's largest value more than of any
/// other's is probed on its own (PredictiveBatcherOptions::record_dims_sample).
inline constexpr double kLopsidedShare = 0.5;

class PredictiveBatcher {
 public:
  PredictiveBatcher(PredictiveBatcherOptions options, std::shared_ptr<const MicrobatchPacker> packer);

  /// Runs the probes through `executor`, fits the formula and stores the model. Rank 0 only,
  /// before DDP wrapping. Automatic design (no probe points given): sweeps of the microbatch
  /// size, doubling from 1 up to variable_max[bs], stopping at the first infeasible probe or the
  /// first whose step peak exceeds the budget, then one bisection probe between the last fit
  /// and the first miss; one sweep with every other variable at f * its max for each fraction
  /// f of design_fractions, and, with two or more other variables, one sweep per variable and
  /// fraction f < 1 with that variable at f * its max and the others at their max (so terms
  /// in different variables can be told apart); with record_dims_sample, sweeps over mixes of
  /// its records instead (see there). Then the adaptive design
  /// (AdaptiveDesignOptions; adaptive_report() says what it added and why it stopped). Infeasible probes are kept in probes() (feasible = false), never dropped
  /// silently: each one bounds the fit from below at its dims (InfeasibleBound with
  /// exceeds_bytes = ProbeResult::capacity_bytes, or the budget's capacity_bytes when 0) and is
  /// stored in the model (MemoryModel::infeasible_probes), which keeps every plan below it.
  /// The formula is fitted to the forward/backward peaks that lie above the floor (where the
  /// budget binds), or to every feasible probe when too few do. When several probes peak within
  /// 1 % of the smallest forward/backward peak (a plateau above the optimizer-step floor), the
  /// fit is made twice, with the plateau as the floor and without, and the model that misses the
  /// probes' step peaks least is kept.
  /// Throws std::invalid_argument when the budget cannot work (below the static bytes or the
  /// floor, or fewer feasible probes than coefficients; IdentifiabilityError when the probes
  /// cannot separate the coefficients) and std::runtime_error when the fit is not usable
  /// (FitSummary::usable: not converged, error too large, an infeasible probe's bound violated,
  /// prediction decreasing in bs).
  const MemoryModel& probe_and_fit(ProbeExecutor& executor);

  /// Uses a model fitted elsewhere (cache, broadcast from rank 0). Its metadata's
  /// "fit_measurements" (written by probe_and_fit) seed later online corrections.
  void set_model(MemoryModel model);

  /// Online correction: adds a measured forward/backward peak at `dims` to the fit data and
  /// refits the coefficients (floor and infeasible probes kept, the latter as bounds). Call with the same measurement on every rank (under
  /// DDP the measurement must be agreed first, e.g. all-reduced), so plans stay identical.
  /// With fewer fit measurements than coefficients (a model set without its fit data) it raises
  /// the floor to the measured bytes instead. Returns the new model. Throws std::logic_error
  /// without a model.
  const MemoryModel& add_measurement(const Measurement& measurement);
  /// Online correction after a microbatch ran out of memory at `bound.dims` under
  /// `bound.exceeds_bytes` (the capacity in the model's terms: the Learner passes
  /// correction().planning_bytes(capacity)): the bound joins the model's infeasible probes (no
  /// later plan dominates those dims under that capacity) and the coefficients are refitted with
  /// every bound as a lower bound of the prediction (kept as they were when that refit is not
  /// usable). Same rule as add_measurement for ranks. Throws std::logic_error without a model,
  /// std::invalid_argument for a bound of the wrong size.
  const MemoryModel& add_infeasible_bound(const InfeasibleBound& bound);
  /// Online correction of the floor: sets it to max(floor, floor_bytes) (a measured
  /// optimizer-step peak above it). Same rule as add_measurement for ranks.
  const MemoryModel& raise_floor_bytes(double floor_bytes);
  /// Number of add_measurement() / add_infeasible_bound() / raise_floor_bytes() calls that
  /// changed the model since it was set.
  std::int64_t corrections() const { return corrections_; }
  bool has_model() const { return model_.has_value(); }
  /// Throws std::logic_error before probe_and_fit() or set_model().
  const MemoryModel& model() const;
  /// The fit of this batcher's own probe_and_fit(). A batcher given its model by set_model()
  /// (probe_and_fit's StepProbeResult::batcher, a model from a cache or a file) fitted nothing
  /// itself: its summary is the empty default ("did NOT converge", no fit); the model's own
  /// record is model().metadata()["fit"] (and ["formula_selection"]).
  const FitSummary& fit_summary() const { return fit_summary_; }
  /// FormulaChoice::kAutomatic: the candidates tried and the one chosen (FormulaSelection::
  /// report()) by this batcher's probe_and_fit(); "" otherwise, and after set_model().
  const std::string& selection_report() const { return selection_report_; }
  /// What the adaptive design of the last probe_and_fit() did.
  const AdaptiveDesignReport& adaptive_report() const { return adaptive_report_; }
  /// How probe_and_fit() chose the floor (FloorFit::report says which and why).
  const FloorFit& floor_fit() const { return floor_fit_; }
  const std::vector<ProbeResult>& probes() const { return probes_; }
  const PredictiveBatcherOptions& options() const { return options_; }
  const MicrobatchPacker& packer() const { return *packer_; }
  /// The same packer, shared (e.g. for another batcher over a snapshot of this one's model).
  std::shared_ptr<const MicrobatchPacker> shared_packer() const { return packer_; }

  /// The correction the plans are made with: each microbatch's prediction plus
  /// correction().bytes_for(prediction) fits the budget's usable bytes. A model with a
  /// metadata.reserved_gap (probed under a caching allocator: probe_and_fit writes it when the
  /// probes measured reserved bytes, ProbeResult::step_peak_reserved_bytes) starts from that gap,
  /// any other from none; probe_and_fit() and set_model() reset it so.
  const Correction& correction() const { return correction_; }
  /// Replaces the correction (e.g. Calibration::correction() after a step; the same on every rank).
  void set_correction(const Correction& correction) { correction_ = correction; }
  /// The bytes a microbatch's prediction may fill: correction().planning_bytes(usable bytes),
  /// at least 1.
  std::int64_t planning_bytes() const;

  /// Splits one outer batch (record dims in formula.variable_names() order) into microbatches
  /// whose predictions fit planning_bytes(). Deterministic: every rank gets the same plan for
  /// the same records.
  MicrobatchPlan plan(const std::vector<std::vector<double>>& record_dims) const;

 private:
  // One way of fitting the probes: the floor, the fitted measurements, the fit and, when it is
  // usable, the model and its largest relative error over every feasible probe's step peak.
  struct FitCandidate {
    double floor_bytes = 0;
    bool plateau = false;             // the forward/backward plateau is the floor
    std::string plateau_report;       // its floor report, when kept
    bool fitted_above_floor = false;  // else every feasible probe was fitted
    std::vector<Measurement> measurements;
    FitResult fit;
    std::optional<MemoryModel> model;  // empty when the fit is not usable
    double probe_error = 0;
    std::optional<CostFormula> formula;       // the formula fitted (chosen when automatic)
    std::string selection_report;             // FormulaSelection::report() when chosen
    std::vector<FittedFormula> alternatives;  // FormulaSelection::alternatives when chosen
    std::vector<ProbedRange> probed_ranges;   // of the feasible probes
    std::vector<InfeasibleBound> infeasible;  // the probes that ran out of memory
  };
  // What one probe runs: aggregated dims, and the records of a mix (empty: equal records).
  struct ProbeShape {
    std::vector<double> dims;
    std::vector<std::vector<double>> records;
  };
  std::vector<std::vector<double>> design_probe_dims(const CostFormula& formula) const;
  std::vector<std::vector<double>> design_sweep_shapes() const;
  void run_initial_design(ProbeExecutor& executor, double usable_bytes);
  void sweep_batch_size(ProbeExecutor& executor, const std::function<ProbeShape(double)>& shape_at,
                        double usable_bytes);
  ProbeResult run_shape(ProbeExecutor& executor, const ProbeShape& shape);
  ProbeShape sample_mix(std::size_t records, double fraction, bool spread) const;
  std::vector<std::size_t> lopsided_records() const;
  // `among`: when not empty, the formulas the automatic choice picks from (the adaptive design's
  // rivals), instead of every candidate.
  FitCandidate fit_probes(double static_bytes, double usable_bytes, const std::vector<std::string>& among = {});
  FitCandidate refine_design(ProbeExecutor& executor, FitCandidate chosen, double static_bytes,
                             double usable_bytes);
  std::vector<ProbeShape> adaptive_grid() const;
  double candidate_prediction(const CostFormula& formula, const std::vector<double>& coefficients,
                              double floor_bytes, const std::vector<double>& dims) const;
  /// "only N of M probes fit under the capacity ..., too few for <needed>; the floor ...".
  std::string too_few_fit_message(std::size_t fitted, const std::string& needed) const;
  void fit_formula(FitCandidate& c, const std::vector<InfeasibleBound>& infeasible,
                   const std::vector<std::string>& among) const;
  void store_model(FitCandidate chosen, double static_bytes);
  void note_reserved_gap();
  FitCandidate fit_candidate(const CostFormula& formula, const std::vector<InfeasibleBound>& infeasible,
                             double floor_bytes, const std::function<bool(const ProbeResult&)>& off_plateau,
                             const std::vector<std::string>& among) const;
  FitCandidate choose_fit(const CostFormula& formula, const std::vector<InfeasibleBound>& infeasible,
                          double usable_bytes, const std::vector<std::string>& among) const;

  PredictiveBatcherOptions options_;
  std::shared_ptr<const MicrobatchPacker> packer_;
  std::optional<MemoryModel> model_;
  FitSummary fit_summary_;
  AdaptiveDesignReport adaptive_report_;
  std::string selection_report_;
  FloorFit floor_fit_;
  std::vector<ProbeResult> probes_;
  std::vector<std::size_t> sample_order_;  // record_dims_sample, summed variables first, ascending
  std::vector<double> sample_first_key_;    // sample_order_'s records' first sorting variable
  std::vector<double> sample_rows_;        // record_dims_sample, row-major (aggregate_dims' view)
  std::vector<DimAggregation> aggregation_;  // per variable: the batch size's kCount, the options'
  std::vector<Measurement> fit_measurements_;  // what the current coefficients were fitted to
  std::int64_t corrections_ = 0;
  Correction correction_;  // what plans add to each prediction (correction())
};

}  // namespace xpm
