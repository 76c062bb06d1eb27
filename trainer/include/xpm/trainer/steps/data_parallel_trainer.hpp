// xpm/trainer/steps/data_parallel_trainer.hpp — one optimizer step of a data-parallel job: the same
// global batch on every rank, records split among ranks by predicted cost, each rank packs and
// runs its share with exact gradient accumulation, one bucketed all-reduce of gradients, one
// optimizer step. With world_size 1 it is the single-process step (collectives are no-ops).
//
//   DataParallelTrainer trainer(optimizer, batcher, &meter, dist, &buckets);
//   GlobalStepResult r = trainer.train_step(global_dims, global_units, loss_sum_of_records);
//
// Collective sequence of one step, identical on every rank whatever its share (docs/design.md: no
// desync by construction):
//   1. all-reduce (sum) of the step status: loss, OOM flag per rank, microbatches per rank, the
//      dims of the microbatch that ran out of memory per rank, whether a rank was asked to stop;
//   2. all-reduce (sum) of every rank's microbatch peaks (dims, predicted, measured), sized by
//      the largest per-rank microbatch count from step 1, so every rank sees every peak;
//   3. unless some rank ran out of memory (known to all from step 1): one all-reduce per
//      gradient bucket (or ShardedAdamW's flat all-reduce), with a loss scaler one all-reduce
//      (max) of the inf/nan flag, then the optimizer step unless that flag is set (sharded: the
//      clipping all-reduce and the parameter all-gather);
//   4. all-reduce (max) of the step peak and the optimizer-step peak.
// Nothing one rank decides alone changes this sequence: an OOM on any rank skips the optimizer
// step on every rank; the online corrections the caller derives from microbatch_peaks see the
// same data on every rank. Records predicted over budget even alone are skipped on every rank
// (the decision uses the model, which every rank shares).
//
// Assignment: record i's cost is its predicted bytes alone above the formula's value at batch
// size 0 (the marginal bytes one record adds, a proxy for its compute), balanced by
// longest-processing-time (rank_assignment.hpp). Loss weight: every microbatch's summed loss is
// divided by the units of the whole global batch, so the summed gradient equals the gradient
// of the global batch's mean loss.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/distributed/gradient_buckets.hpp"
#include "xpm/trainer/steps/loss_trainer.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"

namespace xpm {

struct GlobalStepResult {
  double loss = 0;                // mean loss per unit over the global batch (all ranks)
  double units = 0;               // units in the global batch's executed records
  std::int64_t microbatches = 0;  // microbatches over all ranks
  std::vector<std::int64_t> microbatches_per_rank;
  std::vector<std::int64_t> records_per_rank;
  std::vector<double> predicted_cost_per_rank;  // LPT loads (bytes above the batch-size-0 value)
  double imbalance = 1;           // max / mean of predicted_cost_per_rank
  std::int64_t skipped_records = 0;  // predicted over budget even alone (global)
  bool oom = false;               // some rank ran out of memory: the step was skipped everywhere
  std::vector<int> oom_ranks;     // which ranks
  /// Per entry of oom_ranks, the dims of the microbatch that ran out of memory there (empty
  /// dims when the error came outside a microbatch's forward/backward); same on every rank.
  std::vector<std::vector<double>> oom_microbatch_dims;
  std::vector<MicrobatchPeak> microbatch_peaks;  // every rank's, rank order; same on every rank
  std::vector<int> microbatch_peak_ranks;        // rank of each entry of microbatch_peaks
  double optimizer_step_peak_bytes = 0;          // max over ranks
  double optimizer_step_peak_reserved_bytes = 0;  // the same in reserved bytes (0: a meter without segments)
  std::int64_t peak_allocated_bytes = 0;         // max over ranks of the step's peak
  double max_predicted_bytes = 0;                // largest predicted microbatch over all ranks
  double duration_s = 0;                         // wall time of the step on this rank
  double gradient_norm = -1;  // global L2 norm before clipping, when ShardedAdamW clipped (else -1)
  bool loss_scale_overflow = false;  // with a loss scaler: inf/nan gradients, the step was skipped everywhere
  double loss_scale = 0;             // with a loss scaler: the scale this step's losses were multiplied by
  bool stop_requested = false;       // some rank's stop flag was set when the status was reduced
  // How the step engine (step_engine.hpp) ran it; DataParallelTrainer leaves the defaults.
  std::int64_t oom_errors = 0;       // out-of-memory errors caught (a retrying engine may still step)
  std::int64_t attempts = 1;         // passes over the outer batch (1 + retries)
  std::int64_t microbatch_size = 0;  // records per microbatch of a fixed-size engine (0: planned)
};

class DataParallelTrainer {
 public:
  /// `meter` may be null (no peaks). `buckets` may be null only when context.world_size() is 1
  /// or `sharded` is given. `sharded` (shard_grad_op, built over `context`): gradients are
  /// zeroed, reduced and stepped through it instead of `buckets` and `optimizer` (step 3 below
  /// becomes ShardedAdamW's reduce_gradients, before_optimizer_step, clipping by its
  /// max_grad_norm, step of the owned slice, gather of the parameters); every rank then passes
  /// its own ShardedAdamW, built over `context` from the same param groups. References must
  /// outlive the trainer. Throws std::invalid_argument for a null bucket set in a distributed
  /// context without `sharded`.
  DataParallelTrainer(torch::optim::Optimizer& optimizer, const PredictiveBatcher& batcher,
                      MemoryMeter* meter, DistributedContext& context, GradientBuckets* buckets,
                      ShardedAdamW* sharded = nullptr);

