// xpm/planner/calibration.hpp — the correction of a memory model's predictions from the peaks
// training measures: one policy for the Python sampler and the C++ Learner.
//
//   xpm::Calibration calibration(budget.usable_bytes());          // every rank, the same budget
//   for (std::size_t k = 0; k < step_microbatches.size(); ++k) {  // as they run
//     const auto& mb = step_microbatches[k];
//     calibration.record_peak(mb.predicted_bytes, mb.measured_peak_bytes,
//                             xpm::microbatch_position(k, step_microbatches.size()));
//   }
//   std::vector<double> row = calibration.step_row(/*replan_from=*/step + 1);
//   all_reduce_max(row);                                           // only where there are ranks
//   if (auto line = calibration.end_step(step, row)) log(*line);   // the correction changed
//   double fill = calibration.correction().planning_bytes(budget.usable_bytes());
//   // plan the steps from calibration.replan_from() on with predictions up to `fill`
//
// The correction is a line, intercept_bytes + slope x prediction, added to every prediction,
// and a line of their own for the microbatches of a position in their step (MicrobatchPosition:
// a step's first microbatch allocates the gradients among its activations, its last runs the
// optimizer step, so their peaks exceed the model's by other amounts) once those are measured
// (record_peak's position); each line is drawn as below over its own points from the same
// initial correction and holds for the predictions it has measured. Outside them a line that
// lowers takes off no larger a share of the prediction than at their nearest end, and above
// them that alone; else the larger of it and the common line, which below them grows no
// further than at their smallest (its slope mixes the positions: large first microbatches
// over-predicted and small last ones under tilt it down). A plan fits every line:
// Correction::planning_bytes is the least of their planning bytes.
// Its slope lies on a grid of -5 % to +20 % of the prediction, 0.25 % apart (0 included). Of
// the lines on or above every (prediction, measured peak) point of the last window_steps steps
// (the run's first step, which has no optimizer state, only raises), whose intercept is not
// below the constant line's (or 0), the line with the least sum of its corrections relative to
// the smallest and the largest prediction measured is taken, a tie to the smallest slope; then
// the grid's next slope (0.25 % of the prediction) is added as headroom, and the correction at
// a prediction of the whole budget is bounded to half the budget either way. A step whose
// point lies above the line in force raises it at once; a lower line is taken once a step
// (not the run's first) lies under it with 1 % of the prediction more headroom
// (CalibrationOptions::lower_early), and as drawn once settle_steps steps of the window do.
//
// Ranks: every rank records its own microbatches; step_row() encodes them (and the budget and
// the first step a rank could still plan anew) so that an element-wise MAX all-reduce of the
// rows over the ranks agrees them; end_step() then gives every rank the same correction. One
// rank: pass the row unreduced. Every rank must call end_step once per optimizer step.
//
// Units: bytes. Not thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xpm {

/// Where a microbatch runs in its rank's optimizer step, which changes what its peak holds
/// besides the activations the model predicts: kFirst, the first of several (after
/// zero_grad(set_to_none) the gradients are allocated among its activations); kMiddle; kLast,
/// the last of several (the gradients' synchronisation, and the optimizer step where the peak
/// measured includes it); kAlone, a step of one microbatch.
enum class MicrobatchPosition { kFirst = 0, kMiddle = 1, kLast = 2, kAlone = 3 };
inline constexpr std::size_t kMicrobatchPositions = 4;

/// The position of microbatch `index` (0-based) of a step of `count` microbatches. Throws
/// std::invalid_argument when index >= count.
MicrobatchPosition microbatch_position(std::size_t index, std::size_t count);
/// "first", "middle", "last" or "alone".
std::string to_string(MicrobatchPosition position);
/// The position named `text`; throws std::invalid_argument "<source> must be 'first', ... got 'x'".
MicrobatchPosition parse_microbatch_position(const std::string& text, const std::string& source);

/// One line, intercept_bytes + slope x prediction, drawn over predictions from low_bytes to
/// high_bytes (a position's line: the predictions it has measured).
struct CorrectionLine {
  double intercept_bytes = 0;
  double slope = 0;
  double low_bytes = 0;
  double high_bytes = 0;
  bool operator==(const CorrectionLine& o) const {
    return intercept_bytes == o.intercept_bytes && slope == o.slope && low_bytes == o.low_bytes &&
           high_bytes == o.high_bytes;
  }
};

