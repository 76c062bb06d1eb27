// xpm/trainer/loop/learner.hpp — the training loop of any model: epochs or
// a step budget over a TrainingTask (training_task.hpp), one optimizer step per outer batch with
// the microbatches its step engine runs (step_engine.hpp; by default the predictive one, whose
// batcher plans them from a memory model), LR schedule, hooks, validation with best model
// and early stopping, listeners' votes, checkpoints with exact resume, single process or data
// parallel.
//
//   #include "xpm/planner_torch/device_meter.hpp"
//   auto meter = xpm::make_device_meter(torch::kCPU, 200'000'000);  // the cap, given once; before the model
//   MyTask task;                                     // a TrainingTask: records, loss_sum, validation
//   torch::optim::Adam optimizer(task.module().parameters(), 1e-3);
//   auto options = xpm::LearnerOptions().set_run_dir("runs/mine").set_epochs(2)
//                      .set_validation_every(50, "loss").set_checkpoint_every(50);
//   options.memory_plan = xpm::MemoryPlanOptions(formula).set_variable_max({{"bs", 64}, {"l", 256}});
//   xpm::LearnerComponents parts;
//   parts.meter = meter.get();                       // the Learner builds the engine; run() probes first
//   xpm::Learner learner(task, optimizer, options, parts);
//   xpm::LearnerOutcome outcome = learner.run();     // every rank
//   std::cout << outcome.brief_report() << "\n";
//
// A whole program around it (flags, --nproc, --device, report, exit codes): learner_main.hpp.
//
// Per step (every rank): the LR of the schedule; hooks.before_step; the engine's step (gradients
// accumulated over the microbatches, divided by the outer batch's units, all-reduced; then
// hooks.before_optimizer_step and optimizer.step(), both only when the optimizer steps);
// state.step += 1; with a memory model (the predictive engine) and a meter, online corrections
// (the calibration, xpm/planner/calibration.hpp, draws its correction line over the measured
// peaks, reserved bytes where the meter reserves segments, and the batcher plans with it; an
// optimizer step above the model's floor raises that floor; a microbatch that ran out of memory becomes an
// infeasible bound: every rank sees the same all-reduced peaks, so plans stay identical); a
// line of metrics.jsonl;
// hooks.after_step unless the step ran out of memory (then it is skipped on every rank; 10 in a
// row stop the run with std::runtime_error). Then, when due: validation (hooks.before_validation,
// TrainingTask::validate under a snapshot of the plan, hooks.after_validation, the votes:
// EarlyStopping first, then the listeners; best_parameters.pt on a new best), a checkpoint (when
// due, on a new best while checkpointing, and at stop_after_steps), then stop on a kStop vote or
// at stop_after_steps. At the end (unless stopped by stop_after_steps) a final validation unless
// one ran at this step, and a last checkpoint when checkpointing.
//
// Run folder (rank 0 writes): metrics.jsonl (one JSON object per step, one per validation with a
// "validation" field; on resume the lines up to the checkpoint's step are kept),
// best_parameters.pt, checkpoints/step-NNNNNNNN (learner_checkpoint.hpp). Exact resume: a run
// stopped after step k and resumed ends with the same parameters, bit for bit, as the
// uninterrupted one (CPU, same thread count): model, optimizer, LR schedule position, every
// rank's CPU generator, the sampler and the epoch's order, the step, the memory model, the
// counters, the listeners' state and TrainingTask::extra_state() are in every checkpoint.
//
// Data parallel (components.dist with world size > 1): every rank constructs the Learner with the
// same options and its own task and optimizer over the same records; the constructor broadcasts
// rank 0's parameters and lays out gradient buckets (unless components.buckets or .sharded are
// given); each step every rank receives the same outer batch and trains its share of the
// microbatches.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/state/checkpoint_store.hpp"
#include "xpm/trainer/steps/data_parallel_trainer.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/distributed/gradient_buckets.hpp"
#include "xpm/trainer/loop/hooks.hpp"
#include "xpm/trainer/state/learner_checkpoint.hpp"
#include "xpm/trainer/loop/learner_listener.hpp"
#include "xpm/trainer/loop/memory_plan.hpp"
#include "xpm/trainer/options/option_setters.hpp"
#include "xpm/trainer/options/lr_schedule.hpp"
#include "xpm/planner_torch/step_probing.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/trainer/loop/run_counters.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"
#include "xpm/trainer/steps/step_engine.hpp"
#include "xpm/trainer/loop/train_context.hpp"
#include "xpm/trainer/loop/training_task.hpp"
#include "xpm/trainer/loop/validation.hpp"

