#include "xpm/trainer/steps/multiple_trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

#include "xpm/trainer/loop/error_context.hpp"

namespace xpm {

MultipleTrainer::MultipleTrainer(torch::optim::Optimizer& optimizer, MemoryMeter* meter,
                                 std::vector<SubTrainer> sub_trainers)
    : optimizer_(optimizer), meter_(meter), sub_trainers_(std::move(sub_trainers)) {
  if (sub_trainers_.empty()) throw std::invalid_argument("MultipleTrainer: no sub-trainer");
  std::set<std::string> names;
  for (const SubTrainer& sub : sub_trainers_) {
    const std::string where = "MultipleTrainer: sub-trainer '" + sub.name + "'";
    if (sub.name.empty() || sub.name.find('/') != std::string::npos) {
      throw std::invalid_argument(where + ": a name must be non-empty without '/'");
    }
    if (!names.insert(sub.name).second) throw std::invalid_argument(where + " appears twice");
    if (!(sub.weight > 0) || !std::isfinite(sub.weight)) {
      throw std::invalid_argument(where + ": weight must be finite and > 0, got " +
                                  std::to_string(sub.weight));
    }
    if (sub.batcher == nullptr) throw std::invalid_argument(where + " has no batcher");
    if (!sub.next_batch) throw std::invalid_argument(where + " has no next_batch");
  }
}

std::map<std::string, const MemoryModel*> MultipleTrainer::probe_and_fit() {
  std::map<std::string, const MemoryModel*> models;
  for (SubTrainer& sub : sub_trainers_) {
    if (sub.probe_executor == nullptr) {
      if (!sub.batcher->has_model()) {
        throw std::invalid_argument("MultipleTrainer: sub-trainer '" + sub.name +
                                    "' has neither a probe executor nor a model");
      }
    } else {
      with_error_context("sub-trainer '" + sub.name + "'",
                         [&] { sub.batcher->probe_and_fit(*sub.probe_executor); });
    }
    models[sub.name] = &sub.batcher->model();
  }
  return models;
}

MultipleStepResult MultipleTrainer::train_step(const BeforeOptimizerStepFn& before_optimizer_step) {
  std::vector<OuterBatch> batches;
  batches.reserve(sub_trainers_.size());
  for (SubTrainer& sub : sub_trainers_) batches.push_back(sub.next_batch());
  return train_step(batches, before_optimizer_step);
}

MultipleStepResult MultipleTrainer::train_step(const std::vector<OuterBatch>& batches,
                                               const BeforeOptimizerStepFn& before_optimizer_step) {
  const auto start = std::chrono::steady_clock::now();
  if (batches.size() != sub_trainers_.size()) {
    throw std::invalid_argument("MultipleTrainer::train_step: " + std::to_string(batches.size()) +
                                " batches for " + std::to_string(sub_trainers_.size()) +
                                " sub-trainers");
  }
  for (std::size_t k = 0; k < batches.size(); ++k) {
    if (batches[k].record_dims.size() != batches[k].record_units.size()) {
      throw std::invalid_argument("MultipleTrainer: sub-trainer '" + sub_trainers_[k].name +
                                  "' batch has " + std::to_string(batches[k].record_dims.size()) +
                                  " record dims but " +
                                  std::to_string(batches[k].record_units.size()) + " record units");
    }
  }
  // Plans first: a batcher without a model fails before any gradient is touched.
  std::vector<MicrobatchPlan> plans;
  for (std::size_t k = 0; k < batches.size(); ++k) {
    if (!sub_trainers_[k].batcher->has_model()) {
      throw std::logic_error("MultipleTrainer: sub-trainer '" + sub_trainers_[k].name +
                             "' has no memory model: call probe_and_fit() first");
    }
    plans.push_back(sub_trainers_[k].batcher->plan(batches[k].record_dims));
  }

  MultipleStepResult result;
  std::int64_t peak_bytes = 0;
  if (meter_ != nullptr) meter_->reset_peak();
  zero_gradients_in_place(optimizer_);
  std::size_t current = 0;
  try {
    for (current = 0; current < batches.size(); ++current) {
      const SubTrainer& sub = sub_trainers_[current];
      // Each sub-trainer's own LossTrainer view: same optimizer, its own batcher and meter.
      LossTrainer local(optimizer_, *sub.batcher, meter_);
      const double weight = sub.weight;
      const MicrobatchLossFn& loss_sum_fn = batches[current].loss_sum_fn;
      StepResult sub_result = local.accumulate_gradients(
          plans[current], batches[current].record_units,
          [&](const std::vector<std::size_t>& records) { return loss_sum_fn(records) * weight; });
      sub_result.loss /= weight;  // back to the sub-trainer's own per-unit mean
      if (meter_ != nullptr) {
        for (const MicrobatchPeak& peak : sub_result.microbatch_peaks) {
          peak_bytes = std::max(peak_bytes, static_cast<std::int64_t>(peak.forward_backward_peak_bytes));
        }
        peak_bytes = std::max(peak_bytes, meter_->peak_allocated_bytes());
      }
      result.loss += weight * sub_result.loss;
      result.sub_results[sub.name] = std::move(sub_result);
    }
    std::int64_t microbatches = 0;
    for (const auto& item : result.sub_results) microbatches += item.second.microbatches;
    if (meter_ != nullptr) start_peak(*meter_);
    if (microbatches > 0) {
      if (before_optimizer_step) before_optimizer_step();
      optimizer_.step();
    }
    if (meter_ != nullptr) {
      result.optimizer_step_peak_bytes = static_cast<double>(meter_->peak_allocated_bytes());
      peak_bytes = std::max(peak_bytes, meter_->peak_allocated_bytes());
    }
  } catch (const c10::OutOfMemoryError&) {
    // accumulate_gradients released the failed backward's buffers; drop the partial gradient.
    zero_gradients_in_place(optimizer_);
    const std::string name = current < sub_trainers_.size() ? sub_trainers_[current].name : "";
    result = MultipleStepResult{};
    result.oom = true;
    result.oom_sub_trainer = name;
    if (meter_ != nullptr) peak_bytes = std::max(peak_bytes, meter_->peak_allocated_bytes());
  }
  result.peak_allocated_bytes = peak_bytes;
  result.duration_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

void report_losses(const MultipleStepResult& result, TrainerContext& context) {
  if (result.oom) return;
  context.add_metric("loss", result.loss);
  for (const auto& [name, sub] : result.sub_results) {
    context.add_metric(name + "/loss", sub.loss);
    context.add_metric(name + "/units", sub.units);
  }
}

}  // namespace xpm
