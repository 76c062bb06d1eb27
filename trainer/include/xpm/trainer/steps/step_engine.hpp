// xpm/trainer/steps/step_engine.hpp — how one optimizer step over an outer batch runs, behind
// one small interface the Learner (learner.hpp) drives: StepEngine, with one result type
// (GlobalStepResult). This header holds the interface; three engines implement it:
//
//   PredictiveStepEngine (predictive_step_engine.hpp): microbatches planned by a
//     PredictiveBatcher's memory model, data parallel or single process (DataParallelTrainer);
//     the engine probes its model, corrects it from every step's peaks and checkpoints it
//     (the memory-model functions below, which the Learner calls on every engine alike).
//   FixedStepEngine (fixed_step_engines.hpp): one microbatch size chosen by hand, no fallback
//     (FixedBatcher). Single process.
//   PowerAdaptiveStepEngine (fixed_step_engines.hpp): shrinks the microbatch to
//     outer_batch_size // n on out-of-memory errors and redoes the step
//     (PowerAdaptativeBatcher). Single process.
//
//   // The Learner builds the predictive engine itself (LearnerOptions::memory_plan, or
//   // LearnerComponents::batcher); the others are given to it:
//   xpm::LearnerComponents parts;
//   parts.engine = std::make_shared<xpm::FixedStepEngine>(optimizer, meter.get(), /*microbatch_size=*/8);
//   xpm::Learner learner(task, optimizer, options, parts);
//
//   // Or driven by hand, one outer batch at a time:
//   xpm::PowerAdaptiveStepEngine engine(optimizer, &meter, {/*outer_batch_size=*/64, 0}, dist.world_size());
//   xpm::GlobalStepResult r = engine.train_step(record_dims, record_units, loss_sum_of_records);
//   r.oom_errors;                  // out-of-memory errors caught (the step redone after each)
//   engine.microbatch_size();      // the size it shrank to, kept for later steps
//
// An engine is not copyable; the Learner shares it with its caller (std::shared_ptr), who may
// read it after the run. A LibTorch-style interface (torch::data::samplers::Sampler): the virtual
// functions are the whole contract, the defaults fit an engine without a memory model.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/planner_torch/step_probing.hpp"

#include "xpm/trainer/loop/training_task.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/trainer/steps/data_parallel_trainer.hpp"
#include "xpm/trainer/steps/loss_trainer.hpp"

namespace xpm {

class PredictiveBatcher;

/// What a checkpoint keeps of an engine besides the memory model (LearnerResumeState's
/// microbatch_size and power_divisor).
struct StepEngineState {
  std::int64_t microbatch_size = 0;  // records per microbatch now (0: planned per step)
  std::int64_t divisor = 1;          // power-adaptive: n of outer_batch_size // n (1: not shrunk)
};

/// What the Learner lends an engine's memory model for its log lines and judgements, on each
/// call.
struct EngineLog {
  std::string prefix = "xpm";                    // lines start "<prefix>: "
  std::function<void(const std::string&)> line;  // called on every rank; empty: silent
  double underprediction_tolerance = 0.005;      // a peak above (1 + it) x planned is counted
  std::int64_t capacity_bytes = 0;               // what the plans run under (bounds, messages)
  std::string out_of_memory_advice;              // what to do when steps keep running out

  void operator()(const std::string& text) const {
    if (line) line(prefix + ": " + text);
  }
};

/// Where an engine's memory model came from (StepEngine::ensure_memory_model).
struct EngineModelOrigin {
  std::int64_t probes = 0;  // probes run (0: none, from the cache or already set)
  bool from_cache = false;
  double probe_s = 0;       // rank 0's probing wall time (s)
};

/// What a checkpoint keeps of an engine's memory model (LearnerResumeState's memory_model and
/// calibration); null where the engine has none.
struct EngineMemoryState {
  nlohmann::json memory_model;
  nlohmann::json calibration;
};

/// An engine's memory model now, for the run's outcome.
struct EngineMemorySummary {
  bool has_model = false;
  std::string formula;          // canonical
  double floor_bytes = 0;
  std::int64_t corrections = 0;  // online corrections of the model (refits, raised floors)
};

class StepEngine {
 public:
  virtual ~StepEngine() = default;
  StepEngine() = default;
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  /// One optimizer step over an outer batch: record_dims[i] and record_units[i] are record i's
  /// formula dims and loss units; loss_sum_fn(indices into the outer batch) returns the SUM of
  /// the per-unit losses of those records. Gradients are zeroed, accumulated over the
  /// microbatches (divided by the outer batch's units), then `before_optimizer_step` (when
  /// given) and the optimizer step run, both only when the optimizer steps. A step skipped by an
  /// out-of-memory error has result.oom set. Collective when the engine is data parallel.
  virtual GlobalStepResult train_step(const std::vector<std::vector<double>>& record_dims,
                                      const std::vector<double>& record_units,
                                      const MicrobatchLossFn& loss_sum_fn,
                                      const BeforeOptimizerStepFn& before_optimizer_step = {}) = 0;

