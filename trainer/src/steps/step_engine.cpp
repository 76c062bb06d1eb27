#include "xpm/trainer/steps/step_engine.hpp"

#include <stdexcept>
#include <string>
#include <utility>

namespace xpm {

void StepEngine::check_world_size(int world_size) const {
  if (world_size > 1) {
    throw std::invalid_argument("this step engine runs in a single process only, got world_size " +
                                std::to_string(world_size) + ": data parallelism needs the predictive one");
  }
}

void StepEngine::set_loss_scaler(DynamicLossScaler* scaler) {
  if (scaler != nullptr) throw std::invalid_argument("this step engine does not scale losses");
}

PredictiveStepEngine::PredictiveStepEngine(torch::optim::Optimizer& optimizer, PredictiveBatcher& batcher,
                                           MemoryMeter* meter, DistributedContext& dist, GradientBuckets* buckets,
                                           ShardedAdamW* sharded)
    : batcher_(batcher), trainer_(optimizer, batcher, meter, dist, buckets, sharded) {}

GlobalStepResult PredictiveStepEngine::train_step(const std::vector<std::vector<double>>& record_dims,
                                                  const std::vector<double>& record_units,
                                                  const MicrobatchLossFn& loss_sum_fn,
                                                  const BeforeOptimizerStepFn& before_optimizer_step) {
  GlobalStepResult result = trainer_.train_step(record_dims, record_units, loss_sum_fn, before_optimizer_step);
  result.oom_errors = result.oom ? 1 : 0;
  return result;
}

ValidationPlanFn PredictiveStepEngine::validation_planner() const {
  auto snapshot = std::make_shared<PredictiveBatcher>(batcher_.options(), batcher_.shared_packer());
  snapshot->set_model(batcher_.model());
  snapshot->set_correction(batcher_.correction());  // the calibrated line, not the model's initial one
  return [snapshot](const std::vector<std::vector<double>>& dims) { return snapshot->plan(dims); };
}

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
