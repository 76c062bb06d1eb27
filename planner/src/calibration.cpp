// The calibration's line over measured peaks and its agreement over ranks (calibration.hpp).
#include "xpm/planner/calibration.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

namespace xpm {
namespace {

constexpr std::size_t kSlopes = 101;
constexpr double kHeadroomSlope = 0.0025;  // the grid's next slope: 0.25 % of the prediction
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

std::string change_line(std::int64_t step, double before_percent, double after_percent, const Correction& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %lld: correction %+.1f %% -> %+.1f %% of the budget (%s bytes %c %.2f %% of "
                "the prediction)", static_cast<long long>(step), before_percent, after_percent,
                signed_bytes(c.intercept_bytes).c_str(), c.slope >= 0 ? '+' : '-', 100.0 * std::fabs(c.slope));
  return buf;
}

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

std::size_t Calibration::row_size() { return kSlopes + 2 + 3; }

void Calibration::record_peak(double predicted_bytes, double peak_bytes) {
  for (const auto& [name, value] : {std::pair{"predicted_bytes", predicted_bytes}, std::pair{"peak_bytes", peak_bytes}})
    if (!(std::isfinite(value) && value >= 0)) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%g", value);
      throw std::invalid_argument(std::string("Calibration.record_peak: ") + name +
                                  " must be a finite number of bytes >= 0, got " + buf);
    }
  if (peak_bytes == 0 || predicted_bytes == 0) return;
  add_point(step_, predicted_bytes, peak_bytes);
  ++measured_microbatches_;
  const double corrected = predicted_bytes + correction_.bytes_for(predicted_bytes);
  worst_rel_error_ = std::min(worst_rel_error_, (corrected - peak_bytes) / peak_bytes);
}

std::vector<double> Calibration::step_row(std::int64_t replan_from) const {
  std::vector<double> row = step_;
  row[kSlopes] = -row[kSlopes];  // the smallest prediction, as a maximum
  const double usable = static_cast<double>(usable_bytes_);
  row.insert(row.end(), {static_cast<double>(replan_from), usable, -usable});
  for (double& v : row)
    if (!std::isfinite(v)) v = kEncodedMinusInf;
  return row;
}

std::optional<std::string> Calibration::end_step(std::int64_t step, const std::vector<double>& agreed_row) {
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
  Row measured(agreed_row.begin(), agreed_row.end() - 3);
  for (double& v : measured)
    if (v < -1e299) v = -kInf;
  measured[kSlopes] = -measured[kSlopes];
  replan_from_ = static_cast<std::int64_t>(agreed_row[n - 3]);
  step_ = empty_row();
  const bool first = ++steps_seen_ == 1;
  if (!first) {  // the run's first step has no optimizer state: it may only raise
    window_.push_back(measured);
    if (window_.size() > static_cast<std::size_t>(options_.window_steps)) window_.erase(window_.begin());
  }
  const Correction target = updated(measured, window_.empty() || first ? std::vector<Row>{measured} : window_);
  if (target == correction_) return std::nullopt;
  const Correction old = correction_;
  correction_ = target;
  const double usable = static_cast<double>(usable_bytes_);
  log_.push_back(change_line(step, 100.0 * (usable - old.planning_bytes(usable)) / usable,
                             100.0 * correction_bytes() / usable, target));
  return log_.back();
}

// The best line over the window when the step's point lies above the line in force, or when
// settle_steps steps of the window lie under a lower one; else the line in force.
Correction Calibration::updated(const Row& measured, const std::vector<Row>& window) const {
  std::vector<Row> seen;
  for (const Row& row : window)
    if (std::isfinite(row[kSlopes + 1])) seen.push_back(row);
  if (seen.empty()) return correction_;
  const Correction target = best_line(seen, static_cast<double>(usable_bytes_));
  const std::vector<double>& slopes = correction_slopes();
  std::size_t index = 0;
  for (std::size_t j = 1; j < kSlopes; ++j)
    if (std::fabs(slopes[j] - correction_.slope) < std::fabs(slopes[index] - correction_.slope)) index = j;
  const bool above = std::isfinite(measured[kSlopes + 1]) && measured[index] > correction_.intercept_bytes;
  double low = kInf, high = -kInf;
  for (const Row& row : seen) {
    low = std::min(low, row[kSlopes]);
    high = std::max(high, row[kSlopes + 1]);
  }
  const bool settled = window_.size() >= static_cast<std::size_t>(std::min(options_.settle_steps, options_.window_steps));
  const bool lower = settled && target.bytes_for(low) < correction_.bytes_for(low) &&
                     target.bytes_for(high) < correction_.bytes_for(high);
  return above || lower ? target : correction_;
}

double Calibration::correction_bytes() const {
  const double usable = static_cast<double>(usable_bytes_);
  return usable - correction_.planning_bytes(usable);
}

CalibrationState Calibration::state() const { return {correction_, window_, steps_seen_, log_}; }

void Calibration::load_state(CalibrationState state) {
  if (state.steps_seen < 0)
    throw std::invalid_argument("calibration state: steps_seen must be >= 0, got " + std::to_string(state.steps_seen));
  for (const Row& row : state.window)
    if (row.size() != kSlopes + 2)
      throw std::invalid_argument("calibration state: window rows of another shape (" + std::to_string(row.size()) +
                                  " numbers, expected " + std::to_string(kSlopes + 2) + ")");
  while (state.window.size() > static_cast<std::size_t>(options_.window_steps)) state.window.erase(state.window.begin());
  correction_ = state.correction;
  window_ = std::move(state.window);
  steps_seen_ = state.steps_seen;
  log_ = std::move(state.log);
}

nlohmann::json to_json(const CalibrationState& state) {
  nlohmann::json window = nlohmann::json::array();
  for (const auto& row : state.window) {
    nlohmann::json values = nlohmann::json::array();
    for (double v : row) values.push_back(std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr));
    window.push_back(std::move(values));
  }
  return {{"correction", {state.correction.intercept_bytes, state.correction.slope}},
          {"window", std::move(window)},
          {"steps_seen", state.steps_seen},
          {"log", state.log}};
}

CalibrationState calibration_state_from_json(const nlohmann::json& json) {
  try {
    CalibrationState state;
    const auto correction = json.at("correction").get<std::vector<double>>();
    if (correction.size() != 2) throw std::invalid_argument("correction must hold [intercept_bytes, slope]");
    state.correction = {correction[0], correction[1]};
    for (const auto& values : json.at("window")) {
      std::vector<double> row;
      for (std::size_t j = 0; j < values.size(); ++j) {
        const nlohmann::json& v = values.at(j);
        row.push_back(v.is_null() ? (j == kSlopes ? kInf : -kInf) : v.get<double>());
      }
      state.window.push_back(std::move(row));
    }
    state.steps_seen = json.at("steps_seen").get<std::int64_t>();
    state.log = json.at("log").get<std::vector<std::string>>();
    return state;
  } catch (const nlohmann::json::exception& error) {
    throw std::invalid_argument(std::string("calibration state: ") + error.what());
  }
}

}  // namespace xpm
