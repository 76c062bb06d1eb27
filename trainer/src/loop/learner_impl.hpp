// The Learner's state and steps, shared by learner.cpp (loop, steps, validation) and
// learner_state.cpp (checkpoints, resume, probing). Private to xpm::trainer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/trainer/loop/learner.hpp"
#include "xpm/trainer/loop/stop_signals.hpp"

namespace xpm {

struct Learner::Impl {
  Impl(TrainingTask& task, torch::optim::Optimizer& optimizer, LearnerOptions options,
       LearnerComponents components);

  // learner.cpp
  LearnerOutcome run();
  void run_epochs();
  void finish();
  struct OuterBatchRecords {
    std::vector<std::vector<double>> record_dims;  // each record's formula dims
    std::vector<double> record_units;              // each record's loss units
    double size = 0;                               // the records' sizes summed (throughput)
  };
  OuterBatchRecords read_outer_batch(const std::vector<std::size_t>& records) const;
  void train_one_step(const std::vector<std::size_t>& records);
  void check_consecutive_ooms() const;  // throws after 10 steps in a row out of memory
  nlohmann::json step_line(const GlobalStepResult& result, double lr, std::size_t records, double step_size,
                           std::int64_t underpredictions, double prediction_error) const;
  void log_progress(const GlobalStepResult& result);
  bool validate(std::int64_t epoch);  // true when the combined vote is kStop
  bool run_validation(std::int64_t epoch);
  void write_metrics_line(const nlohmann::json& line);
  void log(const std::string& line) const;
  EngineLog engine_log() const;  // what the engine's memory model logs and judges with

  // learner_state.cpp
  void build_memory_plan();
  void build_step_engine();
  void check_model_device() const;
  void set_up_data_parallel();
  void find_checkpoint_to_resume();
  void obtain_memory_model();
  void restore(const LearnerCheckpoint& checkpoint);
  void restore_optimizer_and_generator(const LearnerCheckpoint& checkpoint);
  void checkpoint(bool is_best);
  void write_checkpoint(bool is_best);
  std::vector<torch::Tensor> gather_generator_states();
  LearnerResumeState resume_state() const;
  std::int64_t capacity_bytes() const;

  TrainingTask& task;
  torch::optim::Optimizer& optimizer;
  LearnerOptions options;
  LearnerComponents parts;
  DistributedContext single_process;  // when parts.dist is null
  DistributedContext& dist;
  TrainState own_state;
  TrainState& state;
  std::optional<TrainerContext> own_context;
  TrainerContext& context;
  HookList no_hooks;
  HookList& hooks;
  std::optional<PredictiveBatcher> own_batcher;  // built from options.memory_plan
  std::shared_ptr<StepEngine> engine;            // parts.engine, or the predictive one built here
  std::optional<GradientBuckets> own_buckets;
  EarlyStopping early_stopping;
  std::optional<CheckpointStore> store;
  std::optional<DynamicLossScaler> loss_scaler;
  std::optional<StopSignals> stop_signals;  // options.stop_signals, installed by run()
  bool stop_agreed = false;                 // the last step's ranks agreed to stop (a signal)
  LearnerOutcome outcome;
  std::mt19937_64 sampler;
  std::vector<std::size_t> order;
  std::int64_t steps_per_epoch = 0;
  std::int64_t last_validation_step = -1;
  std::int64_t last_checkpoint_step = -1;
  bool memory_model_from_checkpoint = false;
  std::int64_t consecutive_oom_steps = 0;
};

}  // namespace xpm
