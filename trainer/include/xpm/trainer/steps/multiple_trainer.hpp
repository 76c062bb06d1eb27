// xpm/trainer/steps/multiple_trainer.hpp — several named sub-trainers, each with its own data, its own
// PredictiveBatcher (own formula, own memory model) and its own loss, accumulating gradients
// into the same parameters, with ONE optimizer step.
//
//   SubTrainer labels{"labels", 1.0, &labels_batcher, &labels_probes,
//                     [&] { return next_labels_batch(); }};
//   SubTrainer ranking{"ranking", 0.5, &ranking_batcher, &ranking_probes,
//                      [&] { return next_ranking_batch(); }};
//   MultipleTrainer trainer(optimizer, &CpuMemoryMeter::instance(), {labels, ranking});
//   trainer.probe_and_fit();            // every sub-trainer's batcher probes and fits
//   MultipleStepResult r = trainer.train_step();
//   report_losses(r, context);          // "loss", "labels/loss", "ranking/loss"
//
// One step: zero the gradients; for each sub-trainer in order, take its next outer batch, plan
// it with its own batcher and accumulate w_k * (its loss sum) / (its units) microbatch by
// microbatch (LossTrainer::accumulate_gradients); then before_optimizer_step and one optimizer
// step. The gradient is sum_k w_k * grad(mean loss of sub-trainer k over its outer batch),
// whatever the microbatch splits. Memory: each sub-trainer's microbatches run one at a time,
// and its probes measured full steps on the same model and optimizer (gradients and optimizer
// state included), so each plan under its own budget holds while others' gradients accumulate
// (the gradients are allocated once, whoever fills them).
//
// Probing is forwarded to every sub-trainer (probe_and_fit), so each sub-trainer's predictive
// batcher gets its own memory model. Single process: the data-parallel step (rank assignment,
// bucketed all-reduce) is DataParallelTrainer's, for one task.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner/probe.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/steps/loss_trainer.hpp"
#include "xpm/trainer/loop/train_context.hpp"

namespace xpm {

/// One outer batch of one sub-trainer.
struct OuterBatch {
  std::vector<std::vector<double>> record_dims;  // record i's dims, its batcher's variable order
  std::vector<double> record_units;              // record i's units (tokens, pairs, records)
  MicrobatchLossFn loss_sum_fn;                  // SUM of per-unit losses over given records
};

struct SubTrainer {
  std::string name;                          // unique, non-empty, no '/': metric scope
  double weight = 1.0;                       // w_k, finite and > 0
  PredictiveBatcher* batcher = nullptr;      // its own formula and budget; not owned
  ProbeExecutor* probe_executor = nullptr;   // runs its probes; null: the batcher has a model
  std::function<OuterBatch()> next_batch;    // its own data: the next outer batch
};

struct MultipleStepResult {
  double loss = 0;  // sum_k w_k * mean loss of sub-trainer k (executed records)
  std::map<std::string, StepResult> sub_results;  // per sub-trainer: loss = its unweighted mean
  bool oom = false;                // a sub-trainer ran out of memory: step skipped, grads zeroed
  std::string oom_sub_trainer;     // which one
  std::int64_t peak_allocated_bytes = 0;  // meter peak during the step (0 without a meter)
  double optimizer_step_peak_bytes = 0;   // meter peak of the optimizer step
  double duration_s = 0;                  // wall time of the step
};

class MultipleTrainer {
 public:
  /// `meter` may be null. The optimizer, meter, batchers and executors must outlive the
  /// trainer. Throws std::invalid_argument naming the sub-trainer for no sub-trainer, a
  /// duplicate or bad name, a weight <= 0 or not finite, a null batcher or an empty next_batch.
  MultipleTrainer(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                  std::vector<SubTrainer> sub_trainers);

  /// Forwards probing to every sub-trainer: each batcher's probe_and_fit(its executor), in
  /// order (a sub-trainer without an executor must already have a model). Rank 0, before any
  /// data-parallel wrapping. Returns name -> its fitted model. Throws what probe_and_fit throws,
  /// prefixed with the sub-trainer's name, and std::invalid_argument for a sub-trainer with
  /// neither an executor nor a model.
  std::map<std::string, const MemoryModel*> probe_and_fit();

  /// One optimizer step over the next outer batch of every sub-trainer (next_batch() of each,
  /// in order). An out-of-memory error in any sub-trainer skips the whole step: gradients
  /// zeroed, autograd buffers released, no optimizer step, result.oom. Throws
  /// std::logic_error when a batcher has no model; what next_batch or a loss throws otherwise.
  MultipleStepResult train_step(const BeforeOptimizerStepFn& before_optimizer_step = {});
  /// The same step over given batches, one per sub-trainer in construction order. Throws
  /// std::invalid_argument when the count differs or a batch's dims and units differ in size.
  MultipleStepResult train_step(const std::vector<OuterBatch>& batches,
                                const BeforeOptimizerStepFn& before_optimizer_step = {});

  const std::vector<SubTrainer>& sub_trainers() const { return sub_trainers_; }

 private:
  torch::optim::Optimizer& optimizer_;
  MemoryMeter* meter_;
  std::vector<SubTrainer> sub_trainers_;
};

/// Records a step in the context (current scope): "loss", and "<name>/loss" (unweighted
/// per-unit mean) and "<name>/units" for each sub-trainer. Nothing for a skipped step.
void report_losses(const MultipleStepResult& result, TrainerContext& context);

}  // namespace xpm
