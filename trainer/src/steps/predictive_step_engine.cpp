// predictive_step_engine.cpp — the engine a memory model plans (predictive_step_engine.hpp).
#include "xpm/trainer/steps/predictive_step_engine.hpp"

#include <memory>

namespace xpm {

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

}  // namespace xpm
