// The calibration's line over measured peaks and its agreement over ranks (calibration.hpp).
#include "xpm/planner/calibration.hpp"

#include "xpm/planner/enum_names.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

namespace xpm {
namespace {

constexpr std::size_t kSlopes = 101;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEncodedMinusInf = -1e300;  // a MAX all-reduce carries finite numbers only

double rounded(double value, double scale) { return std::nearbyint(value * scale) / scale; }

std::size_t zero_slope() {
  const std::vector<double>& slopes = correction_slopes();
  return static_cast<std::size_t>(std::find(slopes.begin(), slopes.end(), 0.0) - slopes.begin());
}

// "+25,600" for 25600.4: a sign, then whole bytes with thousands separators.
std::string signed_bytes(double value) {
  char digits[64];
  std::snprintf(digits, sizeof digits, "%.0f", std::fabs(value));
  std::string text(digits), grouped;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (i > 0 && (text.size() - i) % 3 == 0) grouped += ',';
    grouped += text[i];
  }
  return (std::signbit(value) ? "-" : "+") + grouped;
}

constexpr EnumNames<MicrobatchPosition, kMicrobatchPositions> kPositionNames{{{MicrobatchPosition::kFirst, "first"},
                                                                              {MicrobatchPosition::kMiddle, "middle"},
                                                                              {MicrobatchPosition::kLast, "last"},
                                                                              {MicrobatchPosition::kAlone, "alone"}}};

// What `line` takes off a budget of `usable` bytes, as a percentage of it.
double budget_percent(const CorrectionLine& line, double usable) {
  return 100.0 * (usable - (usable - line.intercept_bytes) / (1.0 + line.slope)) / usable;
}

// "step 40: correction +4.1 % -> +0.3 % of the budget (...)"; `what` names a position's line.
std::string change_line(std::int64_t step, const std::string& what, const CorrectionLine& before,
                        const CorrectionLine& after, double usable) {
  char buf[320];
  std::snprintf(buf, sizeof buf, "step %lld: %scorrection %+.1f %% -> %+.1f %% of the budget (%s bytes %c %.2f %% "
                "of the prediction)", static_cast<long long>(step), what.c_str(), budget_percent(before, usable),
                budget_percent(after, usable), signed_bytes(after.intercept_bytes).c_str(), after.slope >= 0 ? '+' : '-',
                100.0 * std::fabs(after.slope));
  return buf;
}

CorrectionLine line_of(const Correction& c) { return {c.intercept_bytes, c.slope, 0, 0}; }

bool same_line(const CorrectionLine& a, const CorrectionLine& b) {
  return a.intercept_bytes == b.intercept_bytes && a.slope == b.slope;
}

bool has_point(const std::vector<double>& row) { return std::isfinite(row[kSlopes + 1]); }

// Of the lines over every point of `rows`, the one calibration.hpp describes.
Correction best_line(const std::vector<std::vector<double>>& rows, double usable_bytes) {
  const std::vector<double>& slopes = correction_slopes();
  std::vector<double> intercepts(kSlopes, -kInf);
  double low = kInf, high = -kInf;
  for (const auto& row : rows) {
    for (std::size_t j = 0; j < kSlopes; ++j) intercepts[j] = std::max(intercepts[j], row[j]);
    low = std::min(low, row[kSlopes]);
    high = std::max(high, row[kSlopes + 1]);
  }
  // No line below the constant one at a prediction of 0: a steep line through large
  // microbatches alone would under-correct the small ones it has not seen.
  const double least = std::min(0.0, intercepts[zero_slope()]);
  for (double& intercept : intercepts) intercept = std::max(intercept, least);
  std::size_t k = 0;
  double best = kInf;
  for (std::size_t j = 0; j < kSlopes; ++j) {
    const double relative =
        rounded((intercepts[j] + slopes[j] * low) / low + (intercepts[j] + slopes[j] * high) / high, 1e9);
    if (relative < best || (relative == best && std::fabs(slopes[j]) < std::fabs(slopes[k]))) {
      best = relative;
      k = j;
    }
  }
  double intercept = intercepts[k];
  if (k + 1 < kSlopes) {
    ++k;
  } else {
    intercept += kHeadroomSlope * usable_bytes;
  }
  const double at_budget = intercept + slopes[k] * usable_bytes;
  if (std::fabs(at_budget) > 0.5 * usable_bytes) intercept -= at_budget - std::copysign(0.5 * usable_bytes, at_budget);
  return {intercept, slopes[k]};
}

// `line` with kEarlyHeadroomSlope more of the prediction (the grid's largest slope at most,
// the rest as bytes at the budget): a line drawn over fewer than settle_steps steps.
Correction with_early_headroom(Correction line, double usable_bytes) {
  const double slope = std::min(line.slope + kEarlyHeadroomSlope, correction_slopes().back());
  line.intercept_bytes += (line.slope + kEarlyHeadroomSlope - slope) * usable_bytes;
  line.slope = rounded(slope, 1e6);
  return line;
}

double line_at(const CorrectionLine& line, double predicted_bytes) {
  return line.intercept_bytes + line.slope * predicted_bytes;
}

// The share of a prediction `line` adds there (0 at a prediction of 0 bytes).
double share_at(const CorrectionLine& line, double predicted_bytes) {
  return predicted_bytes > 0 ? line_at(line, predicted_bytes) / predicted_bytes : 0.0;
}

void add_point(std::vector<double>& row, double predicted_bytes, double peak_bytes) {
  const std::vector<double>& slopes = correction_slopes();
  for (std::size_t j = 0; j < kSlopes; ++j) row[j] = std::max(row[j], peak_bytes - predicted_bytes * (1.0 + slopes[j]));
  row[kSlopes] = std::min(row[kSlopes], predicted_bytes);
  row[kSlopes + 1] = std::max(row[kSlopes + 1], predicted_bytes);
}

void check_option(const char* name, int value) {
  if (value < 1)
    throw std::invalid_argument(std::string("Calibration: ") + name + " must be a whole number >= 1, got " +
                                std::to_string(value));
}

}  // namespace

