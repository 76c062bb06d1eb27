// xpm/trainer/steps/loss_trainer.hpp — one optimizer step over an outer batch split into microbatches
// by a PredictiveBatcher, with exact gradient accumulation, for one loss or a weighted sum of
// named losses.
//
//   LossTrainer trainer(optimizer, batcher, &CpuMemoryMeter::instance());
//   StepResult r = trainer.train_step(record_dims, record_units,
//       [&](const std::vector<std::size_t>& ids) { return loss_sum_of(ids); });
//
//   // A weighted sum of named losses from one forward (e.g. a labelling head and a ranking head):
//   WeightedLosses losses;
//   losses.weights = {{"labels", 1.0}, {"ranking", 0.5}};
//   losses.record_units = {{"labels", labels_of_each_record}, {"ranking", pairs_of_each_record}};
//   StepResult r = trainer.train_step(record_dims, record_units, losses,
//       [&](const std::vector<std::size_t>& ids) {
//         Output out = model(ids);
//         return std::map<std::string, torch::Tensor>{{"labels", label_loss_sum(out)},
//                                                     {"ranking", rank_loss_sum(out)}};
//       });
//   r.named_losses.at("ranking").mean;   // mean ranking loss per pair over the outer batch
//   report_losses(r, context);           // "loss", "loss/labels", "loss/ranking"
//
// Exact gradients: microbatch j's summed loss is divided by the outer batch's total units
// (labelled units for a per-unit loss, records for a record loss), so the accumulated gradient is the
// gradient of the outer batch's mean loss, whatever the number of microbatches (docs/design.md section 4).
// With named losses each loss k has its own units U_k (labels, pairs, ...) and the objective is
// sum_k w_k * (sum of loss k over the outer batch) / U_k: each microbatch contributes
// sum_k w_k * S_k(microbatch) / U_k, so again the gradient does not depend on the split, and
// each named loss's reported mean is its per-unit mean over the outer batch (microbatch means
// weighted by their units; UnitWeightedMean combines steps or ranks the same way).
// Single process (DDP comes later): a record predicted over budget even alone is skipped and
// counted, never run; an out-of-memory error during the step skips the whole step (gradients
// zeroed, no optimizer step, the failed backward's buffers released) and is counted in
// StepResult::oom.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/loop/train_context.hpp"

