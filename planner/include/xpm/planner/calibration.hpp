// xpm/planner/calibration.hpp — the correction of a memory model's predictions from the peaks
// training measures: one policy for the Python sampler and the C++ Learner.
//
//   xpm::Calibration calibration(budget.usable_bytes());          // every rank, the same budget
//   for (const auto& mb : step_microbatches)                       // as they run
//     calibration.record_peak(mb.predicted_bytes, mb.measured_peak_bytes);
//   std::vector<double> row = calibration.step_row(/*replan_from=*/step + 1);
//   all_reduce_max(row);                                           // only where there are ranks
//   if (auto line = calibration.end_step(step, row)) log(*line);   // the correction changed
//   double fill = calibration.correction().planning_bytes(budget.usable_bytes());
//   // plan the steps from calibration.replan_from() on with predictions up to `fill`
//
// The correction is a line, intercept_bytes + slope x prediction, added to every prediction.
// Its slope lies on a grid of -5 % to +20 % of the prediction, 0.25 % apart (0 included). Of
// the lines on or above every (prediction, measured peak) point of the last window_steps steps
// (the run's first step, which has no optimizer state, only raises), whose intercept is not
// below the constant line's (or 0), the line with the least sum of its corrections relative to
// the smallest and the largest prediction measured is taken, a tie to the smallest slope; then
// the grid's next slope (0.25 % of the prediction) is added as headroom, and the correction at
// a prediction of the whole budget is bounded to half the budget either way. A step whose
// point lies above the line in force raises it at once; a lower line is taken only once
// settle_steps steps of the window lie under it.
//
// Ranks: every rank records its own microbatches; step_row() encodes them (and the budget and
// the first step a rank could still plan anew) so that an element-wise MAX all-reduce of the
// rows over the ranks agrees them; end_step() then gives every rank the same correction. One
// rank: pass the row unreduced. Every rank must call end_step once per optimizer step.
//
// Units: bytes. Not thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xpm {

/// Bytes added to a memory model's prediction: intercept_bytes + slope x prediction.
struct Correction {
  double intercept_bytes = 0;  // may be negative
  double slope = 0;            // 0.01: 1 % of the prediction

  /// The correction of one prediction, bytes.
  double bytes_for(double predicted_bytes) const { return intercept_bytes + slope * predicted_bytes; }
  /// The largest prediction whose corrected value fits `usable_bytes`:
  /// (usable_bytes - intercept_bytes) / (1 + slope).
  double planning_bytes(double usable_bytes) const { return (usable_bytes - intercept_bytes) / (1.0 + slope); }
  bool operator==(const Correction& o) const { return intercept_bytes == o.intercept_bytes && slope == o.slope; }
  bool operator!=(const Correction& o) const { return !(*this == o); }
};

/// The slopes a correction may take: -0.05 to 0.20, 0.0025 apart (101 values, 0 included).
const std::vector<double>& correction_slopes();

/// The correction of the points (predicted_bytes[i], peak_bytes[i]) taken together, as one
/// step of a calibration draws it (header comment; points with a prediction or peak <= 0
/// skipped): e.g. the gap between a model of allocated bytes and the reserved peaks of its
/// probes. A zero correction when no point is left. Throws std::invalid_argument when the
/// lists differ in length or usable_bytes <= 0.
Correction covering_correction(const std::vector<double>& predicted_bytes, const std::vector<double>& peak_bytes,
                               double usable_bytes);

struct CalibrationOptions {
  int window_steps = 32;  // the steps whose measurements the correction covers, >= 1
  int settle_steps = 8;   // steps measured (besides the run's first) before a lower line, >= 1
  Correction initial;     // in force before anything is measured (e.g. a model's reserved gap)
};

/// What a checkpoint keeps of a Calibration.
struct CalibrationState {
  Correction correction;
  /// Per step of the window, oldest first: the least intercept per slope of correction_slopes(),
  /// then the smallest and the largest prediction measured (-inf / +inf / -inf: none).
  std::vector<std::vector<double>> window;
  std::int64_t steps_seen = 0;
  std::vector<std::string> log;
};