const std::vector<double>& correction_slopes() {
  static const std::vector<double> slopes = [] {
    std::vector<double> s(kSlopes);
    for (std::size_t j = 0; j < kSlopes; ++j) s[j] = rounded(-0.05 + 0.0025 * static_cast<double>(j), 1e6);
    return s;
  }();
  return slopes;
}

MicrobatchPosition microbatch_position(std::size_t index, std::size_t count) {
  if (index >= count)
    throw std::invalid_argument("microbatch_position: index " + std::to_string(index) + " of a step of " +
                                std::to_string(count) + " microbatches");
  if (count == 1) return MicrobatchPosition::kAlone;
  if (index == 0) return MicrobatchPosition::kFirst;
  return index + 1 == count ? MicrobatchPosition::kLast : MicrobatchPosition::kMiddle;
}

std::string to_string(MicrobatchPosition position) { return enum_name(kPositionNames, position); }

MicrobatchPosition parse_microbatch_position(const std::string& text, const std::string& source) {
  return parse_enum(kPositionNames, text, source);
}

double Correction::bytes_for(double predicted_bytes, MicrobatchPosition position) const {
  const std::optional<CorrectionLine>& own = positions[static_cast<std::size_t>(position)];
  if (!own) return bytes_for(predicted_bytes);
  const double bytes_own = line_at(*own, predicted_bytes);
  if (own->low_bytes <= predicted_bytes && predicted_bytes <= own->high_bytes) return bytes_own;
  // Outside its range a line that lowers takes off no larger a share of the prediction than at
  // the nearest prediction it measured (a constant drawn over large microbatches would take most
  // of a small one's prediction away), and above its range that share holds: what a position
  // adds beyond the model (gradients, the optimizer step) grows slower than the prediction.
  const bool above = predicted_bytes > own->high_bytes;
  const double share = share_at(*own, above ? own->high_bytes : own->low_bytes);
  const double bytes = share < 0 ? std::max(bytes_own, share * predicted_bytes) : bytes_own;
  if (above && share < 0) return bytes;
  // Else the larger of it and the common line, which below the range grows no further than at
  // its low end: the common line's slope mixes the positions (large first microbatches
  // over-predicted and small last ones under tilt it down), and extrapolated to smaller
  // predictions a negative one grows without bound.
  const double common =
      above ? bytes_for(predicted_bytes) : std::min(bytes_for(predicted_bytes), bytes_for(own->low_bytes));
  return std::max(bytes, common);
}