  /// The microbatches of a validation pass, from a snapshot of the engine's plan now: nothing
  /// validation measures changes training's.
  virtual ValidationPlanFn validation_planner() const = 0;

  /// The planner whose memory model the steps follow, or null (an engine without one), for a
  /// caller who reads it; the engine probes, corrects and checkpoints it itself (below).
  virtual PredictiveBatcher* memory_planner() { return nullptr; }

  /// Throws std::invalid_argument, saying why, when the engine cannot run at `world_size`
  /// (the default: above 1).
  virtual void check_world_size(int world_size) const;

  /// A flag set asynchronously (StopSignals::flag()): GlobalStepResult::stop_requested reports
  /// it, agreed among the ranks by a data-parallel engine. Null: never. It must outlive its use.
  virtual void set_stop_flag(const std::atomic<bool>* flag) = 0;

  /// Dynamic loss scaling (precision.hpp) from the next step on, when supports_loss_scaling()
  /// (the default throws std::invalid_argument for a scaler); null turns it off. The scaler
  /// must outlive its use.
  virtual void set_loss_scaler(DynamicLossScaler* scaler);
  virtual bool supports_loss_scaling() const { return false; }

  /// Its own state in a checkpoint, and back on resume (throws std::invalid_argument for a
  /// state it cannot take; the default keeps nothing and ignores it).
  virtual StepEngineState state() const { return {}; }
  virtual void restore_state(const StepEngineState& /*saved*/) {}

  // ---- The engine's memory model, for an engine that plans by one (the predictive engine).
  // The Learner calls these on every engine, on every rank; the defaults fit an engine without
  // a model and do nothing.

  /// Before the first step, every rank: without a model yet, probes `module` trained by
  /// `optimizer` (probe_and_fit with `probing`: rank 0 probes or reads the cache and shares).
  virtual EngineModelOrigin ensure_memory_model(torch::nn::Module& /*module*/, torch::optim::Optimizer& /*optimizer*/,
                                                const ProbeLossFn& /*loss_fn*/, const StepProbeOptions& /*probing*/,
                                                const EngineLog& /*log*/) {
    return {};
  }
  /// The memory model and its calibration, for a checkpoint.
  virtual EngineMemoryState memory_state() const { return {}; }
  /// From a checkpoint: its model when `same_layout` (the same world size) and the engine has
  /// none yet, and its calibration when that model is the one planning. Returns whether the
  /// model was taken.
  virtual bool restore_memory_state(const EngineMemoryState& /*saved*/, bool /*same_layout*/) { return false; }
  /// Just before each train_step (the calibration starts at the first).
  virtual void begin_step(const EngineLog& /*log*/) {}
  /// Just after each train_step, every rank with the same (all-reduced) result: the model learns
  /// from the step's measured peaks (collective when data parallel). Returns the peaks it counted
  /// above their plans by more than log.underprediction_tolerance.
  virtual std::int64_t learn_from_step(const GlobalStepResult& /*result*/, std::int64_t /*step*/,
                                       const EngineLog& /*log*/) {
    return 0;
  }
  /// The step's fields of the metrics line (microbatch_rel_errors, correction_bytes, ...).
  virtual void add_step_metrics(const GlobalStepResult& /*result*/, nlohmann::json& /*line*/) const {}
  virtual EngineMemorySummary memory_summary() const { return {}; }
  /// The capacity the plans run under (bytes), or 0 when the engine has no budget.
  virtual std::int64_t planned_capacity_bytes() const { return 0; }
  /// Why steps keep running out of memory, for the error that stops the run.
  virtual std::string out_of_memory_cause(const EngineLog& /*log*/) const {
    return "the microbatch does not fit (a smaller microbatch size, or the predictive batcher)";
  }
};

}  // namespace xpm
