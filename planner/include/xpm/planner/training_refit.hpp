// xpm/planner/training_refit.hpp — the memory model refitted on the peaks training measured,
// where the probes' fit misses shapes by amounts the calibration's lines cannot take off: one
// policy for the Python sampler and the C++ Learner.
//
//   xpm::TrainingRefit refit(model);                   // every rank, the model the plans start from
//   for each optimizer step:
//     std::vector<xpm::TrainingPoint> points = ...;    // every rank's microbatches, in rank order
//     if (auto line = refit.end_step(step, points)) {  // the same points on every rank: the same answer
//       log(*line);                                    // "step 12: memory model refitted on ..."
//       calibration.redraw(refit.calibration_steps(phases), *line);
//       // plan the steps not yet handed out with refit.model() and calibration.correction()
//     }
//
// The probes measure a few shapes and the fit extrapolates between them; training measures the
// shapes it runs, step after step. Where the probes' fit errs by a different amount at each shape
// (a T5 under Seq2SeqTrainer: -5.35 % to +4.31 % on the microbatches of a step's middle), the
// calibration's lines, an offset and a share of the prediction per position, over-predict most
// shapes by what the worst one needs. The refit replaces the model's coefficients (that T5's,
// refitted at step 8 on 31 peaks: the later middle microbatches -0.22 % to +5.34 %, the last
// ones -0.15 % to +0.16 %; tests/planner/training_refit_test.cpp).
//
// Fitted points: the microbatches in the middle or at the end of a step of several (a step's
// first allocates the gradients among its activations; a step's only one holds both ends), from
// the last window_steps steps after the run's first (no optimizer state), not those of one
// record when the model fits records alone apart, nor those peaking within 1 % of the model's
// floor there (the optimizer step, not the formula, sets them). A refit is tried once the
// window holds points_per_coefficient fitted points per coefficient, then each time they grew
// by half, and every window_steps steps seen (not the epoch's step index) once they stop
// growing. It fits the model's formula to them (fit_coefficients: relative residuals,
// non-negative, the probes that ran out of memory as bounds); a formula "auto" chose (the
// model's metadata has "formula_selection") is chosen again among the linear candidates
// (select_formula), unless the model fits records alone apart. The refit is taken when the
// spread (max - min) of its leave-one-shape-out errors is at least min_spread_gain below the
// spread of the model in force's errors once the best line in the prediction has taken off
// what a calibration line can. The floor, the bounds and the phases' fits are kept (a phase
// keeps the probes' formula when the steady one changes: plan_step takes a phase over the
// same variables). The refit holds in the box of the shapes the window's fitted steps measured,
// every position's (each variable's range over them: MemoryModel's RefitRegion). The run's
// first step (no optimizer state) is not fitted: a shape of it joins the box where the refit,
// less its median excess over that step's peaks at the same position, errs within its
// leave-one-shape-out range widened by min_spread_gain (a T5's refit on one step's 19 peaks,
// targets of 87 to 158 tokens, was 21.7 % over at that step's 33-token targets, and put a later
// microbatch with 33-token targets 24.8 % over). Outside the box, the prediction is the model given's,
// raised by the smaller of the refit's excess over it there and at the nearest shape inside. A
// shape no step has shown lies beyond what the refit was checked on: that T5's refit put a
// step's first microbatch of one 256-token source and a 2-token target 6.4 % under its peak;
// the probes' fits planned it 3.2 % over.
//
// Every rank must call end_step once per optimizer step with the same points (gathered in rank
// order); the answer is a pure function of them: no clock, no randomness. Units: bytes. Not
// thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/calibration.hpp"
#include "xpm/planner/formula_selection.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/step_plan.hpp"

namespace xpm {

/// One trained microbatch: its dims (the model's variables), the peak measured (as the
/// calibration records it) and its position in its step (none when not known).
struct TrainingPoint {
  std::vector<double> dims;
  double peak_bytes = 0;
  std::optional<MicrobatchPosition> position;
};

struct TrainingRefitOptions {
  int window_steps = 32;                // the steps whose points are fitted, >= 1 (the calibration's window)
  double points_per_coefficient = 3;    // fitted points per coefficient before the first try, >= 1
  double min_spread_gain = 0.01;        // a refit's spread must be this much smaller, >= 0 (0.01: 1 point)
};

class TrainingRefit {
 public:
  /// Throws std::invalid_argument naming an option out of range.
  explicit TrainingRefit(MemoryModel model, TrainingRefitOptions options = {});