double Correction::planning_bytes(double usable_bytes) const {
  double least = (usable_bytes - intercept_bytes) / (1.0 + slope);
  for (const std::optional<CorrectionLine>& own : positions)
    if (own) {
      least = std::min(least, (usable_bytes - own->intercept_bytes) / (1.0 + own->slope));
      // Outside its range a lowering line takes off its share at the nearest end, no more:
      // above the range, and below it where the budget lies below the range.
      const double high = share_at(*own, own->high_bytes), low = share_at(*own, own->low_bytes);
      if (-1 < high && high < 0) least = std::min(least, usable_bytes / (1.0 + high));
      if (-1 < low && low < 0 && usable_bytes / (1.0 + low) < own->low_bytes)
        least = std::min(least, usable_bytes / (1.0 + low));
    }
  return least;
}

Correction covering_correction(const std::vector<double>& predicted_bytes, const std::vector<double>& peak_bytes,
                               double usable_bytes) {
  if (predicted_bytes.size() != peak_bytes.size())
    throw std::invalid_argument("covering_correction: " + std::to_string(predicted_bytes.size()) +
                                " predictions but " + std::to_string(peak_bytes.size()) + " peaks");
  if (!(usable_bytes > 0))
    throw std::invalid_argument("covering_correction: usable_bytes must be > 0, got " + std::to_string(usable_bytes));
  std::vector<double> row = Calibration::empty_row();
  for (std::size_t i = 0; i < predicted_bytes.size(); ++i)
    if (predicted_bytes[i] > 0 && peak_bytes[i] > 0) add_point(row, predicted_bytes[i], peak_bytes[i]);
  return std::isfinite(row[kSlopes + 1]) ? best_line({row}, usable_bytes) : Correction{};
}

Calibration::Calibration(std::int64_t usable_bytes, CalibrationOptions options)
    : usable_bytes_(usable_bytes), options_(options), correction_(options.initial), step_(empty_row()) {
  position_steps_.fill(empty_row());
  if (usable_bytes <= 0)
    throw std::invalid_argument("Calibration: usable_bytes must be > 0, got " + std::to_string(usable_bytes));
  check_option("window_steps", options.window_steps);
  check_option("settle_steps", options.settle_steps);
}

Calibration::Row Calibration::empty_row() {
  Row row(kSlopes, -kInf);
  row.push_back(kInf);
  row.push_back(-kInf);
  return row;
}

std::size_t Calibration::row_size() { return (1 + kMicrobatchPositions) * (kSlopes + 2) + 3; }

void Calibration::record_peak(double predicted_bytes, double peak_bytes, std::optional<MicrobatchPosition> position) {
  for (const auto& [name, value] : {std::pair{"predicted_bytes", predicted_bytes}, std::pair{"peak_bytes", peak_bytes}})
    if (!(std::isfinite(value) && value >= 0)) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%g", value);
      throw std::invalid_argument(std::string("Calibration.record_peak: ") + name +
                                  " must be a finite number of bytes >= 0, got " + buf);
    }
  if (peak_bytes == 0 || predicted_bytes == 0) return;
  // A step's only microbatch holds both ends of a step at once (the gradients allocated among
  // its activations, the synchronisation and the optimizer step): its gap is its own line's,
  // not the common line's, which the other positions fall back on outside their ranges.
  if (position != MicrobatchPosition::kAlone) add_point(step_, predicted_bytes, peak_bytes);
  if (position) add_point(position_steps_[static_cast<std::size_t>(*position)], predicted_bytes, peak_bytes);
  ++measured_microbatches_;
  const double corrected =
      predicted_bytes + (position ? correction_.bytes_for(predicted_bytes, *position) : correction_.bytes_for(predicted_bytes));
  worst_rel_error_ = std::min(worst_rel_error_, (corrected - peak_bytes) / peak_bytes);
}

std::vector<double> Calibration::step_row(std::int64_t replan_from) const {
  std::vector<double> row;
  row.reserve(row_size());
  for (const Row* part : {&step_, &position_steps_[0], &position_steps_[1], &position_steps_[2], &position_steps_[3]}) {
    row.insert(row.end(), part->begin(), part->end());
    row[row.size() - 2] = -row[row.size() - 2];  // the smallest prediction, as a maximum
  }
  const double usable = static_cast<double>(usable_bytes_);
  row.insert(row.end(), {static_cast<double>(replan_from), usable, -usable});
  for (double& v : row)
    if (!std::isfinite(v)) v = kEncodedMinusInf;
  return row;
}

