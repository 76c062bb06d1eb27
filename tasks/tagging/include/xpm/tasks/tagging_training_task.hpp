// xpm/tasks/tagging_training_task.hpp — the bundled tagging task as a TrainingTask
// (training_task.hpp), and the Learner's options from a TaggingJobConfig: what run_tagging_job
// hands to the generic Learner (learner.hpp).
//
//   TaggingData data = load_tagging_data(config);
//   TaggingModelSetup setup(config, data);
//   TaggingTrainingTask task(setup, data.train, validation_sentences, dist);
//   Learner learner(task, setup.optimizer(), tagging_learner_options(config, log), parts);
//
// Records: the train sentences, dims {bs = 1, l = tokens}, units = tokens with a known tag
// (the loss is summed over them), size = tokens. Validation: TrainerValidationLoss
// (tagging_validation.hpp): "token_accuracy", "loss", "tokens", "scored_tokens", "ooms".
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/loop/learner.hpp"
#include "xpm/tasks/tagging_job.hpp"
#include "xpm/tasks/tagging_task.hpp"
#include "xpm/tasks/tagging_validation.hpp"
#include "xpm/trainer/loop/training_task.hpp"

namespace xpm {

class TaggingTrainingTask : public TrainingTask {
 public:
  /// References are not owned and must outlive the task.
  TaggingTrainingTask(TaggingModelSetup& setup, const std::vector<EncodedSentence>& train,
                      const std::vector<EncodedSentence>& validation, DistributedContext& dist);

  torch::nn::Module& module() override { return setup_.module(); }
  std::size_t train_record_count() const override { return train_.size(); }
  TrainingRecord train_record(std::size_t index) const override;
  torch::Tensor loss_sum(const std::vector<std::size_t>& records) override;
  NamedMetrics validate(const ValidationPlanFn& plan_of) override;
  torch::Tensor probe_loss_sum(const std::vector<double>& dims) override;
  /// "token accuracy 0.9208, loss 0.2743".
  std::string describe(const NamedMetrics& metrics) const override;

 private:
  TaggingModelSetup& setup_;
  const std::vector<EncodedSentence>& train_;
  TrainerValidationLoss validation_;
};

/// TaggingJobConfig keys a resumed job may change: where things go, what is printed, how often
/// checkpoints are written, stopping, timeouts, and the sharding (the update is AdamW's either
/// way; the checkpoint's optimizer files decide what can be loaded). Every other one (model,
/// data, schedule, batcher, memory budget, validation) must equal the checkpoint's.
const std::set<std::string>& tagging_settings_free_on_resume();

/// The Learner's options for the job: schedule, validation, checkpoints, stopping, batch
/// size, log lines ("xpm-train: ..."), the config in every checkpoint's manifest.
/// Throws std::invalid_argument for a bad validation mode or LR schedule name.
LearnerOptions tagging_learner_options(const TaggingJobConfig& config,
                                       std::function<void(const std::string&)> log);

}  // namespace xpm