/// {"correction": [intercept_bytes, slope], "window": [[...], ...], "steps_seen", "log"}; the
/// window's infinities (a step with no point) as null.
nlohmann::json to_json(const CalibrationState& state);
/// The inverse of to_json. Throws std::invalid_argument naming the field that is missing or malformed.
CalibrationState calibration_state_from_json(const nlohmann::json& json);

class Calibration {
 public:
  /// Throws std::invalid_argument when usable_bytes <= 0 or an option is < 1 (message names it:
  /// "Calibration: settle_steps must be a whole number >= 1, got 0").
  explicit Calibration(std::int64_t usable_bytes, CalibrationOptions options = {});

  /// Records one microbatch's measured peak against the prediction it was planned with (this
  /// rank; no communication). A prediction or peak of 0 is skipped. Throws
  /// std::invalid_argument when either is not finite or negative ("Calibration.record_peak:
  /// peak_bytes must be a finite number of bytes >= 0, got nan").
  void record_peak(double predicted_bytes, double peak_bytes);

  /// This rank's step so far, encoded for an element-wise MAX all-reduce over the ranks
  /// (row_size() numbers), with `replan_from`, the first step this rank could still plan anew.
  std::vector<double> step_row(std::int64_t replan_from) const;
  /// The length of step_row().
  static std::size_t row_size();

  /// Ends an optimizer step with the agreed row (step_row(), MAX-reduced over the ranks; one
  /// rank: its own) and updates the correction. Returns the log line when it changed ("step 40:
  /// correction +4.1 % -> +0.3 % of the budget (+25,600 bytes + 0.50 % of the prediction)").
  /// Throws std::invalid_argument when the row has the wrong size or the ranks' usable bytes
  /// differ (every rank throws: their plans would differ).
  std::optional<std::string> end_step(std::int64_t step, const std::vector<double>& agreed_row);

  const Correction& correction() const { return correction_; }
  /// How much the correction shrinks the plans' budget: usable - planning_bytes(usable).
  double correction_bytes() const;
  /// The largest correction at the budget either way: half the budget.
  double bound_bytes() const { return 0.5 * static_cast<double>(usable_bytes_); }
  /// The agreed first step planned with the new correction (after end_step; the largest over the ranks).
  std::int64_t replan_from() const { return replan_from_; }
  /// One line per change of the correction.
  const std::vector<std::string>& log() const { return log_; }
  std::int64_t measured_microbatches() const { return measured_microbatches_; }
  /// The most negative (corrected - peak) / peak recorded on this rank (0 when none under).
  double worst_rel_error() const { return worst_rel_error_; }
  std::int64_t usable_bytes() const { return usable_bytes_; }
  const CalibrationOptions& options() const { return options_; }

  /// A step's row before any point: -inf per slope, then +inf and -inf (the smallest and the
  /// largest prediction measured).
  static std::vector<double> empty_row();

  /// The correction, its window and log (what a checkpoint keeps).
  CalibrationState state() const;
  /// Restores a state() (a window longer than window_steps keeps its last rows). Throws
  /// std::invalid_argument naming what is wrong ("calibration state: ..."), changing nothing.
  void load_state(CalibrationState state);

 private:
  using Row = std::vector<double>;  // per slope the least intercept, then min and max prediction
  Correction updated(const Row& measured, const std::vector<Row>& window) const;

  std::int64_t usable_bytes_;
  CalibrationOptions options_;
  Correction correction_;
  std::vector<std::string> log_;
  std::int64_t measured_microbatches_ = 0;
  double worst_rel_error_ = 0;
  std::vector<Row> window_;  // the last window_steps steps' rows, oldest first
  Row step_;
  std::int64_t steps_seen_ = 0;
  std::int64_t replan_from_ = 0;
};

}  // namespace xpm