  /// One optimizer step over the global batch. record_dims[i] / record_units[i]: record i of the
  /// GLOBAL batch (same on every rank); loss_sum_fn receives indices into the global batch.
  /// `before_optimizer_step` (when given) runs on every rank after the gradient all-reduce,
  /// right before optimizer.step(), exactly when the optimizer steps (no rank ran out of
  /// memory and some microbatch ran), so it may issue collectives of its own.
  /// Collective: every rank calls it with the same global batch. Throws std::invalid_argument
  /// when the sizes differ; DistributedError when a collective fails.
  /// Dynamic loss scaling (16-mixed, precision.hpp) from the next step on; null turns it off.
  /// Each microbatch's loss is multiplied by the scale before backward (the reported loss is
  /// not); after the gradient reduction the gradients are unscaled (this rank's whole reduced
  /// gradient, or the owned slice under sharding) and the step is skipped on every rank when
  /// some rank found inf/nan; then the scaler's update(). The scaler must outlive its use.
  /// Every rank must set a scaler with the same state, or none (unscaling is collective).
  void set_loss_scaler(DynamicLossScaler* scaler) { loss_scaler_ = scaler; }
  /// A flag set asynchronously (StopSignals::flag()): its value on each rank joins the step's
  /// status all-reduce, so GlobalStepResult::stop_requested is the same on every rank, with no
  /// collective of its own. Null: never. The flag must outlive its use.
  void set_stop_flag(const std::atomic<bool>* flag) { stop_flag_ = flag; }

  GlobalStepResult train_step(const std::vector<std::vector<double>>& record_dims,
                              const std::vector<double>& record_units,
                              const MicrobatchLossFn& loss_sum_fn,
                              const BeforeOptimizerStepFn& before_optimizer_step = {});

 private:
  struct LocalShare;  // this rank's records and what running them gave (data_parallel_trainer.cpp)
  void split_among_ranks(const std::vector<std::vector<double>>& record_dims, const std::vector<double>& record_units,
                         LocalShare& share, GlobalStepResult& result) const;
  void run_local_share(LocalShare& share, const MicrobatchLossFn& loss_sum_fn);
  void exchange_status(const LocalShare& share, GlobalStepResult& result);  // collective 1
  void exchange_peaks(const LocalShare& share, GlobalStepResult& result);   // collective 2
  double apply_gradients(double global_units, const BeforeOptimizerStepFn& before_optimizer_step,
                         GlobalStepResult& result);  // collective 3; the optimizer step's peak
  void zero_grad();  // every .grad to zero in place (through ShardedAdamW when sharded)
  // With a loss scaler: unscale `gradients` (collective over `owners`), update the scaler, record
  // scale and overflow in `result`; true when the step must be skipped. Without: false.
  bool unscale_gradients(const std::vector<torch::Tensor>& gradients, DistributedContext& owners,
                         GlobalStepResult& result);

  torch::optim::Optimizer& optimizer_;
  const PredictiveBatcher& batcher_;
  MemoryMeter* meter_;
  DistributedContext& context_;
  GradientBuckets* buckets_;
  ShardedAdamW* sharded_;
  DynamicLossScaler* loss_scaler_ = nullptr;
  const std::atomic<bool>* stop_flag_ = nullptr;
  LossTrainer local_;
};

}  // namespace xpm
