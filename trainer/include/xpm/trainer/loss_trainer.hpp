// xpm/trainer/loss_trainer.hpp — one optimizer step over an outer batch split into microbatches
// by a PredictiveBatcher, with exact gradient accumulation.
//
//   LossTrainer trainer(optimizer, batcher, &CpuMemoryMeter::instance());
//   StepResult r = trainer.train_step(record_dims, record_units,
//       [&](const std::vector<std::size_t>& ids) { return loss_sum_of(ids); });
//
// Exact gradients: microbatch j's summed loss is divided by the outer batch's total units
// (real tokens for a token loss, records for a record loss), so the accumulated gradient is the
// gradient of the outer batch's mean loss, whatever the number of microbatches (DESIGN.md 4).
// Single process (DDP comes later): a record predicted over budget even alone is skipped and
// counted, never run; an out-of-memory error during the step skips the whole step (gradients
// zeroed, no optimizer step) and is counted in StepResult::oom.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <torch/torch.h>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"

namespace xpm {

/// Returns the SUM of per-unit losses over the given records (a scalar tensor requiring grad).
using MicrobatchLossFn = std::function<torch::Tensor(const std::vector<std::size_t>& records)>;

/// What one microbatch was predicted to need and what its forward/backward measured.
struct MicrobatchPeak {
  std::vector<double> dims;                // aggregated dims of the microbatch
  double predicted_bytes = 0;              // model.predict_bytes(dims) when planned
  double forward_backward_peak_bytes = 0;  // measured peak allocated bytes
};

struct StepResult {
  double loss = 0;                   // mean loss per unit over the outer batch (executed records)
  double units = 0;                  // units (e.g. real tokens) in the executed records
  std::int64_t microbatches = 0;     // microbatches run
  std::int64_t skipped_records = 0;  // records predicted over budget even alone
  bool oom = false;                  // the step ran out of memory and was skipped
  std::int64_t peak_allocated_bytes = 0;  // meter peak during the step (0 without a meter)
  double max_predicted_bytes = 0;    // largest predicted microbatch peak in the plan
  std::vector<MicrobatchPeak> microbatch_peaks;  // one per microbatch run (with a meter)
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
  /// plan names a record beyond record_units.
  StepResult accumulate_gradients(const MicrobatchPlan& plan, const std::vector<double>& record_units,
                                  const MicrobatchLossFn& loss_sum_fn, double units_denominator = 0);

  /// zero_grad, plan the outer batch, accumulate_gradients, optimizer step.
  /// record_dims[i]: record i's dims (formula variables); record_units[i]: its units.
  StepResult train_step(const std::vector<std::vector<double>>& record_dims,
                        const std::vector<double>& record_units, const MicrobatchLossFn& loss_sum_fn);

 private:
  torch::optim::Optimizer& optimizer_;
  const PredictiveBatcher& batcher_;
  MemoryMeter* meter_;
  std::int64_t step_peak_bytes_ = 0;  // running maximum of the meter's peak within a step
};

}  // namespace xpm