namespace xpm {

/// Returns the SUM of per-unit losses over the given records (a scalar tensor requiring grad).
using MicrobatchLossFn = std::function<torch::Tensor(const std::vector<std::size_t>& records)>;

/// SUMS of several named losses over the given records, from one forward pass: loss name ->
/// scalar tensor (the sum over the records of that loss's per-unit values, as MicrobatchLossFn).
using NamedLossSumsFn =
    std::function<std::map<std::string, torch::Tensor>(const std::vector<std::size_t>& records)>;

/// A weighted sum of named losses: sum_k w_k * (loss k's sum) / (its units U_k).
struct WeightedLosses {
  std::map<std::string, double> weights;  // loss name -> weight w_k >= 0 (finite), one at least
  /// Loss name -> units of each record of the outer batch for that loss (labels for a per-label
  /// loss, pairs for a pairwise one); a loss absent here uses the step's record_units.
  std::map<std::string, std::vector<double>> record_units;
  /// Throws std::invalid_argument naming the loss and the value: no loss, an empty name or one
  /// containing '/', a weight < 0 or not finite, record units for a loss without a weight.
  void validate() const;
};

/// One named loss over the executed records of an outer batch.
struct NamedLossValue {
  double mean = 0;    // sum of the loss over the records / units: the per-unit mean
  double units = 0;   // its units in the executed records (U_k)
  double weight = 0;  // w_k
};

/// Combines per-unit means weighted by their units (several steps, ranks or microbatches):
/// mean() = sum(mean_i * units_i) / sum(units_i), 0 when no unit was added.
struct UnitWeightedMean {
  double weighted_sum = 0;  // sum of mean_i * units_i
  double units = 0;         // sum of units_i
  void add(double mean, double units_added) {
    weighted_sum += mean * units_added;
    units += units_added;
  }
  double mean() const { return units > 0 ? weighted_sum / units : 0.0; }
};

/// LibTorch 1.13's autograd engine keeps the gradients a CPU backward() had queued for other
/// branches when it ran out of memory (tasks left in the calling thread's ready queue) until
/// the next backward() on that thread drains the queue; measured 16.8 MB on a three-branch MLP
/// and 39.8 MB on the BiLSTM tagger. Runs a one-element backward, with the CpuMemoryMeter's cap
/// lifted for its few bytes, so that memory is back to what the failed step had before it
/// started. Call it after catching an out-of-memory error and dropping the step's tensors; the
/// trainers here do. Local: no collective.
void release_autograd_buffers_after_oom();

/// Zeroes every defined .grad of the optimizer's parameters in place, keeping the tensors
/// allocated: Optimizer::zero_grad() frees them (set_to_none defaults to true in LibTorch 2.x,
/// which would move the static memory the planner measured) or, with set_to_none false, calls
/// detach_() on each gradient (which gradient views into buckets refuse). Local: no collective.
void zero_gradients_in_place(torch::optim::Optimizer& optimizer);

/// Called once per optimizer step, right before optimizer.step(): the outer batch's gradients
/// are accumulated (and all-reduced under data parallelism). StepTrainingHook's
/// before_optimizer_step (gradient clipping) runs here. Not called when the step is skipped.
using BeforeOptimizerStepFn = std::function<void()>;

/// What one microbatch was predicted to need and what its forward/backward measured.
struct MicrobatchPeak {
  std::vector<double> dims;                // aggregated dims of the microbatch
  double predicted_bytes = 0;              // model.predict_bytes(dims) when planned
  double forward_backward_peak_bytes = 0;  // measured peak allocated bytes
  /// Measured peak reserved bytes where the meter reserves segments (a caching allocator:
  /// MemoryMeter::reserves_segments, the cache emptied before the microbatch); else 0.
  double forward_backward_peak_reserved_bytes = 0;
};

struct StepResult {
  double loss = 0;                   // mean loss per unit over the outer batch (executed records);
                                     // named losses: sum_k w_k * mean_k
  double units = 0;                  // units (what the loss is summed over) in the executed records
  std::int64_t microbatches = 0;     // microbatches run
  std::int64_t skipped_records = 0;  // records predicted over budget even alone
  bool oom = false;                  // the step ran out of memory and was skipped
  std::int64_t peak_allocated_bytes = 0;  // meter peak during the step (0 without a meter)
  double max_predicted_bytes = 0;    // largest predicted microbatch peak in the plan
  std::vector<MicrobatchPeak> microbatch_peaks;  // one per microbatch run (with a meter)
  std::map<std::string, NamedLossValue> named_losses;  // weighted named losses only
  double optimizer_step_peak_bytes = 0;  // measured peak of the optimizer step (with a meter)
  double duration_s = 0;             // wall time of the step
};

class LossTrainer {
 public:
  /// `meter` may be null (no peak reported). The references must outlive the trainer.
  LossTrainer(torch::optim::Optimizer& optimizer, const PredictiveBatcher& batcher,
              MemoryMeter* meter);

  /// Runs forward/backward for each microbatch of `plan` with weight 1 / total units, where
  /// total units is `units_denominator` when > 0 (data-parallel: the units of the whole global
  /// batch, so the ranks' gradients sum to the global batch's) and otherwise the units of the
  /// plan's executable records; gradients accumulate into .grad. Returns the summed weighted
  /// loss and statistics. Does not step the optimizer. Throws std::invalid_argument when the
  /// plan names a record beyond record_units; rethrows c10::OutOfMemoryError (and anything
  /// loss_sum_fn throws) after the failed microbatch's tensors are dropped and, for an
  /// out-of-memory error, release_autograd_buffers_after_oom() ran (gradients of earlier
  /// microbatches stay in .grad: the caller zeroes them).
  StepResult accumulate_gradients(const MicrobatchPlan& plan, const std::vector<double>& record_units,
                                  const MicrobatchLossFn& loss_sum_fn, double units_denominator = 0);

