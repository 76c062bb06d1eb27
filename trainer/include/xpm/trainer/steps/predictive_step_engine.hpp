// xpm/trainer/steps/predictive_step_engine.hpp — the StepEngine (step_engine.hpp) whose
// microbatches a PredictiveBatcher's memory model plans, data parallel or in one process.
//
//   xpm::PredictiveStepEngine engine(optimizer, batcher, &meter, dist, &buckets);
//   xpm::GlobalStepResult r = engine.train_step(record_dims, record_units, loss_sum_of_records);
//
// The Learner builds it itself (LearnerOptions::memory_plan or LearnerComponents::batcher).
#pragma once

#include <atomic>

#include <torch/torch.h>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/distributed/gradient_buckets.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"
#include "xpm/trainer/steps/data_parallel_trainer.hpp"
#include "xpm/trainer/steps/step_engine.hpp"

namespace xpm {

/// Microbatches planned by a PredictiveBatcher's memory model; data parallel when `dist` is
/// (DataParallelTrainer: the same outer batch on every rank, records split by predicted cost).
class PredictiveStepEngine : public StepEngine {
 public:
  /// As DataParallelTrainer's constructor; the batcher may get its model later (before the first
  /// step). Every reference and pointer must outlive the engine; none is owned.
  PredictiveStepEngine(torch::optim::Optimizer& optimizer, PredictiveBatcher& batcher, MemoryMeter* meter,
                       DistributedContext& dist, GradientBuckets* buckets, ShardedAdamW* sharded = nullptr);

  /// DataParallelTrainer::train_step; oom_errors is 1 for a skipped step, attempts 1.
  GlobalStepResult train_step(const std::vector<std::vector<double>>& record_dims,
                              const std::vector<double>& record_units, const MicrobatchLossFn& loss_sum_fn,
                              const BeforeOptimizerStepFn& before_optimizer_step = {}) override;
  ValidationPlanFn validation_planner() const override;
  PredictiveBatcher* memory_planner() override { return &batcher_; }
  void check_world_size(int) const override {}
  void set_stop_flag(const std::atomic<bool>* flag) override { trainer_.set_stop_flag(flag); }
  void set_loss_scaler(DynamicLossScaler* scaler) override { trainer_.set_loss_scaler(scaler); }
  bool supports_loss_scaling() const override { return true; }

 private:
  PredictiveBatcher& batcher_;
  DataParallelTrainer trainer_;
};

}  // namespace xpm
