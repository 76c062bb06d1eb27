// xpm/trainer/loop/validation.hpp — when to validate, which metric decides, and early stopping.
// The metric's direction is explicit (min or max): a lower loss is better in min mode.
//
//   ValidationSettings settings;
//   settings.every_steps = 100;           // validate every 100 optimizer steps
//   settings.metric = "loss";             // key of the validation metrics ("validation/loss")
//   settings.mode = MetricMode::kMin;     // a lower loss is better
//   settings.warmup_validations = 2;      // the first 2 validations decide nothing
//   settings.patience = 3;                // stop after 3 validations without improvement
//   EarlyStopping early_stopping(settings);
//   ...after each validation, with the metrics in context under the "validation" scope:
//   LearnerVote vote = early_stopping.on_validation(context);
//   if (early_stopping.last_was_best()) save_best_model();
//
// Warmup counts VALIDATIONS (not steps): validation number 1..W is neither a best-model
// candidate nor counted for patience, and votes kNoDecision; validation W+1 is the first best.
// Improvement is strict (max: value > best; min: value < best). Patience P > 0: the vote is
// kStop once P consecutive validations after the best did not improve on it; P = 0 never votes
// kStop (the best model is still tracked). State (to_json/restore) goes into checkpoints so a
// resumed run decides exactly as the uninterrupted one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "xpm/trainer/loop/learner_listener.hpp"
#include "xpm/trainer/loop/train_context.hpp"

namespace xpm {

/// Direction of a validation metric: kMax for accuracies, kMin for losses.
enum class MetricMode { kMin, kMax };

/// "min" -> kMin, "max" -> kMax; "auto" -> the metric's natural direction (default_metric_mode).
/// Throws std::invalid_argument naming the text otherwise.
MetricMode parse_metric_mode(const std::string& text, const std::string& metric);
/// "min", "max" or "auto" (nullopt: the direction the metric's name says). Throws
/// std::invalid_argument "<source> must be 'min', 'max' or 'auto', got '<text>'".
std::optional<MetricMode> parse_metric_mode_choice(const std::string& text, const std::string& source);
/// kMax for a metric whose name ends in "accuracy", kMin for one ending in "loss"; throws
/// std::invalid_argument for any other name (give the mode explicitly then).
MetricMode default_metric_mode(const std::string& metric);
std::string to_string(MetricMode mode);

struct ValidationSettings {
  std::int64_t every_steps = 0;          // validate every N optimizer steps (0: not by steps)
  std::int64_t every_epochs = 0;         // validate at the end of every N epochs (0: not by epochs)
  std::string metric = "loss";           // key of the validation metrics that decides
  MetricMode mode = MetricMode::kMin;    // which direction is better
  std::int64_t warmup_validations = 0;   // the first W validations decide nothing (>= 0)
  std::int64_t patience = 0;             // early stopping after P validations without gain (0: off)

  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
  /// True when a validation is due after `step` steps (every_steps) or at the end of epoch
  /// `epoch_completed` (1-based count of finished epochs; 0 when not at an epoch end).
  bool due(std::int64_t step, std::int64_t epoch_completed) const;
  /// True when `candidate` is strictly better than `best` in this mode.
  bool better(double candidate, double best) const;
};

/// The early-stopping listener; also tracks the best validation (best model).
class EarlyStopping : public LearnerListener {
 public:
  /// What it remembers between validations (saved in checkpoints).
  struct State {
    std::int64_t validations = 0;             // validations seen, warmup included
    std::optional<double> best_value;         // best metric value after warmup
    std::int64_t best_step = -1;              // state().step of the best validation
    std::int64_t validations_since_best = 0;  // validations after the best without improvement
  };

  /// Throws std::invalid_argument for bad settings.
  explicit EarlyStopping(ValidationSettings settings);

  std::string name() const override { return "early-stopping"; }
  /// Reads "validation/<metric>" from context.metrics() (throws std::invalid_argument naming
  /// the key and the metrics present when it is missing, or when it is not finite), updates the
  /// state and votes: kStop when patience > 0 and validations_since_best >= patience,
  /// otherwise kNoDecision (never kContinue). Same inputs on every rank give the same vote.
  LearnerVote on_validation(const TrainerContext& context) override;

  /// True when the last on_validation found a new best (after warmup).
  bool last_was_best() const { return last_was_best_; }
  const State& state() const { return state_; }
  const ValidationSettings& settings() const { return settings_; }

  /// {"validations", "best_value" (null when none), "best_step", "validations_since_best"}.
  nlohmann::json to_json() const;
  /// Restores a state written by to_json(). Throws std::invalid_argument for a malformed one.
  void restore(const nlohmann::json& state);

 private:
  ValidationSettings settings_;
  State state_;
  bool last_was_best_ = false;
};

}  // namespace xpm