// The agreed row's parts (the correction's, then each position's), infinities decoded, after
// checking its size and that every rank plans under the same budget.
std::array<std::vector<double>, 1 + kMicrobatchPositions> Calibration::agreed_parts(
    const std::vector<double>& agreed_row) const {
  if (agreed_row.size() != row_size())
    throw std::invalid_argument("Calibration.end_step: the agreed row holds " + std::to_string(agreed_row.size()) +
                                " numbers, expected " + std::to_string(row_size()) + " (step_row())");
  const std::size_t n = agreed_row.size();
  if (agreed_row[n - 2] != -agreed_row[n - 1]) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%.0f to %.0f usable bytes; this rank %lld", -agreed_row[n - 1], agreed_row[n - 2],
                  static_cast<long long>(usable_bytes_));
    throw std::invalid_argument(std::string("xpm: the ranks plan under different budgets (") + buf +
                                "): give every rank the same usable_bytes, else their plans and corrections differ");
  }
  std::array<Row, 1 + kMicrobatchPositions> parts;
  for (std::size_t part = 0; part < parts.size(); ++part) {
    const auto begin = agreed_row.begin() + static_cast<std::ptrdiff_t>(part * (kSlopes + 2));
    parts[part].assign(begin, begin + static_cast<std::ptrdiff_t>(kSlopes + 2));
    for (double& v : parts[part])
      if (v < -1e299) v = -kInf;
    parts[part][kSlopes] = -parts[part][kSlopes];
  }
  return parts;
}

std::optional<std::string> Calibration::end_step(std::int64_t step, const std::vector<double>& agreed_row) {
  const std::array<Row, 1 + kMicrobatchPositions> measured = agreed_parts(agreed_row);
  replan_from_ = static_cast<std::int64_t>(agreed_row[agreed_row.size() - 3]);
  step_ = empty_row();
  position_steps_.fill(empty_row());
  const bool first = ++steps_seen_ == 1;
  if (!first) {  // the run's first step has no optimizer state: it may only raise
    push_row(window_, measured[0], static_cast<std::size_t>(options_.window_steps));
    for (std::size_t p = 0; p < kMicrobatchPositions; ++p)
      push_row(position_windows_[p], measured[1 + p], static_cast<std::size_t>(options_.window_steps));
  }
  const std::vector<std::string> lines = update_lines(step, measured, first);
  if (lines.empty()) return std::nullopt;
  std::string joined;
  for (const std::string& line : lines) joined += (joined.empty() ? "" : "; ") + line;
  log_.push_back(joined);
  return log_.back();
}

// The correction's line and each position's updated from the step's points; one log line per
// line that changed (a position's that became the correction's new line is said once).
std::vector<std::string> Calibration::update_lines(std::int64_t step,
                                                   const std::array<Row, 1 + kMicrobatchPositions>& measured,
                                                   bool first) {
  const double usable = static_cast<double>(usable_bytes_);
  std::vector<std::string> lines;
  const CorrectionLine before = line_of(correction_);
  const std::size_t with_points = static_cast<std::size_t>(std::count_if(window_.begin(), window_.end(), has_point));
  const CorrectionLine after = updated(before, measured[0],
                                      window_.empty() || first ? std::vector<Row>{measured[0]} : window_,
                                      first ? 0 : with_points);
  if (!(after == before)) lines.push_back(change_line(step, "", before, after, usable));
  std::array<std::optional<CorrectionLine>, kMicrobatchPositions> positions;
  for (std::size_t p = 0; p < kMicrobatchPositions; ++p) {
    positions[p] = updated_position(p, measured[1 + p], first);
    if (!positions[p]) continue;
    const CorrectionLine was = correction_.positions[p].value_or(line_of(options_.initial));
    const bool said = same_line(*positions[p], after) && !same_line(after, before);
    if (!same_line(*positions[p], was) && !said) {
      lines.push_back(change_line(step, "the " + to_string(static_cast<MicrobatchPosition>(p)) + " microbatch's ",
                                  was, *positions[p], usable));
    }
  }
  correction_.intercept_bytes = after.intercept_bytes;
  correction_.slope = after.slope;
  correction_.positions = positions;
  return lines;
}

void Calibration::push_row(std::vector<Row>& window, const Row& row, std::size_t window_steps) {
  window.push_back(row);
  if (window.size() > window_steps) window.erase(window.begin());
}

