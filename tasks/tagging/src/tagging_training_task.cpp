// The tagging task as a TrainingTask, and its Learner options.
#include "xpm/tasks/tagging_training_task.hpp"

#include <algorithm>
#include <cstdio>

#include "xpm/trainer/options/lr_schedule.hpp"
#include "xpm/tasks/tagging_batch.hpp"

namespace xpm {

TaggingTrainingTask::TaggingTrainingTask(TaggingModelSetup& setup, const std::vector<EncodedSentence>& train,
                                         const std::vector<EncodedSentence>& validation, DistributedContext& dist)
    : setup_(setup), train_(train), validation_(validation, dist) {}

TrainingRecord TaggingTrainingTask::train_record(std::size_t index) const {
  const EncodedSentence& sentence = train_.at(index);
  const auto tokens = static_cast<double>(sentence.token_ids.size());
  const auto tagged = static_cast<double>(
      std::count_if(sentence.tag_ids.begin(), sentence.tag_ids.end(), [](std::int64_t t) { return t >= 0; }));
  return {{1.0, tokens}, tagged, tokens};
}

torch::Tensor TaggingTrainingTask::loss_sum(const std::vector<std::size_t>& records) {
  const TaggingBatch batch = collate(train_, records);
  return token_cross_entropy_sum(setup_.forward(batch.token_ids, batch.padding_mask), batch.tag_ids);
}

NamedMetrics TaggingTrainingTask::validate(const ValidationPlanFn& plan_of) {
  const ValidationMetrics m = validation_.run(setup_, plan_of);
  return {{"token_accuracy", m.token_accuracy},
          {"loss", m.loss},
          {"tokens", static_cast<double>(m.tokens)},
          {"scored_tokens", static_cast<double>(m.scored_tokens)},
          {"ooms", static_cast<double>(m.ooms)}};
}

torch::Tensor TaggingTrainingTask::probe_loss_sum(const std::vector<double>& dims) {
  const TaggingBatch batch = synthetic_batch(static_cast<std::int64_t>(dims.at(0)), static_cast<std::int64_t>(dims.at(1)),
                                             setup_.vocab_size(), setup_.num_tags());
  return token_cross_entropy_sum(setup_.forward(batch.token_ids, batch.padding_mask), batch.tag_ids);
}

std::string TaggingTrainingTask::describe(const NamedMetrics& metrics) const {
  char text[96];
  std::snprintf(text, sizeof text, "token accuracy %.4f, loss %.4f", metrics.at("token_accuracy"),
                metrics.at("loss"));
  return text;
}

const std::set<std::string>& tagging_settings_free_on_resume() {
  static const std::set<std::string> keys = {
      "run_dir",          "data_dir",           "threads",
      "log_every",        "quiet",              "memory_model_cache",
      "resume",           "stop_after_steps",   "checkpoint_every_steps",
      "checkpoint_every_epochs", "keep_checkpoints", "collective_timeout_s",
      "rendezvous_timeout_s", "backend", "sharding", "optimizer_checkpoint", "preemption_signal"};
  return keys;
}

LearnerOptions tagging_learner_options(const TaggingJobConfig& config,
                                       std::function<void(const std::string&)> log) {
  LearnerOptions options;
  options.run_dir = config.run_dir;
  options.epochs = config.epochs;
  options.max_steps = config.max_steps;
  options.outer_batch_size = config.outer_batch_size;
  options.sampler_seed = config.seed;
  // Linear warmup to the peak, then constant, or linear / cosine decay to 10 % of the peak.
  options.lr_schedule.kind = config.lr_schedule;
  options.lr_schedule.peak_learning_rate = config.learning_rate;
  options.lr_schedule.warmup_steps = config.warmup_steps;
  options.lr_schedule.final_fraction = 0.1;
  options.validation = config.validation_settings();
  options.checkpoints = config.checkpoint_settings();
  options.stop_after_steps = config.stop_after_steps;
  options.stop_signals = {SIGINT, SIGTERM};
  if (config.preemption_signal != 0 && config.preemption_signal != SIGINT && config.preemption_signal != SIGTERM) {
    options.stop_signals.push_back(config.preemption_signal);
  }
  options.log_every = config.log_every;
  options.underprediction_tolerance = config.underprediction_tolerance;
  options.loss_scaling = config.precision == Precision::k16Mixed;  // float16 gradients underflow without it
  options.optimizer_checkpoint = config.optimizer_checkpoint;
  options.bucket_cap_bytes = config.bucket_cap_bytes;
  options.checkpoint_kind = "xpm-tagging-job";
  options.config = config.to_json();
  options.resume_free_keys = tagging_settings_free_on_resume();
  options.log_prefix = "xpm-train";
  options.size_name = "tokens";  // metrics.jsonl's "real_tokens" and "tokens_per_s"
  options.log = std::move(log);
  options.oom_advice = "probe larger shapes with --probe-points, or lower --memory-fraction";
  return options;
}

}  // namespace xpm