namespace xpm {

/// Which optimizer files a checkpoint holds under ShardedAdamW.
enum class OptimizerCheckpointLayout {
  kPerRankShards,  // optimizer-rank<r>.pt, loadable at the same world size only
  kConsolidated,   // one optimizer.pt, loadable at any world size and sharding
};
std::string to_string(OptimizerCheckpointLayout layout);  // "sharded" | "full"
/// Throws std::invalid_argument "<source> must be 'sharded' or 'full', got '<text>'".
OptimizerCheckpointLayout parse_optimizer_checkpoint_layout(const std::string& text, const std::string& source);

struct LearnerOptions {
  std::string run_dir = "runs/latest";   // metrics.jsonl, best_parameters.pt, checkpoints/
  std::int64_t epochs = 1;                // passes over the training records
  std::int64_t max_steps = 0;             // optimizer steps (0: epochs x steps per epoch)
  std::int64_t outer_batch_size = 64;     // records per optimizer step
  std::uint64_t sampler_seed = 1;         // the epochs' shuffles
  LrScheduleOptions lr_schedule;          // peak, warmup, shape; total_steps set by the Learner
  ValidationSettings validation;          // when, which metric, early stopping
  CheckpointSettings checkpoints;         // when (every_steps / every_epochs > 0), how many kept
  std::int64_t stop_after_steps = 0;      // stop with a checkpoint after step N (0: off)
  /// Signals that stop the run gracefully (StopSignals, installed for run()'s duration): every
  /// rank finishes the step it is in, the ranks agree through the step's status all-reduce (a
  /// signal to one rank stops all at the same step), a checkpoint is written and run() returns
  /// with LearnerOutcome::stop_signal set; a second signal ends the process. Empty: none
  /// (xpm-train passes SIGINT, SIGTERM and its --preemption-signal).
  std::vector<int> stop_signals;
  bool resume = false;                    // continue from the newest valid checkpoint in run_dir
  std::int64_t log_every = 10;            // progress line every N steps
  double underprediction_tolerance = 0.005;  // a peak above (1 + tol) x planned counts as an underprediction
  bool loss_scaling = false;              // dynamic loss scaling (float16 training, precision.hpp)
  std::int64_t bucket_cap_bytes = 25 << 20;  // gradient all-reduce buckets (data parallel)
  OptimizerCheckpointLayout optimizer_checkpoint = OptimizerCheckpointLayout::kPerRankShards;
  std::string checkpoint_kind = "xpm-learner";  // the manifest's "kind"
  /// The run's own settings (model, data, ...), in every checkpoint's manifest; a resume refuses
  /// a checkpoint whose config differs in a key (the Learner's own options are compared too).
  nlohmann::json config;
  /// Keys of `config` a resumed run may change (where things go, what is printed, timeouts).
  std::set<std::string> resume_free_keys = {"run_dir", "resume", "stop_after_steps", "log_every", "threads"};
  StepProbeOptions probing;               // when the batcher has no model (batcher, rank, sharing: set by run())
  std::string log_prefix = "xpm";         // of the log lines ("xpm: checkpoint ...")
  /// What TrainingRecord::size counts: the progress line's "<name>/s", metrics.jsonl's
  /// "real_<name>" and "<name>_per_s", the hooks' "train/real_<name>".
  std::string size_name = "tokens";
  /// Rank 0's progress lines; empty: std::cout on rank 0. Other ranks log nothing.
  std::function<void(const std::string& line)> log;
  /// Appended to the error that stops a run after consecutive out-of-memory steps.
  std::string oom_advice = "probe larger shapes, or plan with a lower memory fraction";
  /// The memory plan the Learner builds (budget from the meter's capacity, PredictiveBatcher,
  /// packer) for its predictive engine, when LearnerComponents gives no engine nor batcher;
  /// run() probes and fits it first.
  std::optional<MemoryPlanOptions> memory_plan;
  /// Where the task's model lives (torch::kCPU, or a CUDA device: "cuda:LOCAL_RANK" under a
  /// launcher). The constructor refuses a model whose parameters are elsewhere.
  torch::Device device = torch::kCPU;

