// xpm/trainer/steps/predictive_step_engine.hpp — the StepEngine (step_engine.hpp) whose
// microbatches a PredictiveBatcher's memory model plans, data parallel or in one process.
//
//   xpm::PredictiveStepEngine engine(optimizer, batcher, &meter, dist, &buckets);
//   xpm::GlobalStepResult r = engine.train_step(record_dims, record_units, loss_sum_of_records);
//
// The Learner builds it itself (LearnerOptions::memory_plan or LearnerComponents::batcher).
// Its memory model is its own: it probes when the batcher has none (ensure_memory_model),
// corrects it from every step's measured peaks (learn_from_step: a microbatch that ran out of
// memory bounds the model, an optimizer step above the floor raises it, and with a meter a
// Calibration draws the correction line over the peaks the plans bound, reserved bytes under a
// caching allocator), and keeps model and calibration in checkpoints (memory_state).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "xpm/planner/calibration.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner/training_refit.hpp"
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

  EngineModelOrigin ensure_memory_model(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                        const ProbeLossFn& loss_fn, const StepProbeOptions& probing,
                                        const EngineLog& log) override;
  EngineMemoryState memory_state() const override;
  bool restore_memory_state(const EngineMemoryState& saved, bool same_layout) override;
  void begin_step(const EngineLog& log) override;
  std::int64_t learn_from_step(const GlobalStepResult& result, std::int64_t step, const EngineLog& log) override;
  void add_step_metrics(const GlobalStepResult& result, nlohmann::json& line) const override;
  EngineMemorySummary memory_summary() const override;
  std::int64_t planned_capacity_bytes() const override { return batcher_.options().budget.capacity_bytes; }
  std::string out_of_memory_cause(const EngineLog& log) const override;

  /// Whether the plans bound reserved bytes (a meter whose allocator reserves segments).
  bool plans_reserved_bytes() const { return meter_ != nullptr && meter_->reserves_segments(); }

 private:
  double planned_peak(const MicrobatchPeak& peak) const;  // reserved or allocated: what plans bound
  double planned_floor_bytes(const GlobalStepResult& result) const;
  std::int64_t bound_out_of_memory_microbatches(const GlobalStepResult& result, std::int64_t step,
                                                const EngineLog& log);
  void note_extrapolation(const GlobalStepResult& result, std::int64_t step, const EngineLog& log);
  std::int64_t check_optimizer_step_reserved(const GlobalStepResult& result, std::int64_t step, double tolerance,
                                             const EngineLog& log);
  void calibrate(const GlobalStepResult& result, std::int64_t step, const EngineLog& log);
  void refit_model(const GlobalStepResult& result, std::int64_t step, const EngineLog& log);
  void start_refit(const nlohmann::json& saved);
  nlohmann::json refit_state() const;

  PredictiveBatcher& batcher_;
  MemoryMeter* meter_;
  DistributedContext& dist_;
  DataParallelTrainer trainer_;
  // With a meter: the correction from the model's predictions to the peaks training measures
  // (reserved bytes under a caching allocator, starting from the model's reserved gap).
  std::optional<Calibration> calibration_;
  Correction step_correction_;               // the correction the last step was planned with
  nlohmann::json restored_calibration_;      // from the checkpoint resumed (null: none)
  nlohmann::json restored_calibration_model_;  // the memory model that checkpoint planned with
  // Allocated bytes planned: the model refitted on training's peaks where the probes' fit misses
  // shapes (training_refit.hpp, the Python sampler's policy); kept in the calibration's state.
  std::optional<TrainingRefit> refit_;
  bool extrapolation_noted_ = false;         // logged once per run
};

}  // namespace xpm