// A position's line: none until a microbatch at that position is measured; then, from the
// initial correction, updated over its own window as the correction's line is.
std::optional<CorrectionLine> Calibration::updated_position(std::size_t position, const Row& measured,
                                                            bool first) const {
  const std::vector<Row>& window = position_windows_[position];
  const std::optional<CorrectionLine>& in_force = correction_.positions[position];
  const bool measured_now = has_point(measured);
  const std::vector<Row> rows = window.empty() || first ? std::vector<Row>{measured} : window;
  const std::size_t with_points = static_cast<std::size_t>(std::count_if(rows.begin(), rows.end(), has_point));
  // None measured yet, or none left in its window: the correction's line again.
  if (!measured_now && (!in_force || (!first && with_points == 0))) return std::nullopt;
  const CorrectionLine was = in_force.value_or(line_of(options_.initial));
  CorrectionLine line = updated(was, measured, rows, first ? 0 : with_points);
  // The predictions it holds for: those its line was drawn over, and those measured under it since.
  const bool drawn = !in_force || !same_line(line, was);
  line.low_bytes = drawn ? kInf : in_force->low_bytes;
  line.high_bytes = drawn ? -kInf : in_force->high_bytes;
  for (const Row& row : drawn ? rows : std::vector<Row>{measured}) {  // rows without a point change nothing
    line.low_bytes = std::min(line.low_bytes, row[kSlopes]);
    line.high_bytes = std::max(line.high_bytes, row[kSlopes + 1]);
  }
  return line;
}

// The best line over the window when the step's point lies above the line in force; a lower
// one when the window's `measured_steps` steps (the run's first not counted) lie under it, with
// kEarlyHeadroomSlope more headroom until settle_steps of them do; else the line in force.
CorrectionLine Calibration::updated(const CorrectionLine& in_force, const Row& measured, const std::vector<Row>& window,
                                    std::size_t measured_steps) const {
  std::vector<Row> seen;
  for (const Row& row : window)
    if (has_point(row)) seen.push_back(row);
  if (seen.empty()) return in_force;
  Correction target = best_line(seen, static_cast<double>(usable_bytes_));
  const std::vector<double>& slopes = correction_slopes();
  std::size_t index = 0;
  for (std::size_t j = 1; j < kSlopes; ++j)
    if (std::fabs(slopes[j] - in_force.slope) < std::fabs(slopes[index] - in_force.slope)) index = j;
  const bool above = has_point(measured) && measured[index] > in_force.intercept_bytes;
  double low = kInf, high = -kInf;
  for (const Row& row : seen) {
    low = std::min(low, row[kSlopes]);
    high = std::max(high, row[kSlopes + 1]);
  }
  const bool settled =
      measured_steps >= static_cast<std::size_t>(std::min(options_.settle_steps, options_.window_steps));
  if (!above && !settled) target = with_early_headroom(target, static_cast<double>(usable_bytes_));
  const bool lower = (settled || options_.lower_early) && measured_steps > 0 &&
                     target.bytes_for(low) < line_at(in_force, low) && target.bytes_for(high) < line_at(in_force, high);
  if (!(above || lower)) return in_force;
  CorrectionLine drawn = line_of(target);
  drawn.low_bytes = in_force.low_bytes;
  drawn.high_bytes = in_force.high_bytes;
  return drawn;
}

double Calibration::correction_bytes() const {
  const double usable = static_cast<double>(usable_bytes_);
  return usable - correction_.planning_bytes(usable);
}

void Calibration::redraw(const std::vector<CalibrationStep>& steps, const std::string& line) {
  Calibration drawn(usable_bytes_, options_);
  if (!steps.empty() && !steps.front().run_first) drawn.end_step(steps.front().step - 1, drawn.step_row(0));
  for (const CalibrationStep& step : steps) {
    for (const CalibrationPoint& point : step.points) drawn.record_peak(point.predicted_bytes, point.peak_bytes, point.position);
    drawn.end_step(step.step, drawn.step_row(replan_from_));
  }
  correction_ = drawn.correction_;
  window_ = std::move(drawn.window_);
  position_windows_ = std::move(drawn.position_windows_);
  steps_seen_ = std::max(steps_seen_, drawn.steps_seen_);
  log_.push_back(line);
}

CalibrationState Calibration::state() const {
  return {correction_, window_, steps_seen_, log_, position_windows_};
}

