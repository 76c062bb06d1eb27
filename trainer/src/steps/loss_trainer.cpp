#include "xpm/trainer/steps/loss_trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

#include "xpm/planner_torch/cpu_memory_meter.hpp"

namespace xpm {

void zero_gradients_in_place(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      if (parameter.grad().defined()) parameter.mutable_grad().zero_();
    }
  }
}

void release_autograd_buffers_after_oom() {
  CpuMemoryMeter& meter = CpuMemoryMeter::instance();
  const std::int64_t capacity_bytes = meter.capacity_bytes();
  meter.set_capacity_bytes(0);
  try {
    torch::AutoGradMode grad_mode(true);
    torch::zeros({1}, torch::requires_grad()).sum().backward();
  } catch (...) {
    meter.set_capacity_bytes(capacity_bytes);
    throw;
  }
  meter.set_capacity_bytes(capacity_bytes);
}

void WeightedLosses::validate() const {
  if (weights.empty()) throw std::invalid_argument("WeightedLosses.weights is empty");
  for (const auto& [name, weight] : weights) {
    if (name.empty() || name.find('/') != std::string::npos) {
      throw std::invalid_argument("WeightedLosses: bad loss name '" + name +
                                  "' (empty or containing '/')");
    }
    if (!(weight >= 0) || !std::isfinite(weight)) {
      throw std::invalid_argument("WeightedLosses.weights['" + name +
                                  "'] must be finite and >= 0, got " + std::to_string(weight));
    }
  }
  for (const auto& item : record_units) {
    if (weights.count(item.first) == 0) {
      throw std::invalid_argument("WeightedLosses.record_units has loss '" + item.first +
                                  "', which has no weight");
    }
  }
}

LossTrainer::LossTrainer(torch::optim::Optimizer& optimizer, const PredictiveBatcher& batcher,
                         MemoryMeter* meter)
    : optimizer_(optimizer), batcher_(batcher), meter_(meter) {}

namespace {

// Units of the plan's executable records; throws when a record is out of range.
double executable_units(const MicrobatchPlan& plan, const std::vector<double>& record_units,
                        const std::string& what) {
  double units = 0;
  for (const Microbatch& microbatch : plan.microbatches) {
    if (microbatch.over_budget) continue;
    for (std::size_t record : microbatch.record_indices) {
      if (record >= record_units.size()) {
        throw std::invalid_argument("LossTrainer: plan names record " + std::to_string(record) +
                                    " but only " + std::to_string(record_units.size()) + " " +
                                    what + " were given");
      }
      units += record_units[record];
    }
  }
  return units;
}

}  // namespace

void LossTrainer::start_measured_peak() {
  if (measures_reserved_bytes_) {
    start_peak(*meter_);
  } else {
    meter_->reset_peak();
  }
}

void LossTrainer::run_microbatches(const MicrobatchPlan& plan,
                                   const std::function<torch::Tensor(const Microbatch&)>& microbatch_loss,
                                   StepResult& result) {
  oom_microbatch_dims_.clear();
  for (const Microbatch& microbatch : plan.microbatches) {
    if (microbatch.over_budget) continue;
    // The meter's peak is reset per microbatch; step_peak_bytes_ keeps the step's maximum.
    if (meter_ != nullptr) {
      step_peak_bytes_ = std::max(step_peak_bytes_, meter_->peak_allocated_bytes());
      start_measured_peak();
    }
    try {
      torch::Tensor loss = microbatch_loss(microbatch);
      if (!loss.defined() || loss.numel() != 1) {
        throw std::invalid_argument("the microbatch's loss must be a scalar tensor (the task's loss_sum), got " +
                                    (loss.defined() ? "one of shape " + c10::str(loss.sizes()) : "an undefined one"));
      }
      loss.backward();
      result.loss += loss.item<double>();
    } catch (const c10::OutOfMemoryError&) {
      // The loss and its graph are gone (unwound); what the engine still holds goes now.
      release_autograd_buffers_after_oom();
      oom_microbatch_dims_ = microbatch.dims;
      throw;
    }
    ++result.microbatches;
    if (meter_ != nullptr) {
      result.microbatch_peaks.push_back(
          {microbatch.dims, microbatch.predicted_bytes, static_cast<double>(meter_->peak_allocated_bytes()),
           measures_reserved_bytes_ && meter_->reserves_segments() ? static_cast<double>(meter_->peak_reserved_bytes())
                                                                   : 0.0});
    }
  }
}

StepResult LossTrainer::accumulate_gradients(const MicrobatchPlan& plan,
                                             const std::vector<double>& record_units,
                                             const MicrobatchLossFn& loss_sum_fn,
                                             double units_denominator) {
  StepResult result;
  for (const Microbatch& microbatch : plan.microbatches) {
    result.max_predicted_bytes = std::max(result.max_predicted_bytes, microbatch.predicted_bytes);
    if (microbatch.over_budget) {
      result.skipped_records += static_cast<std::int64_t>(microbatch.record_indices.size());
    }
  }
  double total_units = executable_units(plan, record_units, "record units");
  result.units = total_units;
  if (total_units <= 0) return result;
  if (units_denominator > 0) total_units = units_denominator;
  run_microbatches(
      plan,
      [&](const Microbatch& microbatch) { return loss_sum_fn(microbatch.record_indices) / total_units; },
      result);
  return result;
}

