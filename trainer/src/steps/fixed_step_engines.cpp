// fixed_step_engines.cpp — the engines without a memory model (fixed_step_engines.hpp).
#include "xpm/trainer/steps/fixed_step_engines.hpp"

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

namespace xpm {

FixedStepEngine::FixedStepEngine(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                                 std::int64_t microbatch_size)
    : FixedStepEngine(std::make_unique<FixedBatcher>(optimizer, meter, microbatch_size)) {}

FixedStepEngine::FixedStepEngine(std::unique_ptr<FixedBatcher> batcher) : batcher_(std::move(batcher)) {}

GlobalStepResult FixedStepEngine::train_step(const std::vector<std::vector<double>>& /*record_dims*/,
                                             const std::vector<double>& record_units,
                                             const MicrobatchLossFn& loss_sum_fn,
                                             const BeforeOptimizerStepFn& before_optimizer_step) {
  const BatcherStepResult step = batcher_->train_step(record_units, loss_sum_fn, before_optimizer_step);
  GlobalStepResult result = step.step;
  result.oom_errors = step.ooms;
  result.attempts = step.attempts;
  result.microbatch_size = step.microbatch_size;
  result.stop_requested = stop_flag_ != nullptr && stop_flag_->load();
  return result;
}

ValidationPlanFn FixedStepEngine::validation_planner() const {
  return [size = microbatch_size()](const std::vector<std::vector<double>>& dims) {
    return fixed_size_plan(dims.size(), size);
  };
}

void FixedStepEngine::check_world_size(int world_size) const {
  if (world_size > 1) {
    throw std::invalid_argument("FixedStepEngine runs in a single process only, got world_size " +
                                std::to_string(world_size) + ": data parallelism needs the predictive engine");
  }
}

PowerAdaptiveStepEngine::PowerAdaptiveStepEngine(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                                                 PowerAdaptativeBatcherOptions options, int world_size)
    : PowerAdaptiveStepEngine(new PowerAdaptativeBatcher(optimizer, meter, options, world_size)) {}

PowerAdaptiveStepEngine::PowerAdaptiveStepEngine(PowerAdaptativeBatcher* owned_batcher)
    : FixedStepEngine(std::unique_ptr<FixedBatcher>(owned_batcher)), power_(*owned_batcher) {}

void PowerAdaptiveStepEngine::check_world_size(int world_size) const {
  PowerAdaptativeBatcher::check_single_process(world_size);
}

void PowerAdaptiveStepEngine::restore_state(const StepEngineState& saved) {
  power_.restore_size(saved.microbatch_size, saved.divisor);
}

}  // namespace xpm
