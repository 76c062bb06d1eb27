#include "xpm/trainer/loop/validation.hpp"

#include <cmath>
#include <stdexcept>
#include <string>
#include "xpm/planner/enum_names.hpp"

namespace xpm {
namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("ValidationSettings." + message);
}

}  // namespace

MetricMode default_metric_mode(const std::string& metric) {
  if (ends_with(metric, "accuracy")) return MetricMode::kMax;
  if (ends_with(metric, "loss")) return MetricMode::kMin;
  throw std::invalid_argument("validation metric '" + metric +
                              "' has no natural direction (names ending in 'accuracy' are "
                              "maximized, in 'loss' minimized): give the mode, min or max");
}

namespace {

// "auto" (no value): the direction the metric's name says (default_metric_mode).
constexpr EnumNames<std::optional<MetricMode>, 3> kModeChoices{
    {{MetricMode::kMin, "min"}, {MetricMode::kMax, "max"}, {std::nullopt, "auto"}}};

}  // namespace

std::optional<MetricMode> parse_metric_mode_choice(const std::string& text, const std::string& source) {
  return parse_enum(kModeChoices, text, source);
}

MetricMode parse_metric_mode(const std::string& text, const std::string& metric) {
  const std::optional<MetricMode> mode = parse_metric_mode_choice(text, "validation mode");
  return mode ? *mode : default_metric_mode(metric);
}

std::string to_string(MetricMode mode) { return enum_name(kModeChoices, std::optional<MetricMode>(mode)); }

void ValidationSettings::validate() const {
  require(every_steps >= 0, "every_steps must be >= 0, got " + std::to_string(every_steps));
  require(every_epochs >= 0, "every_epochs must be >= 0, got " + std::to_string(every_epochs));
  require(!metric.empty(), "metric must not be empty");
  require(warmup_validations >= 0,
          "warmup_validations must be >= 0, got " + std::to_string(warmup_validations));
  require(patience >= 0, "patience must be >= 0 (0: no early stopping), got " + std::to_string(patience));
}

bool ValidationSettings::due(std::int64_t step, std::int64_t epoch_completed) const {
  return (every_steps > 0 && step > 0 && step % every_steps == 0) ||
         (every_epochs > 0 && epoch_completed > 0 && epoch_completed % every_epochs == 0);
}

bool ValidationSettings::better(double candidate, double best) const {
  return mode == MetricMode::kMax ? candidate > best : candidate < best;
}

EarlyStopping::EarlyStopping(ValidationSettings settings) : settings_(std::move(settings)) {
  settings_.validate();
}

LearnerVote EarlyStopping::on_validation(const TrainerContext& context) {
  const std::string key = "validation/" + settings_.metric;
  const auto& metrics = context.metrics();
  const auto it = metrics.find(key);
  if (it == metrics.end() || !std::isfinite(it->second)) {
    std::string present;
    for (const auto& [name, value] : metrics) present += (present.empty() ? "" : ", ") + name;
    throw std::invalid_argument(
        "validation: the metric '" + key + "' (set_validation_every's, which picks the best parameters" +
        (settings_.patience > 0 ? " and stops early" : "") + ") " +
        (it == metrics.end() ? "is missing" : "is not finite (" + std::to_string(it->second) + ")") +
        "; the validation reported: " + (present.empty() ? "nothing" : present));
  }
  const double value = it->second;
  ++state_.validations;
  last_was_best_ = false;
  if (state_.validations <= settings_.warmup_validations) return LearnerVote::kNoDecision;
  if (!state_.best_value || settings_.better(value, *state_.best_value)) {
    state_.best_value = value;
    state_.best_step = context.state().step;
    state_.validations_since_best = 0;
    last_was_best_ = true;
  } else {
    ++state_.validations_since_best;
  }
  if (settings_.patience > 0 && state_.validations_since_best >= settings_.patience) {
    return LearnerVote::kStop;
  }
  return LearnerVote::kNoDecision;
}

nlohmann::json EarlyStopping::to_json() const {
  return {{"validations", state_.validations},
          {"best_value", state_.best_value ? nlohmann::json(*state_.best_value) : nlohmann::json()},
          {"best_step", state_.best_step},
          {"validations_since_best", state_.validations_since_best}};
}

void EarlyStopping::restore(const nlohmann::json& state) {
  try {
    State restored;
    restored.validations = state.at("validations").get<std::int64_t>();
    const nlohmann::json& best = state.at("best_value");
    if (!best.is_null()) restored.best_value = best.get<double>();
    restored.best_step = state.at("best_step").get<std::int64_t>();
    restored.validations_since_best = state.at("validations_since_best").get<std::int64_t>();
    state_ = restored;
    last_was_best_ = false;
  } catch (const nlohmann::json::exception& error) {
    throw std::invalid_argument("EarlyStopping::restore: malformed state " + state.dump() + ": " +
                                error.what());
  }
}

}  // namespace xpm