  /// As accumulate_gradients for a weighted sum of named losses: each microbatch's backward is
  /// of sum_k w_k * S_k / U_k, where S_k is loss_sums_fn's entry k and U_k the units of loss k
  /// in the plan's executable records (losses.record_units[k], or record_units), or
  /// units_denominators[k] when given and > 0 (data-parallel: the global batch's units of loss
  /// k). result.loss = sum_k w_k * mean_k; result.named_losses[k] = {mean_k, U_k, w_k};
  /// result.units = units of record_units. A loss with U_k = 0 contributes nothing (mean 0).
  /// Throws std::invalid_argument for bad losses (WeightedLosses::validate), record units of
  /// another length than record_units (naming the loss), a plan record out of range, and when
  /// loss_sums_fn returns a map whose names differ from the weights' (naming the first
  /// difference) or a tensor that is not a scalar; out-of-memory errors as accumulate_gradients.
  StepResult accumulate_weighted_losses(const MicrobatchPlan& plan,
                                        const std::vector<double>& record_units,
                                        const WeightedLosses& losses,
                                        const NamedLossSumsFn& loss_sums_fn,
                                        const std::map<std::string, double>& units_denominators = {});

  /// zero_grad, plan the outer batch, accumulate_gradients, before_optimizer_step (when
  /// given), optimizer step. record_dims[i]: record i's dims (formula variables);
  /// record_units[i]: its units.
  StepResult train_step(const std::vector<std::vector<double>>& record_dims,
                        const std::vector<double>& record_units, const MicrobatchLossFn& loss_sum_fn,
                        const BeforeOptimizerStepFn& before_optimizer_step = {});

  /// As train_step, with a weighted sum of named losses (accumulate_weighted_losses). record_dims
  /// and record_units plan the microbatches; losses.record_units weigh each loss.
  StepResult train_step(const std::vector<std::vector<double>>& record_dims,
                        const std::vector<double>& record_units, const WeightedLosses& losses,
                        const NamedLossSumsFn& loss_sums_fn,
                        const BeforeOptimizerStepFn& before_optimizer_step = {});

  /// The dims of the microbatch whose forward/backward last ran out of memory (what the plan
  /// said, before the error); empty before any. Read it where the c10::OutOfMemoryError of
  /// accumulate_gradients / accumulate_weighted_losses is caught.
  const std::vector<double>& last_oom_microbatch_dims() const { return oom_microbatch_dims_; }

  /// Where the meter reserves segments (a caching allocator), whether each microbatch and the
  /// optimizer step start from an emptied cache and report their reserved peaks (default true:
  /// what plans of reserved bytes measure; false for engines that plan nothing, so that a GPU's
  /// cache is not emptied for them).
  void set_measures_reserved_bytes(bool measures) { measures_reserved_bytes_ = measures; }

 private:
  void start_measured_peak();  // start_peak, or reset_peak when reserved bytes are not measured
  // Runs each executable microbatch of `plan`: backward of microbatch_loss(microbatch) (already
  // weighted), result.loss += its value, microbatch peaks. Releases the autograd buffers and
  // rethrows on an out-of-memory error.
  void run_microbatches(const MicrobatchPlan& plan,
                        const std::function<torch::Tensor(const Microbatch&)>& microbatch_loss,
                        StepResult& result);
  // zero_grad, plan, accumulate, before_optimizer_step, optimizer step, OOM handling.
  StepResult step(const std::vector<std::vector<double>>& record_dims,
                  const std::function<StepResult(const MicrobatchPlan&)>& accumulate,
                  const BeforeOptimizerStepFn& before_optimizer_step);

  torch::optim::Optimizer& optimizer_;
  const PredictiveBatcher& batcher_;
  MemoryMeter* meter_;
  std::int64_t step_peak_bytes_ = 0;  // running maximum of the meter's peak within a step
  std::vector<double> oom_microbatch_dims_;  // see last_oom_microbatch_dims()
  bool measures_reserved_bytes_ = true;
};

/// Records a step's losses in the context (under its current scope): "loss" = result.loss, and
/// for named losses "loss/<name>" = its per-unit mean. Nothing for a step skipped by an
/// out-of-memory error.
void report_losses(const StepResult& result, TrainerContext& context);

}  // namespace xpm