/// Bytes added to a memory model's prediction: intercept_bytes + slope x prediction, or for a
/// microbatch at a position with a line of its own (`positions`), that line between the
/// predictions it has measured and outside them as the header comment says.
struct Correction {
  double intercept_bytes = 0;  // may be negative
  double slope = 0;            // 0.01: 1 % of the prediction
  /// Per MicrobatchPosition (its value as index): a line of its own, or none (the line above).
  std::array<std::optional<CorrectionLine>, kMicrobatchPositions> positions{};

  /// The correction of one prediction, bytes (the line above).
  double bytes_for(double predicted_bytes) const { return intercept_bytes + slope * predicted_bytes; }
  /// The correction of a prediction of a microbatch at `position`, bytes.
  double bytes_for(double predicted_bytes, MicrobatchPosition position) const;
  /// The largest prediction whose corrected value fits `usable_bytes` at every position:
  /// the least (usable_bytes - intercept_bytes) / (1 + slope) over the lines, and for a lowering
  /// position line the budget over 1 + its share at an end it may be extrapolated from.
  double planning_bytes(double usable_bytes) const;
  bool operator==(const Correction& o) const {
    return intercept_bytes == o.intercept_bytes && slope == o.slope && positions == o.positions;
  }
  bool operator!=(const Correction& o) const { return !(*this == o); }
};

/// The headroom a drawn line adds to its slope: the grid's next slope, 0.25 % of the prediction.
inline constexpr double kHeadroomSlope = 0.0025;
/// What a lower line adds besides until settle_steps steps lie under it (lower_early): 1 %.
inline constexpr double kEarlyHeadroomSlope = 0.01;

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
  int settle_steps = 8;   // steps measured (besides the run's first) before a lower line as drawn, >= 1
  Correction initial;     // in force before anything is measured (e.g. a model's reserved gap)
  /// A lower line after one step, with 1 % of the prediction more headroom until settle_steps
  /// steps: for allocated bytes, which repeat from step to step; false for reserved bytes,
  /// which move by whole segments with what the cache kept.
  bool lower_early = true;
};

/// What a checkpoint keeps of a Calibration.
struct CalibrationState {
  Correction correction;
  /// Per step of the window, oldest first: the least intercept per slope of correction_slopes(),
  /// then the smallest and the largest prediction measured (-inf / +inf / -inf: none).
  std::vector<std::vector<double>> window;
  std::int64_t steps_seen = 0;
  std::vector<std::string> log;
  /// The same window per MicrobatchPosition, of the microbatches recorded with that position
  /// (empty: none recorded).
  std::array<std::vector<std::vector<double>>, kMicrobatchPositions> position_windows{};
};

/// {"correction": [intercept_bytes, slope], "window": [[...], ...], "steps_seen", "log",
/// "positions": {"first": {"correction": [intercept_bytes, slope] or null, "window": [...]},
/// ...}}; the window's infinities (a step with no point) as null. "positions" is optional on
/// reading (a state written before positions had lines).
nlohmann::json to_json(const CalibrationState& state);
/// The inverse of to_json. Throws std::invalid_argument naming the field that is missing or malformed.
CalibrationState calibration_state_from_json(const nlohmann::json& json);

/// One microbatch's measured peak against its prediction, at its position in the step (none:
/// the correction's line alone), as record_peak takes it.
struct CalibrationPoint {
  double predicted_bytes = 0;
  double peak_bytes = 0;
  std::optional<MicrobatchPosition> position;
};

/// One optimizer step's points, every rank's (the same list on every rank), for redraw().
struct CalibrationStep {
  std::int64_t step = 0;     // its index, for the log
  bool run_first = false;    // the run's first step (no optimizer state: it may only raise)
  std::vector<CalibrationPoint> points;
};

class Calibration {
 public:
  /// Throws std::invalid_argument when usable_bytes <= 0 or an option is < 1 (message names it:
  /// "Calibration: settle_steps must be a whole number >= 1, got 0").
  explicit Calibration(std::int64_t usable_bytes, CalibrationOptions options = {});