  XPM_OPTION_SETTER(LearnerOptions, std::string, run_dir)
  XPM_OPTION_SETTER(LearnerOptions, std::int64_t, epochs)
  XPM_OPTION_SETTER(LearnerOptions, std::int64_t, max_steps)
  XPM_OPTION_SETTER(LearnerOptions, std::int64_t, outer_batch_size)
  XPM_OPTION_SETTER(LearnerOptions, std::uint64_t, sampler_seed)
  XPM_OPTION_SETTER(LearnerOptions, LrScheduleOptions, lr_schedule)
  XPM_OPTION_SETTER(LearnerOptions, ValidationSettings, validation)
  XPM_OPTION_SETTER(LearnerOptions, CheckpointSettings, checkpoints)
  XPM_OPTION_SETTER(LearnerOptions, std::int64_t, stop_after_steps)
  XPM_OPTION_SETTER(LearnerOptions, bool, resume)
  XPM_OPTION_SETTER(LearnerOptions, std::int64_t, log_every)
  XPM_OPTION_SETTER(LearnerOptions, std::string, log_prefix)
  XPM_OPTION_SETTER(LearnerOptions, std::string, size_name)
  XPM_OPTION_SETTER(LearnerOptions, nlohmann::json, config)
  XPM_OPTION_SETTER(LearnerOptions, std::optional<MemoryPlanOptions>, memory_plan)
  XPM_OPTION_SETTER(LearnerOptions, torch::Device, device)
  /// The peak learning rate and its warmup (lr_schedule's fields).
  LearnerOptions& set_learning_rate(double peak, std::int64_t warmup_steps = 0) {
    lr_schedule.peak_learning_rate = peak;
    lr_schedule.warmup_steps = warmup_steps;
    return *this;
  }
  /// Validation every `every_steps` steps deciding by `metric`, its direction from its name
  /// ("...loss": min, "...accuracy": max; default_metric_mode).
  LearnerOptions& set_validation_every(std::int64_t every_steps, const std::string& metric) {
    validation.every_steps = every_steps;
    validation.metric = metric;
    validation.mode = default_metric_mode(metric);
    return *this;
  }
  /// A checkpoint every `every_steps` steps.
  LearnerOptions& set_checkpoint_every(std::int64_t every_steps) {
    checkpoints.every_steps = every_steps;
    return *this;
  }

