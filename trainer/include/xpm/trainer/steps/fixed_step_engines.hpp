// xpm/trainer/steps/fixed_step_engines.hpp — the StepEngines (step_engine.hpp) without a
// memory model, single process: a microbatch size chosen by hand, and one halved on
// out-of-memory errors.
//
//   xpm::LearnerComponents parts;
//   parts.engine = std::make_shared<xpm::FixedStepEngine>(optimizer, meter.get(), /*microbatch_size=*/8);
//
//   xpm::PowerAdaptiveStepEngine engine(optimizer, &meter, {/*outer_batch_size=*/64, 0}, dist.world_size());
//   xpm::GlobalStepResult r = engine.train_step(record_dims, record_units, loss_sum_of_records);
//   engine.microbatch_size();      // the size it shrank to, kept for later steps
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include <torch/torch.h>

#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/steps/fixed_batchers.hpp"
#include "xpm/trainer/steps/step_engine.hpp"

namespace xpm {

/// One microbatch size chosen by hand, no fallback: an out-of-memory error skips the step.
class FixedStepEngine : public StepEngine {
 public:
  /// `meter` may be null (no peaks). The optimizer and meter must outlive the engine. Throws
  /// std::invalid_argument when microbatch_size < 1.
  FixedStepEngine(torch::optim::Optimizer& optimizer, MemoryMeter* meter, std::int64_t microbatch_size);

  /// FixedBatcher::train_step over record_units (the dims are not used); oom_errors, attempts and
  /// microbatch_size from its BatcherStepResult.
  GlobalStepResult train_step(const std::vector<std::vector<double>>& record_dims,
                              const std::vector<double>& record_units, const MicrobatchLossFn& loss_sum_fn,
                              const BeforeOptimizerStepFn& before_optimizer_step = {}) override;
  /// Slices of microbatch_size() records (fixed_size_plan).
  ValidationPlanFn validation_planner() const override;
  /// Refuses world_size > 1: the data-parallel step exists for the predictive engine only.
  void check_world_size(int world_size) const override;
  void set_stop_flag(const std::atomic<bool>* flag) override { stop_flag_ = flag; }
  StepEngineState state() const override { return {microbatch_size(), 1}; }

  /// Records per microbatch (the last microbatch of an outer batch may be shorter).
  std::int64_t microbatch_size() const { return batcher_->microbatch_size(); }
  /// The batcher the steps run through (its counters: ooms()).
  const FixedBatcher& batcher() const { return *batcher_; }

 protected:
  explicit FixedStepEngine(std::unique_ptr<FixedBatcher> batcher);

 private:
  std::unique_ptr<FixedBatcher> batcher_;
  const std::atomic<bool>* stop_flag_ = nullptr;
};

/// Shrinks the microbatch on out-of-memory errors and redoes the step (PowerAdaptativeBatcher:
/// its shrink sequence, clean retries, and the error rethrown when 1 record still does not fit).
class PowerAdaptiveStepEngine : public FixedStepEngine {
 public:
  /// Throws std::invalid_argument for bad options, and for world_size > 1
  /// (PowerAdaptativeBatcher::check_single_process), so that every rank refuses before training.
  PowerAdaptiveStepEngine(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                          PowerAdaptativeBatcherOptions options, int world_size);

  /// Refuses world_size > 1 with PowerAdaptativeBatcher::check_single_process's reason.
  void check_world_size(int world_size) const override;
  StepEngineState state() const override { return {microbatch_size(), power_.divisor()}; }
  /// PowerAdaptativeBatcher::restore_size.
  void restore_state(const StepEngineState& saved) override;

  /// The batcher the steps run through (its counters: retried_steps(), failed_steps()).
  const PowerAdaptativeBatcher& power_batcher() const { return power_; }

 private:
  explicit PowerAdaptiveStepEngine(PowerAdaptativeBatcher* owned_batcher);  // takes ownership

  PowerAdaptativeBatcher& power_;  // the object FixedStepEngine owns (batcher())
};

}  // namespace xpm