void Calibration::load_state(CalibrationState state) {
  if (state.steps_seen < 0)
    throw std::invalid_argument("calibration state: steps_seen must be >= 0, got " + std::to_string(state.steps_seen));
  std::vector<std::vector<Row>*> windows{&state.window};
  for (auto& window : state.position_windows) windows.push_back(&window);
  for (std::vector<Row>* window : windows) {
    for (const Row& row : *window)
      if (row.size() != kSlopes + 2)
        throw std::invalid_argument("calibration state: window rows of another shape (" + std::to_string(row.size()) +
                                    " numbers, expected " + std::to_string(kSlopes + 2) + ")");
    while (window->size() > static_cast<std::size_t>(options_.window_steps)) window->erase(window->begin());
  }
  correction_ = state.correction;
  window_ = std::move(state.window);
  position_windows_ = std::move(state.position_windows);
  steps_seen_ = state.steps_seen;
  log_ = std::move(state.log);
}

namespace {

nlohmann::json window_to_json(const std::vector<std::vector<double>>& rows) {
  nlohmann::json window = nlohmann::json::array();
  for (const auto& row : rows) {
    nlohmann::json values = nlohmann::json::array();
    for (double v : row) values.push_back(std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr));
    window.push_back(std::move(values));
  }
  return window;
}

std::vector<std::vector<double>> window_from_json(const nlohmann::json& window) {
  std::vector<std::vector<double>> rows;
  for (const auto& values : window) {
    std::vector<double> row;
    for (std::size_t j = 0; j < values.size(); ++j) {
      const nlohmann::json& v = values.at(j);
      row.push_back(v.is_null() ? (j == kSlopes ? kInf : -kInf) : v.get<double>());
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

CorrectionLine line_from_json(const nlohmann::json& json, const std::string& field, std::size_t size) {
  const auto values = json.get<std::vector<double>>();
  if (values.size() != size)
    throw std::invalid_argument(field + (size == 2 ? " must hold [intercept_bytes, slope]"
                                                   : " must hold [intercept_bytes, slope, low_bytes, high_bytes]"));
  return {values[0], values[1], size == 4 ? values[2] : 0.0, size == 4 ? values[3] : 0.0};
}

}  // namespace

nlohmann::json to_json(const CalibrationState& state) {
  nlohmann::json positions = nlohmann::json::object();
  for (std::size_t p = 0; p < kMicrobatchPositions; ++p) {
    const std::optional<CorrectionLine>& line = state.correction.positions[p];
    if (!line && state.position_windows[p].empty()) continue;
    positions[to_string(static_cast<MicrobatchPosition>(p))] = {
        {"correction", line ? nlohmann::json{line->intercept_bytes, line->slope, line->low_bytes, line->high_bytes}
                            : nlohmann::json(nullptr)},
        {"window", window_to_json(state.position_windows[p])}};
  }
  return {{"correction", {state.correction.intercept_bytes, state.correction.slope}},
          {"window", window_to_json(state.window)},
          {"steps_seen", state.steps_seen},
          {"log", state.log},
          {"positions", std::move(positions)}};
}

CalibrationState calibration_state_from_json(const nlohmann::json& json) {
  try {
    CalibrationState state;
    const CorrectionLine line = line_from_json(json.at("correction"), "correction", 2);
    state.correction.intercept_bytes = line.intercept_bytes;
    state.correction.slope = line.slope;
    state.window = window_from_json(json.at("window"));
    state.steps_seen = json.at("steps_seen").get<std::int64_t>();
    state.log = json.at("log").get<std::vector<std::string>>();
    if (json.contains("positions")) {
      for (const auto& [name, record] : json.at("positions").items()) {
        const auto p = static_cast<std::size_t>(parse_microbatch_position(name, "calibration state: positions' key"));
        if (!record.at("correction").is_null())
          state.correction.positions[p] =
              line_from_json(record.at("correction"), "positions." + name + ".correction", 4);
        state.position_windows[p] = window_from_json(record.at("window"));
      }
    }
    return state;
  } catch (const nlohmann::json::exception& error) {
    throw std::invalid_argument(std::string("calibration state: ") + error.what());
  } catch (const std::invalid_argument& error) {
    const std::string what = error.what();
    throw std::invalid_argument(what.rfind("calibration state: ", 0) == 0 ? what : "calibration state: " + what);
  }
}

}  // namespace xpm