  /// Throws std::invalid_argument naming the field and its value, and for a validation metric
  /// whose name says its direction ("...loss": min, "...accuracy": max) under the other mode.
  void validate() const;
  /// The options a resumed run must share with the checkpoint's (epochs, steps, outer batch,
  /// sampler seed, LR schedule, validation), as JSON.
  nlohmann::json resume_settings() const;
  /// True when checkpoints are written by steps or epochs.
  bool checkpointing() const { return checkpoints.every_steps > 0 || checkpoints.every_epochs > 0; }
  /// Optimizer steps of a run over `records` training records.
  std::int64_t total_steps(std::size_t records) const;
};

/// What the Learner works with besides the task and the optimizer. The raw pointers are not
/// owned: what they point to must outlive the Learner; null means "none" or "the Learner's own",
/// as each field says. The engine is shared (the caller may read it after the run).
struct LearnerComponents {
  DistributedContext* dist = nullptr;     // null: a single process
  /// How each optimizer step runs (step_engine.hpp: FixedStepEngine, PowerAdaptiveStepEngine,
  /// or one of the caller's). Null: the Learner builds the PredictiveStepEngine over `batcher`
  /// (or the PredictiveBatcher it builds from LearnerOptions::memory_plan) with `meter`, `dist`,
  /// `buckets` and `sharded`.
  std::shared_ptr<StepEngine> engine;
  /// The predictive engine's planner, when the Learner builds that engine and
  /// LearnerOptions::memory_plan is not set; without a model run() probes first. Not owned.
  PredictiveBatcher* batcher = nullptr;
  MemoryMeter* meter = nullptr;           // peaks per step; null: none measured
  GradientBuckets* buckets = nullptr;     // null: the Learner lays them out when data parallel
  ShardedAdamW* sharded = nullptr;        // shard_grad_op: steps go through it
  HookList* hooks = nullptr;              // null: none
  std::vector<std::shared_ptr<LearnerListener>> listeners;  // vote after EarlyStopping
  std::int64_t capacity_bytes = 0;        // for the metrics lines; 0: the batcher's budget
  TrainState* state = nullptr;            // shared with the hooks' context; null: the Learner's own
  TrainerContext* context = nullptr;      // over `state`; null: the Learner's own
  /// A checkpoint whose parameters the model already holds (the caller loaded them, e.g.
  /// between initialization hooks); run() restores the rest from it. Else options.resume.
  std::optional<LearnerCheckpoint> resume_from;
};

/// What run() returns.
struct LearnerOutcome {
  RunCounters counters;
  NamedMetrics last_validation;         // the final one (or the last before stopping)
  double last_validation_s = 0;         // its wall time
  bool finished = true;                 // false when stopped by stop_after_steps or a signal
  bool stopped_by_signal = false;       // some rank received one of stop_signals; a checkpoint was written
  int stop_signal = 0;                  // the one this rank received (0: none, another rank's)
  bool early_stopped = false;           // the listeners voted stop
  std::int64_t resumed_from_step = -1;  // -1: not resumed
  std::int64_t checkpoints_written = 0;  // by this process
  EarlyStopping::State best;            // best validation (after warmup)
  std::int64_t loss_scale_skipped_steps = 0;  // loss scaling: steps skipped for inf/nan gradients
  std::int64_t steps = 0;               // state.step at the end
  std::int64_t probes = 0;              // probes run by run() (0: the batcher had a model)
  bool memory_model_from_cache = false;  // run() found the model in the cache
  bool memory_model_from_checkpoint = false;  // run() took it from the resumed checkpoint
  double probe_s = 0;                   // rank 0's probing wall time (s)
  std::int64_t total_steps = 0;         // of the run
  std::string memory_formula;           // the memory model's formula at the end (predictive)
  double floor_bytes = 0;               // its floor (bytes)

  /// One line: steps, microbatches, OOMs, the largest step prediction error, the records not
  /// trained (predicted over the budget even alone) where there were any, the last
  /// validation's metrics and how the run ended ("finished", "stopped after step 4: resume").
  std::string brief_report() const;
  /// Several lines: the brief report, then the memory model, probing, resume, checkpoints,
  /// best validation, rank balance and throughput counters.
  std::string full_report() const;
};

class Learner {
 public:
  /// Throws std::invalid_argument for bad options or components (no engine, batcher nor
  /// memory plan; an engine beside a batcher or a memory plan; an engine that refuses the
  /// world size, as a fixed one in a distributed job). Collective when components.dist is distributed: the
  /// parameters are broadcast from rank 0.
  Learner(TrainingTask& task, torch::optim::Optimizer& optimizer, LearnerOptions options,
          LearnerComponents components = {});
  ~Learner();
  Learner(const Learner&) = delete;
  Learner& operator=(const Learner&) = delete;

  /// Trains to the end (or an early stop, or stop_after_steps). Collective: every rank calls
  /// it. Each error says where, in the class it had (error_context.hpp): "probing at bs=..",
  /// "step 12: ...", "validation after step 40: ...", "checkpoint write of step 40: ...",
  /// "resume: ...".
  /// std::invalid_argument (every rank alike) for a record whose units are negative or not a
  /// number, an outer batch of 0 units, or a checkpoint to resume whose config or Learner
  /// options differ; std::runtime_error after 10 steps in a row out of memory.
  LearnerOutcome run();

  const TrainState& state() const { return *state_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  TrainState* state_ = nullptr;
};

}  // namespace xpm
