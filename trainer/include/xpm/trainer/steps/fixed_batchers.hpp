// xpm/trainer/steps/fixed_batchers.hpp — two batchers without a memory model, so runs can compare
// them with the PredictiveBatcher:
//
//   FixedBatcher: one microbatch size chosen by hand, no fallback; an out-of-memory error skips
//     the step.
//   PowerAdaptativeBatcher: starts with the whole outer batch (or a given size); on an
//     out-of-memory error it cleans up (gradients zeroed, memory back to the pre-step
//     baseline), shrinks the microbatch to outer_batch_size // n for n = 2, 3, 4, ... and redoes
//     the same outer batch; when 1 record per microbatch still runs out of memory it rethrows
//     that c10::OutOfMemoryError. Single process only.
//
//   FixedBatcher fixed(optimizer, &CpuMemoryMeter::instance(), /*microbatch_size=*/8);
//   BatcherStepResult r = fixed.train_step(record_units, loss_sum_of_records);
//
//   PowerAdaptativeBatcherOptions options;
//   options.outer_batch_size = 64;                       // records per optimizer step
//   PowerAdaptativeBatcher power(optimizer, &meter, options, dist.world_size());  // 1, or throws
//   BatcherStepResult r = power.train_step(record_units, loss_sum_of_records);
//   power.microbatch_size();                             // the size it shrank to, kept
//
// Both cut an outer batch of n records, in the order given (the sampler's), into consecutive
// microbatches of microbatch_size() records (the last one shorter) and accumulate gradients with
// LossTrainer::accumulate_gradients: each microbatch's summed loss is divided by the outer
// batch's units, so the gradient equals the one big batch's, whatever the microbatch size, and
// after a retry too (the failed attempt's gradients are zeroed first).
//
// Clean state after an out-of-memory error in forward/backward, before any retry: the failed
// microbatch's graph is dropped, the buffers LibTorch 1.13's autograd engine keeps from a
// backward that failed are released (release_autograd_buffers_after_oom), gradients are zeroed
// and those the failed attempt created are freed; so the allocated bytes are back to those
// before the step (BatcherStepResult::max_bytes_above_baseline_after_oom, 0 in the tests).
//
// Why the adaptive one refuses world_size > 1: when one rank catches an out-of-memory error and
// shrinks its microbatch while the others don't, the ranks no longer issue the same collectives
// and the job hangs at the next one (https://github.com/pytorch/pytorch/issues/50820). The
// PredictiveBatcher avoids that by construction (data_parallel_trainer.hpp). FixedBatcher is
// single process here as well: the data-parallel step (one status all-reduce, bucketed
// gradients) exists for the PredictiveBatcher only.
//
// Errors caught: c10::OutOfMemoryError during forward/backward (the CPU cap of CpuMemoryMeter
// raises it, as CUDA's allocator does). One in the optimizer step is not caught: a smaller
// microbatch cannot help it and some parameters may already be updated, so it propagates.
// Gradients are zeroed in place (as data_parallel_trainer.cpp does), not by
// Optimizer::zero_grad(), which frees them in LibTorch 2.x (or detaches them).
#pragma once

#include <cstdint>
#include <exception>
#include <vector>

#include <torch/torch.h>

#include "xpm/planner/packer.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/steps/data_parallel_trainer.hpp"
#include "xpm/trainer/steps/loss_trainer.hpp"

namespace xpm {

/// Records 0..record_count-1 in order, cut into consecutive microbatches of microbatch_size
/// records (the last one shorter; none when record_count is 0). Each microbatch's dims are
/// {records in it}; predicted_bytes 0; never over budget. Throws std::invalid_argument when
/// microbatch_size < 1.
MicrobatchPlan fixed_size_plan(std::size_t record_count, std::int64_t microbatch_size);

/// One optimizer step of a FixedBatcher or PowerAdaptativeBatcher.
struct BatcherStepResult {
  /// As DataParallelTrainer::train_step's with world_size 1 (per-rank vectors of size 1): loss,
  /// units, microbatches and peaks of the attempt that completed; oom when no attempt did (the
  /// step was skipped: gradients zeroed, no optimizer step). peak_allocated_bytes is the
  /// largest over every attempt, failed ones included (bytes); predicted fields are 0.
  GlobalStepResult step;
  std::int64_t ooms = 0;             // out-of-memory errors caught during this step
  std::int64_t attempts = 0;         // forward/backward passes over the outer batch (1 + retries)
  std::int64_t microbatch_size = 0;  // records per microbatch of the last attempt
  /// With a meter: allocated bytes above those at the start of the failed attempt, measured
  /// after its cleanup, the largest over the step's out-of-memory errors (0: back to baseline).
  std::int64_t max_bytes_above_baseline_after_oom = 0;
};

/// A fixed microbatch size, no fallback. Single process.
class FixedBatcher {
 public:
  /// `meter` may be null (no peaks). The optimizer and meter must outlive the batcher. Throws
  /// std::invalid_argument when microbatch_size < 1.
  FixedBatcher(torch::optim::Optimizer& optimizer, MemoryMeter* meter, std::int64_t microbatch_size);
  virtual ~FixedBatcher() = default;
  FixedBatcher(const FixedBatcher&) = delete;
  FixedBatcher& operator=(const FixedBatcher&) = delete;

