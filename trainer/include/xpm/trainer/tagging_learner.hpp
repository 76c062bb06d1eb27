// xpm/trainer/tagging_learner.hpp — the tagging job's Learner loop (the reference's Learner):
// epochs x outer batches, one optimizer step each, hooks at the documented points, validation
// with best model and early stopping, listeners' votes, checkpoints, stop-after-steps.
// run_tagging_job (tagging_job.hpp) builds the parts and calls it; embedders use that.
//
//   TaggingLearner learner(parts, state, context, resume_from);
//   TaggingLearnerOutcome outcome = learner.run();   // every rank
//
// Per step (every rank): hooks.before_step; the batcher's step (gradients accumulated, then
// hooks.before_optimizer_step, then optimizer.step(), both only when the optimizer steps);
// state.step += 1; online corrections of the memory model (predictive batcher); metrics line;
// hooks.after_step unless the step was skipped by an out-of-memory error. Then, when due:
// validation (hooks.before_validation, TrainerValidationLoss, hooks.after_validation, the
// listeners' votes: EarlyStopping first, then the extensions' listeners; best_parameters.pt on
// a new best), then a checkpoint (when due by steps/epochs, on a new best while checkpointing,
// and at stop_after_steps), then stop if combine_votes says kStop or at stop_after_steps.
// At the end (unless stopped by stop_after_steps) a final validation unless one ran at this
// step, and a last checkpoint when checkpointing and none was written at this step.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/brown_corpus.hpp"
#include "xpm/trainer/data_parallel_trainer.hpp"
#include "xpm/trainer/distributed.hpp"
#include "xpm/trainer/fixed_batchers.hpp"
#include "xpm/trainer/gradient_buckets.hpp"
#include "xpm/trainer/tagging_checkpoint.hpp"
#include "xpm/trainer/tagging_job.hpp"
#include "xpm/trainer/tagging_run_counters.hpp"
#include "xpm/trainer/tagging_task.hpp"
#include "xpm/trainer/tagging_validation.hpp"
#include "xpm/trainer/train_context.hpp"
#include "xpm/trainer/validation.hpp"

namespace xpm {

/// What the loop works with (not owned; all outlive the learner).
struct TaggingLearnerParts {
  const TaggingJobConfig* config = nullptr;
  DistributedContext* dist = nullptr;
  TaggingJobExtensions* extensions = nullptr;
  const std::vector<EncodedSentence>* train = nullptr;
  const std::vector<EncodedSentence>* validation = nullptr;  // already cut to max_validation_sentences
  TaggingModelSetup* setup = nullptr;
  PredictiveBatcher* batcher = nullptr;  // has a model when predictive
  FixedBatcher* fixed_batcher = nullptr;  // fixed / power batcher; null for predictive
  PowerAdaptativeBatcher* power_batcher = nullptr;  // the same object when power
  MemoryMeter* meter = nullptr;
  GradientBuckets* buckets = nullptr;    // null in a single process
  std::int64_t capacity_bytes = 0;       // for the metrics lines
  std::function<void(const std::string&)> log;  // prints on rank 0
};

/// What run() returns for the summary.
struct TaggingLearnerOutcome {
  TaggingRunCounters counters;
  ValidationMetrics last_validation;   // the final one (or the last before stopping)
  double last_validation_s = 0;        // its wall time
  bool finished = true;                // false when stopped by stop_after_steps
  bool early_stopped = false;          // the listeners voted stop
  std::int64_t resumed_from_step = -1;  // -1: not resumed
  std::int64_t checkpoints_written = 0;  // by this process
  EarlyStopping::State best;           // best validation (after warmup)
  std::int64_t loss_scale_skipped_steps = 0;  // 16-mixed: steps skipped for inf/nan gradients
};

class TaggingLearner {
 public:
  /// `resume_from` (when set) is the checkpoint whose parameters the model already holds;
  /// run() restores the optimizer, generator, sampler, batcher, counters and listener state
  /// from it. Throws std::invalid_argument for bad validation settings.
  TaggingLearner(TaggingLearnerParts parts, TrainState& state, TrainerContext& context,
                 std::optional<TaggingCheckpoint> resume_from);

  /// Trains to state.total_steps (or an early stop, or stop_after_steps). Collective: every
  /// rank calls it. Throws what the steps throw (DistributedError, c10 errors), and
  /// std::runtime_error when a checkpoint cannot be written or read. Each error says where,
  /// in the class it had (error_context.hpp): "step 12: ...", "validation after step 40: ...",
  /// "checkpoint write of step 40: ...", "resume: ...".
  TaggingLearnerOutcome run();

 private:
  void restore(const TaggingCheckpoint& checkpoint);
  void restore_optimizer_and_generator(const TaggingCheckpoint& checkpoint);
  void train_one_step(const std::vector<std::size_t>& records);
  bool validate(std::int64_t epoch);  // true when the combined vote is kStop
  bool run_validation(std::int64_t epoch);
  void checkpoint(bool is_best);
  void write_checkpoint(bool is_best);
  std::vector<torch::Tensor> gather_generator_states();
  TaggingResumeState resume_state() const;
  void write_metrics_line(const nlohmann::json& line);
  void note_extrapolation(const GlobalStepResult& result);
  /// Each microbatch that ran out of memory becomes an infeasible bound of the memory model
  /// (the same on every rank: the dims are all-reduced). Returns how many.
  std::int64_t bound_out_of_memory_microbatches(const GlobalStepResult& result, std::int64_t step);
  /// The floor of the memory model at the step's microbatches (predictive batcher only).
  double planned_floor_bytes(const GlobalStepResult& result) const;

  TaggingLearnerParts parts_;
  const TaggingJobConfig& config_;
  DistributedContext& dist_;
  TrainState& state_;
  TrainerContext& context_;
  std::optional<TaggingCheckpoint> resume_from_;
  ValidationSettings validation_settings_;
  EarlyStopping early_stopping_;
  TrainerValidationLoss validation_;
  std::optional<CheckpointStore> store_;
  std::optional<DataParallelTrainer> trainer_;
  std::optional<DynamicLossScaler> loss_scaler_;  // precision 16-mixed (CUDA builds)
  TaggingLearnerOutcome outcome_;
  std::mt19937_64 sampler_;
  std::vector<std::size_t> order_;
  std::int64_t steps_per_epoch_ = 0;
  std::int64_t last_validation_step_ = -1;
  std::int64_t last_checkpoint_step_ = -1;
  bool extrapolation_noted_ = false;  // logged once per run
  std::int64_t consecutive_oom_steps_ = 0;
  struct FaultInjection {
    int rank = -1;
    std::int64_t step = -1;
    bool kill = false;
  } fault_;
};

}  // namespace xpm