StepResult LossTrainer::accumulate_weighted_losses(
    const MicrobatchPlan& plan, const std::vector<double>& record_units,
    const WeightedLosses& losses, const NamedLossSumsFn& loss_sums_fn,
    const std::map<std::string, double>& units_denominators) {
  losses.validate();
  StepResult result;
  for (const Microbatch& microbatch : plan.microbatches) {
    result.max_predicted_bytes = std::max(result.max_predicted_bytes, microbatch.predicted_bytes);
    if (microbatch.over_budget) {
      result.skipped_records += static_cast<std::int64_t>(microbatch.record_indices.size());
    }
  }
  result.units = executable_units(plan, record_units, "record units");
  std::map<std::string, double> denominators;  // U_k
  for (const auto& [name, weight] : losses.weights) {
    const auto own = losses.record_units.find(name);
    const std::vector<double>& units = own != losses.record_units.end() ? own->second : record_units;
    if (units.size() != record_units.size()) {
      throw std::invalid_argument("WeightedLosses.record_units['" + name + "'] has " +
                                  std::to_string(units.size()) + " entries, the outer batch " +
                                  std::to_string(record_units.size()) + " records");
    }
    NamedLossValue& value = result.named_losses[name];
    value.weight = weight;
    value.units = executable_units(plan, units, "units of loss '" + name + "'");
    const auto given = units_denominators.find(name);
    denominators[name] = given != units_denominators.end() && given->second > 0 ? given->second
                                                                               : value.units;
  }
  if (std::none_of(denominators.begin(), denominators.end(),
                   [](const auto& item) { return item.second > 0; })) {
    return result;  // no unit of any loss: nothing to run
  }
  std::map<std::string, double> sums;  // sum over the microbatches of S_k, as doubles
  run_microbatches(
      plan,
      [&](const Microbatch& microbatch) {
        std::map<std::string, torch::Tensor> parts = loss_sums_fn(microbatch.record_indices);
        for (const auto& [name, tensor] : parts) {
          if (losses.weights.count(name) == 0) {
            throw std::invalid_argument("LossTrainer: the loss function returned loss '" + name +
                                        "', which has no weight");
          }
          if (tensor.numel() != 1) {
            throw std::invalid_argument("LossTrainer: loss '" + name + "' is not a scalar (shape " +
                                        c10::str(tensor.sizes()) + ")");
          }
        }
        torch::Tensor combined;
        for (const auto& [name, weight] : losses.weights) {
          const auto part = parts.find(name);
          if (part == parts.end()) {
            throw std::invalid_argument("LossTrainer: the loss function did not return loss '" +
                                        name + "'");
          }
          if (denominators[name] <= 0) continue;
          sums[name] += part->second.detach().item<double>();
          torch::Tensor term = part->second.reshape({}) * (weight / denominators[name]);
          combined = combined.defined() ? combined + term : term;
        }
        return combined;  // defined: some loss has units
      },
      result);
  for (auto& [name, value] : result.named_losses) {
    value.mean = denominators[name] > 0 ? sums[name] / denominators[name] : 0.0;
  }
  return result;
}

StepResult LossTrainer::step(const std::vector<std::vector<double>>& record_dims,
                             const std::function<StepResult(const MicrobatchPlan&)>& accumulate,
                             const BeforeOptimizerStepFn& before_optimizer_step) {
  const auto start = std::chrono::steady_clock::now();
  step_peak_bytes_ = 0;
  if (meter_ != nullptr) meter_->reset_peak();
  zero_gradients_in_place(optimizer_);
  const MicrobatchPlan plan = batcher_.plan(record_dims);
  StepResult result;
  try {
    result = accumulate(plan);
    if (meter_ != nullptr) {  // cached activations' segments released: the optimizer's state packs tight
      step_peak_bytes_ = std::max(step_peak_bytes_, meter_->peak_allocated_bytes());
      start_measured_peak();
    }
    if (result.microbatches > 0) {
      if (before_optimizer_step) before_optimizer_step();
      optimizer_.step();
    }
    if (meter_ != nullptr) {
      result.optimizer_step_peak_bytes = static_cast<double>(meter_->peak_allocated_bytes());
    }
  } catch (const c10::OutOfMemoryError&) {
    // accumulate released the failed backward's buffers; what is left is the partial gradient.
    zero_gradients_in_place(optimizer_);
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

StepResult LossTrainer::train_step(const std::vector<std::vector<double>>& record_dims,
                                   const std::vector<double>& record_units,
                                   const MicrobatchLossFn& loss_sum_fn,
                                   const BeforeOptimizerStepFn& before_optimizer_step) {
  return step(
      record_dims,
      [&](const MicrobatchPlan& plan) { return accumulate_gradients(plan, record_units, loss_sum_fn); },
      before_optimizer_step);
}

StepResult LossTrainer::train_step(const std::vector<std::vector<double>>& record_dims,
                                   const std::vector<double>& record_units,
                                   const WeightedLosses& losses, const NamedLossSumsFn& loss_sums_fn,
                                   const BeforeOptimizerStepFn& before_optimizer_step) {
  losses.validate();
  return step(
      record_dims,
      [&](const MicrobatchPlan& plan) {
        return accumulate_weighted_losses(plan, record_units, losses, loss_sums_fn);
      },
      before_optimizer_step);
}

void report_losses(const StepResult& result, TrainerContext& context) {
  if (result.oom) return;
  context.add_metric("loss", result.loss);
  for (const auto& [name, value] : result.named_losses) context.add_metric("loss/" + name, value.mean);
}

}  // namespace xpm