  /// Ends an optimizer step with every rank's points (the same list on every rank). Returns the
  /// log line when the model in force changed ("step 12: memory model refitted on 66 training
  /// peaks: leave-one-shape-out errors -0.9 % to +1.5 %, the model in force's -5.3 % to +4.3 %").
  /// Throws std::invalid_argument when a point's dims do not match the formula or its peak is
  /// not a finite number >= 0.
  std::optional<std::string> end_step(std::int64_t step, std::vector<TrainingPoint> points);

  /// The model in force: the one given, or its last refit.
  const MemoryModel& model() const { return model_; }
  /// The model given to the constructor (what a restored state must be loaded against).
  const MemoryModel& given() const { return given_; }
  /// The fingerprint of `model` a state records as "given" (16 hex digits of its JSON).
  static std::string digest(const MemoryModel& model);
  bool refitted() const { return refitted_; }
  /// The window's steps, each point predicted by model() at its position as plan_step
  /// predicts it (`phases`: model()'s phase fits), for Calibration::redraw.
  std::vector<CalibrationStep> calibration_steps(const StepPhaseModels& phases) const;
  /// One line per refit taken.
  const std::vector<std::string>& log() const { return log_; }

  /// {"window": [{"step", "run_first", "points": [[dims..., peak_bytes, position], ...]}, ...],
  ///  "steps_seen", "next_try_points", "last_try_steps_seen", "formula" (text) and "coefficients"
///  ({name: value}) and "training_ranges" ([[min, max], ...] per variable: its RefitRegion) of
///  the refit in force (null: none), "given" (a digest of the model given), "log"}
  /// (position -1: none): what a checkpoint keeps, so that a resumed run refits as the
  /// uninterrupted one did.
  nlohmann::json state() const;
  /// Restores a state() taken with the same model given to the constructor. Throws
  /// std::invalid_argument naming what is malformed or that it was written for another model,
  /// changing nothing.
  void load_state(const nlohmann::json& state);

 private:
  struct Step {
    std::int64_t step = 0;
    bool run_first = false;
    std::vector<TrainingPoint> points;
  };
  std::vector<Measurement> fitted_points() const;
  bool fitted(const TrainingPoint& point) const;
  std::optional<std::string> try_refit(std::int64_t step, const std::vector<Measurement>& points);
  std::vector<std::vector<double>> region_shapes(const MemoryModel& refit, std::pair<double, double> held_out) const;
  void check_point(const TrainingPoint& point) const;
  bool selects_formula() const;
  FormulaSelectionOptions selection_options(const FitOptions& fit) const;

  MemoryModel given_;
  MemoryModel model_;
  TrainingRefitOptions options_;
  std::vector<Step> window_;  // oldest first
  std::int64_t steps_seen_ = 0;
  std::size_t next_try_points_ = 0;
  std::int64_t last_try_seen_ = -1;  // steps_seen_ at the last try (-1: none)
  bool refitted_ = false;
  std::vector<std::string> log_;
};

/// `model` with other coefficients of its formula (floor, ranges, bounds, single-record fit and
/// metadata kept). Throws std::invalid_argument when their count is not the formula's.
MemoryModel with_coefficients(const MemoryModel& model, const std::vector<double>& coefficients);

/// `model` with `formula` (over its variables) and `coefficients` (its coefficient order):
/// with_coefficients when the formula is its own, else the new formula with the floor, ranges,
/// bounds and metadata kept, each phase's fit with the old formula it was fitted with, and the
/// single-record fit left out. What a refit builds. Throws std::invalid_argument (the
/// coefficients' count).
MemoryModel refitted_model(const MemoryModel& model, const CostFormula& formula,
                           const std::vector<double>& coefficients);
/// `model`'s coefficients by name (what a state and refitted_model's second form take).
std::map<std::string, double> coefficients_by_name(const MemoryModel& model);
/// The same from the formula's text and its coefficients by name (a restored state). Throws
/// FormulaError, or std::invalid_argument naming a coefficient without a value or one that is
/// negative or not finite (a refit's are non-negative), or a value of no coefficient.
MemoryModel refitted_model(const MemoryModel& model, const std::string& formula_text,
                           const std::map<std::string, double>& coefficients);
/// The same in the region `training_ranges` (one [min, max] per variable: RefitRegion), `model`
/// predicting outside it: what a refit builds, and a restored state or plan again. Throws as
/// above, or std::invalid_argument for ranges that are not one finite [min, max] per variable.
MemoryModel refitted_model(const MemoryModel& model, const std::string& formula_text,
                           const std::map<std::string, double>& coefficients,
                           std::vector<ProbedRange> training_ranges);

}  // namespace xpm