  /// One optimizer step over an outer batch: record_units[i] is record i's units (e.g. real
  /// tokens); loss_sum_fn(indices into the outer batch) returns the SUM of per-unit losses of
  /// those records. Zeroes the gradients, accumulates over fixed_size_plan(record_units.size(),
  /// microbatch_size()), steps the optimizer. An out-of-memory error in forward/backward skips
  /// the step (clean state as in the file comment: gradients zeroed, those the attempt created
  /// freed; result.step.oom, result.ooms 1). Throws what loss_sum_fn throws
  /// otherwise, and c10::OutOfMemoryError from the optimizer step. `before_optimizer_step`
  /// (when given) runs right before the optimizer step, once, when the step is not skipped.
  virtual BatcherStepResult train_step(const std::vector<double>& record_units,
                                       const MicrobatchLossFn& loss_sum_fn,
                                       const BeforeOptimizerStepFn& before_optimizer_step = {});

  /// Records per microbatch (the last microbatch of an outer batch may be shorter).
  std::int64_t microbatch_size() const { return microbatch_size_; }
  /// Out-of-memory errors caught since construction.
  std::int64_t ooms() const { return ooms_; }

 protected:
  /// One attempt with microbatch_size(): zero gradients, forward/backward over the slices, then
  /// the optimizer step unless an out-of-memory error was caught (then gradients are zeroed
  /// again and the result has oom set; parameters and optimizer state are unchanged).
  /// After an out-of-memory error, last_oom_ holds it and last_oom_bytes_above_baseline_ the
  /// allocated bytes above the attempt's start after the cleanup.
  GlobalStepResult try_step(const std::vector<double>& record_units, const MicrobatchLossFn& loss_sum_fn,
                            const BeforeOptimizerStepFn& before_optimizer_step);

  torch::optim::Optimizer& optimizer_;
  MemoryMeter* meter_;
  std::int64_t microbatch_size_;
  std::int64_t ooms_ = 0;
  std::exception_ptr last_oom_;
  std::int64_t last_oom_bytes_above_baseline_ = 0;

 private:
  // LossTrainer takes a PredictiveBatcher for its own train_step; accumulate_gradients, the
  // only part used here, never reads it. A valid placeholder, declared before local_.
  PredictiveBatcher unused_predictive_batcher_;
  LossTrainer local_;
};

struct PowerAdaptativeBatcherOptions {
  std::int64_t outer_batch_size = 0;         // records per optimizer step (n's numerator), >= 1
  std::int64_t initial_microbatch_size = 0;  // first size tried, in [1, outer]; 0: outer_batch_size
  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
};

/// Catches an out-of-memory error, shrinks the microbatch, redoes the step. Single process only
/// (see the file comment).
class PowerAdaptativeBatcher : public FixedBatcher {
 public:
  /// Throws std::invalid_argument for bad options, and for world_size > 1 (check_single_process),
  /// so that every rank of a data-parallel job refuses before any training.
  PowerAdaptativeBatcher(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                         PowerAdaptativeBatcherOptions options, int world_size);

  /// Throws std::invalid_argument when world_size > 1, saying why (ranks desynchronize when one
  /// shrinks alone: https://github.com/pytorch/pytorch/issues/50820) and what to use instead
  /// (the PredictiveBatcher). Every rank of a job calls it and gets the same error.
  static void check_single_process(int world_size);

  /// As FixedBatcher::train_step, but on an out-of-memory error in forward/backward: clean up
  /// (file comment), shrink (next_microbatch_size()) and redo the same outer batch from its
  /// first record, cut into microbatches of the new size (one size per attempt: a split is
  /// never split again), until an attempt completes. With outer_batch_size 16 the sizes tried
  /// are 16, 8, 5, 4, 3, 2, 1. When 1 record per microbatch still runs out of memory, rethrows
  /// that attempt's c10::OutOfMemoryError object itself, with the state clean, parameters and
  /// optimizer state unchanged, and no optimizer step. The size reached is kept for later steps
  /// (and for the rest of the run: it never grows back, so a rare long outer batch costs the
  /// run its throughput; restore_size() sets it on resume).
  /// Dropout masks of a redone step differ from the failed attempt's (the RNG moved on).
  BatcherStepResult train_step(const std::vector<double>& record_units,
                               const MicrobatchLossFn& loss_sum_fn,
                               const BeforeOptimizerStepFn& before_optimizer_step = {}) override;

  /// Continues at a size reached earlier (a resumed run): microbatch_size() becomes
  /// `microbatch_size` and divisor() `divisor`. Throws std::invalid_argument unless
  /// microbatch_size == outer_batch_size // divisor (or, divisor 1, the initial size).
  void restore_size(std::int64_t microbatch_size, std::int64_t divisor);

  /// The size after the next shrink: outer_batch_size // n for the smallest n > divisor() with
  /// outer_batch_size // n < microbatch_size(); 0 when microbatch_size() is 1.
  std::int64_t next_microbatch_size() const;
  /// n of the current size: 1 until the first shrink.
  std::int64_t divisor() const { return divisor_; }
  /// Steps redone at least once after an out-of-memory error, since construction.
  std::int64_t retried_steps() const { return retried_steps_; }
  /// Steps that failed (rethrown) because even 1-record microbatches ran out of memory.
  std::int64_t failed_steps() const { return failed_steps_; }
  const PowerAdaptativeBatcherOptions& options() const { return options_; }

 private:
  std::int64_t next_divisor() const;

  PowerAdaptativeBatcherOptions options_;
  std::int64_t divisor_ = 1;
  std::int64_t retried_steps_ = 0;
  std::int64_t failed_steps_ = 0;
};

}  // namespace xpm