  /// Records one microbatch's measured peak against the prediction it was planned with (this
  /// rank; no communication), with its position in the step where known (the point then also
  /// draws that position's line; a kAlone point draws only its own: a step's only microbatch
  /// holds both ends of a step at once, a gap the other positions, which fall back on the
  /// common line, do not have). A prediction or peak of 0 is skipped. Throws
  /// std::invalid_argument when either is not finite or negative ("Calibration.record_peak:
  /// peak_bytes must be a finite number of bytes >= 0, got nan").
  void record_peak(double predicted_bytes, double peak_bytes,
                   std::optional<MicrobatchPosition> position = std::nullopt);
  /// From now on a lower line is taken only once settled (CalibrationOptions::lower_early
  /// off): the peaks recorded are a caching allocator's reserved bytes. Every rank must call
  /// it before the same end_step, else the ranks draw different lines from the agreed rows.
  void lower_only_once_settled() { options_.lower_early = false; }

  /// This rank's step so far, encoded for an element-wise MAX all-reduce over the ranks
  /// (row_size() numbers), with `replan_from`, the first step this rank could still plan anew.
  std::vector<double> step_row(std::int64_t replan_from) const;
  /// The length of step_row().
  static std::size_t row_size();

  /// Ends an optimizer step with the agreed row (step_row(), MAX-reduced over the ranks; one
  /// rank: its own) and updates the correction. Returns the log line when a line changed ("step
  /// 40: correction +4.1 % -> +0.3 % of the budget (+25,600 bytes + 0.50 % of the prediction)",
  /// "; step 40: the last microbatch's correction ..." for a position's); a position's range of
  /// predictions may grow, or a position without points left in its window fall back to the
  /// correction's line, without a log line: correction() says it, compare it to replan.
  /// Throws std::invalid_argument when the row has the wrong size or the ranks' usable bytes
  /// differ (every rank throws: their plans would differ).
  std::optional<std::string> end_step(std::int64_t step, const std::vector<double>& agreed_row);

  /// The correction in force: its line, and the positions' lines drawn so far.
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

  /// Draws the correction anew from `steps` (oldest first, every rank's points: the same on
  /// every rank, so no collective), as if the run had measured them, e.g. predicted by a memory
  /// model refitted since (TrainingRefit): the correction, its window and the positions' lines
  /// replaced; the log, with `line` appended, and replan_from() kept. A first step that is not
  /// the run's first is preceded by an empty one, so that it joins the window. Throws
  /// std::invalid_argument as record_peak does.
  void redraw(const std::vector<CalibrationStep>& steps, const std::string& line);
  /// The correction, its window and log (what a checkpoint keeps).
  CalibrationState state() const;
  /// Restores a state() (a window longer than window_steps keeps its last rows). Throws
  /// std::invalid_argument naming what is wrong ("calibration state: ..."), changing nothing.
  void load_state(CalibrationState state);

 private:
  using Row = std::vector<double>;  // per slope the least intercept, then min and max prediction
  CorrectionLine updated(const CorrectionLine& in_force, const Row& measured, const std::vector<Row>& window,
                         std::size_t measured_steps) const;
  std::optional<CorrectionLine> updated_position(std::size_t position, const Row& measured, bool first) const;
  std::array<Row, 1 + kMicrobatchPositions> agreed_parts(const std::vector<double>& agreed_row) const;
  std::vector<std::string> update_lines(std::int64_t step, const std::array<Row, 1 + kMicrobatchPositions>& measured,
                                        bool first);
  static void push_row(std::vector<Row>& window, const Row& row, std::size_t window_steps);

  std::int64_t usable_bytes_;
  CalibrationOptions options_;
  Correction correction_;
  std::vector<std::string> log_;
  std::int64_t measured_microbatches_ = 0;
  double worst_rel_error_ = 0;
  std::vector<Row> window_;  // the last window_steps steps' rows, oldest first
  std::array<std::vector<Row>, kMicrobatchPositions> position_windows_;  // the same, per position
  Row step_;
  std::array<Row, kMicrobatchPositions> position_steps_;
  std::int64_t steps_seen_ = 0;
  std::int64_t replan_from_ = 0;
};

}  // namespace xpm
