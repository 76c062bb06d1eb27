#include "xpm/trainer/steps/fixed_batchers.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace xpm {
namespace {

// Parameters whose .grad is undefined (never allocated, or frozen): after a failed attempt
// they get an undefined gradient back, so memory returns to the pre-step baseline even on the
// first step, before any gradient existed.
std::vector<torch::Tensor> parameters_without_gradient(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      if (!parameter.grad().defined()) out.push_back(parameter);
    }
  }
  return out;
}

// A PredictiveBatcher that is never asked to plan: one coefficient, one probe point, 1 byte.
PredictiveBatcher placeholder_predictive_batcher() {
  PredictiveBatcherOptions options;
  options.formula = CostFormula("a*bs", {"a"}, {"bs"});
  options.probe_points = {{{{"bs", 1}}}};
  options.budget = {1, 1.0, 0};
  return PredictiveBatcher(options, std::make_shared<UniformPacker>());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

MicrobatchPlan fixed_size_plan(std::size_t record_count, std::int64_t microbatch_size) {
  if (microbatch_size < 1) {
    throw std::invalid_argument("fixed_size_plan: microbatch_size must be >= 1, got " +
                                std::to_string(microbatch_size));
  }
  MicrobatchPlan plan;
  const auto size = static_cast<std::size_t>(microbatch_size);
  for (std::size_t begin = 0; begin < record_count; begin += size) {
    Microbatch microbatch;
    for (std::size_t i = begin; i < std::min(record_count, begin + size); ++i) {
      microbatch.record_indices.push_back(i);
    }
    microbatch.dims = {static_cast<double>(microbatch.record_indices.size())};
    plan.microbatches.push_back(std::move(microbatch));
  }
  return plan;
}

FixedBatcher::FixedBatcher(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                           std::int64_t microbatch_size)
    : optimizer_(optimizer),
      meter_(meter),
      microbatch_size_(microbatch_size),
      unused_predictive_batcher_(placeholder_predictive_batcher()),
      local_(optimizer, unused_predictive_batcher_, meter) {
  local_.set_measures_reserved_bytes(false);  // plans nothing: no cache emptied for it
  if (microbatch_size < 1) {
    throw std::invalid_argument("FixedBatcher: microbatch_size must be >= 1, got " +
                                std::to_string(microbatch_size));
  }
}

GlobalStepResult FixedBatcher::try_step(const std::vector<double>& record_units,
                                        const MicrobatchLossFn& loss_sum_fn,
                                        const BeforeOptimizerStepFn& before_optimizer_step) {
  GlobalStepResult result;
  result.records_per_rank = {static_cast<std::int64_t>(record_units.size())};
  result.predicted_cost_per_rank = {0.0};
  if (meter_ != nullptr) meter_->reset_peak();
  zero_gradients_in_place(optimizer_);
  const std::int64_t baseline_bytes = meter_ != nullptr ? meter_->current_allocated_bytes() : 0;
  const std::vector<torch::Tensor> without_gradient = parameters_without_gradient(optimizer_);
  StepResult local;
  bool oom = false;
  last_oom_ = nullptr;
  last_oom_bytes_above_baseline_ = 0;
  try {
    // accumulate_gradients drops the failed microbatch's graph and releases what the autograd
    // engine kept of it before rethrowing.
    local = local_.accumulate_gradients(fixed_size_plan(record_units.size(), microbatch_size_),
                                        record_units, loss_sum_fn);
  } catch (const c10::OutOfMemoryError&) {
    oom = true;
    last_oom_ = std::current_exception();
    local = StepResult{};
  }
  // The meter's peak covers the last microbatch (accumulate_gradients resets it per
  // microbatch) or the failed one; the others are in microbatch_peaks.
  double step_peak_bytes = meter_ != nullptr ? static_cast<double>(meter_->peak_allocated_bytes()) : 0;
  for (const MicrobatchPeak& peak : local.microbatch_peaks) {
    step_peak_bytes = std::max(step_peak_bytes, peak.forward_backward_peak_bytes);
  }
  double optimizer_step_peak_bytes = 0;
  if (oom) {
    // Clean state for a retry: gradients zeroed, those created by this attempt freed.
    zero_gradients_in_place(optimizer_);
    for (torch::Tensor parameter : without_gradient) parameter.mutable_grad() = torch::Tensor();
    if (meter_ != nullptr) {
      last_oom_bytes_above_baseline_ = meter_->current_allocated_bytes() - baseline_bytes;
    }
    result.oom = true;
    result.oom_ranks = {0};
    result.microbatches_per_rank = {0};
  } else {
    result.loss = local.loss;
    result.units = local.units;
    result.microbatches = local.microbatches;
    result.microbatches_per_rank = {local.microbatches};
    result.microbatch_peaks = local.microbatch_peaks;
    result.microbatch_peak_ranks.assign(local.microbatch_peaks.size(), 0);
    if (meter_ != nullptr) meter_->reset_peak();
    if (local.microbatches > 0) {
      if (before_optimizer_step) before_optimizer_step();
      optimizer_.step();
    }
    if (meter_ != nullptr) optimizer_step_peak_bytes = static_cast<double>(meter_->peak_allocated_bytes());
  }
  result.optimizer_step_peak_bytes = optimizer_step_peak_bytes;
  result.peak_allocated_bytes =
      static_cast<std::int64_t>(std::max(step_peak_bytes, optimizer_step_peak_bytes));
  return result;
}

BatcherStepResult FixedBatcher::train_step(const std::vector<double>& record_units,
                                           const MicrobatchLossFn& loss_sum_fn,
                                           const BeforeOptimizerStepFn& before_optimizer_step) {
  const auto start = std::chrono::steady_clock::now();
  BatcherStepResult out;
  out.microbatch_size = microbatch_size_;
  out.attempts = 1;
  out.step = try_step(record_units, loss_sum_fn, before_optimizer_step);
  if (out.step.oom) {
    out.ooms = 1;
    ++ooms_;
    out.max_bytes_above_baseline_after_oom = last_oom_bytes_above_baseline_;
  }
  out.step.duration_s = seconds_since(start);
  return out;
}

void PowerAdaptativeBatcherOptions::validate() const {
  if (outer_batch_size < 1) {
    throw std::invalid_argument("PowerAdaptativeBatcherOptions.outer_batch_size must be >= 1, got " +
                                std::to_string(outer_batch_size));
  }
  if (initial_microbatch_size < 0 || initial_microbatch_size > outer_batch_size) {
    throw std::invalid_argument(
        "PowerAdaptativeBatcherOptions.initial_microbatch_size must be in [1, outer_batch_size = " +
        std::to_string(outer_batch_size) + "] or 0 (the outer batch size), got " +
        std::to_string(initial_microbatch_size));
  }
}

void PowerAdaptativeBatcher::check_single_process(int world_size) {
  if (world_size > 1) {
    throw std::invalid_argument(
        "PowerAdaptativeBatcher refuses world_size " + std::to_string(world_size) +
        ": it runs in a single process only. When one rank runs out of memory and shrinks its "
        "microbatch while the others don't, the ranks desynchronize at the next collective and "
        "the job hangs (https://github.com/pytorch/pytorch/issues/50820). Use the predictive "
        "batcher (xpm-train --batcher predictive, the default) for data-parallel runs");
  }
}

namespace {

PowerAdaptativeBatcherOptions validated(PowerAdaptativeBatcherOptions options, int world_size) {
  PowerAdaptativeBatcher::check_single_process(world_size);
  options.validate();
  return options;
}

}  // namespace

PowerAdaptativeBatcher::PowerAdaptativeBatcher(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                                               PowerAdaptativeBatcherOptions options, int world_size)
    : FixedBatcher(optimizer, meter,
                   validated(options, world_size).initial_microbatch_size > 0
                       ? options.initial_microbatch_size
                       : options.outer_batch_size),
      options_(options) {}

std::int64_t PowerAdaptativeBatcher::next_divisor() const {
  // outer // n < size  <=>  outer < size * n  <=>  n > outer / size: the smallest such n.
  return std::max(divisor_ + 1, options_.outer_batch_size / microbatch_size_ + 1);
}

std::int64_t PowerAdaptativeBatcher::next_microbatch_size() const {
  return options_.outer_batch_size / next_divisor();
}

void PowerAdaptativeBatcher::restore_size(std::int64_t microbatch_size, std::int64_t divisor) {
  const bool initial = divisor == 1 && microbatch_size == microbatch_size_;
  if (divisor < 1 || microbatch_size < 1 ||
      (!initial && microbatch_size != options_.outer_batch_size / divisor)) {
    throw std::invalid_argument("PowerAdaptativeBatcher::restore_size: microbatch size " +
                                std::to_string(microbatch_size) + " is not outer_batch_size " +
                                std::to_string(options_.outer_batch_size) + " // " +
                                std::to_string(divisor));
  }
  microbatch_size_ = microbatch_size;
  divisor_ = divisor;
}

BatcherStepResult PowerAdaptativeBatcher::train_step(const std::vector<double>& record_units,
                                                     const MicrobatchLossFn& loss_sum_fn,
                                                     const BeforeOptimizerStepFn& before_optimizer_step) {
  const auto start = std::chrono::steady_clock::now();
  BatcherStepResult out;
  std::int64_t peak_allocated_bytes = 0;
  for (;;) {
    // One size for the whole outer batch per attempt: a retry re-cuts the same records from
    // the start at the smaller size, never splits a failed microbatch further.
    out.microbatch_size = microbatch_size_;
    ++out.attempts;
    out.step = try_step(record_units, loss_sum_fn, before_optimizer_step);
    peak_allocated_bytes = std::max(peak_allocated_bytes, out.step.peak_allocated_bytes);
    if (!out.step.oom) break;
    ++out.ooms;
    ++ooms_;
    out.max_bytes_above_baseline_after_oom =
        std::max(out.max_bytes_above_baseline_after_oom, last_oom_bytes_above_baseline_);
    const std::int64_t next = next_microbatch_size();
    if (next < 1) {  // 1 record per microbatch still ran out of memory: rethrow, no step
      ++failed_steps_;
      if (out.attempts > 1) ++retried_steps_;
      std::rethrow_exception(last_oom_);  // the size-1 attempt's own error object
    }
    divisor_ = next_divisor();
    microbatch_size_ = next;
  }
  if (out.attempts > 1) ++retried_steps_;
  out.step.peak_allocated_bytes = peak_allocated_bytes;
  out.step.duration_s = seconds_since(start);
  return out;
}

}  // namespace xpm
