#include "xpm/trainer/loss_trainer.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace xpm {

LossTrainer::LossTrainer(torch::optim::Optimizer& optimizer, const PredictiveBatcher& batcher,
                         MemoryMeter* meter)
    : optimizer_(optimizer), batcher_(batcher), meter_(meter) {}

StepResult LossTrainer::accumulate_gradients(const MicrobatchPlan& plan,
                                             const std::vector<double>& record_units,
                                             const MicrobatchLossFn& loss_sum_fn,
                                             double units_denominator) {
  StepResult result;
  double total_units = 0;
  for (const Microbatch& microbatch : plan.microbatches) {
    result.max_predicted_bytes = std::max(result.max_predicted_bytes, microbatch.predicted_bytes);
    if (microbatch.over_budget) {
      result.skipped_records += static_cast<std::int64_t>(microbatch.record_indices.size());
      continue;
    }
    for (std::size_t record : microbatch.record_indices) {
      if (record >= record_units.size()) {
        throw std::invalid_argument("LossTrainer: plan names record " + std::to_string(record) +
                                    " but only " + std::to_string(record_units.size()) +
                                    " record units were given");
      }
      total_units += record_units[record];
    }
  }
  result.units = total_units;
  if (total_units <= 0) return result;
  if (units_denominator > 0) total_units = units_denominator;
  for (const Microbatch& microbatch : plan.microbatches) {
    if (microbatch.over_budget) continue;
    // The meter's peak is reset per microbatch; step_peak_bytes_ keeps the step's maximum.
    if (meter_ != nullptr) {
      step_peak_bytes_ = std::max(step_peak_bytes_, meter_->peak_allocated_bytes());
      meter_->reset_peak();
    }
    torch::Tensor loss = loss_sum_fn(microbatch.record_indices) / total_units;
    loss.backward();
    result.loss += loss.item<double>();
    ++result.microbatches;
    if (meter_ != nullptr) {
      result.microbatch_peaks.push_back({microbatch.dims, microbatch.predicted_bytes,
                                         static_cast<double>(meter_->peak_allocated_bytes())});
    }
  }
  return result;
}

StepResult LossTrainer::train_step(const std::vector<std::vector<double>>& record_dims,
                                   const std::vector<double>& record_units,
                                   const MicrobatchLossFn& loss_sum_fn) {
  const auto start = std::chrono::steady_clock::now();
  step_peak_bytes_ = 0;
  if (meter_ != nullptr) meter_->reset_peak();
  optimizer_.zero_grad();
  const MicrobatchPlan plan = batcher_.plan(record_dims);
  StepResult result;
  try {
    result = accumulate_gradients(plan, record_units, loss_sum_fn);
    if (meter_ != nullptr) {
      step_peak_bytes_ = std::max(step_peak_bytes_, meter_->peak_allocated_bytes());
      meter_->reset_peak();
    }
    if (result.microbatches > 0) optimizer_.step();
    if (meter_ != nullptr) {
      result.optimizer_step_peak_bytes = static_cast<double>(meter_->peak_allocated_bytes());
    }
  } catch (const c10::OutOfMemoryError&) {
    optimizer_.zero_grad();
    result = StepResult{};
    result.oom = true;
  }
  if (meter_ != nullptr) {
    result.peak_allocated_bytes = std::max(step_peak_bytes_, meter_->peak_allocated_bytes());
  }
  result.duration_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace xpm
