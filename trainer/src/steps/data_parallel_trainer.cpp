#include "xpm/trainer/steps/data_parallel_trainer.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

#include "xpm/planner/rank_assignment.hpp"

namespace xpm {
namespace {


// The gradients of the optimizer's parameters (undefined ones included; unscale_ skips them).
std::vector<torch::Tensor> gradients_of(torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> gradients;
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) gradients.push_back(parameter.grad());
  }
  return gradients;
}

}  // namespace

DataParallelTrainer::DataParallelTrainer(torch::optim::Optimizer& optimizer,
                                         const PredictiveBatcher& batcher, MemoryMeter* meter,
                                         DistributedContext& context, GradientBuckets* buckets,
                                         ShardedAdamW* sharded)
    : optimizer_(optimizer), batcher_(batcher), meter_(meter), context_(context), buckets_(buckets),
      sharded_(sharded), local_(optimizer, batcher, meter) {
  if (context_.distributed() && buckets_ == nullptr && sharded_ == nullptr) {
    throw std::invalid_argument("DataParallelTrainer: gradient buckets are required when world_size is " +
                                std::to_string(context_.world_size()));
  }
}

bool DataParallelTrainer::unscale_gradients(const std::vector<torch::Tensor>& gradients,
                                            DistributedContext& owners, GlobalStepResult& result) {
  if (loss_scaler_ == nullptr) return false;
  result.loss_scale = loss_scaler_->current_scale();
  result.loss_scale_overflow = loss_scaler_->unscale_(gradients, owners);  // collective over the owners
  loss_scaler_->update();
  return result.loss_scale_overflow;
}

void DataParallelTrainer::zero_grad() {
  if (sharded_ != nullptr) {
    sharded_->zero_grad();
  } else {
    zero_gradients_in_place(optimizer_);
  }
}

GlobalStepResult DataParallelTrainer::train_step(const std::vector<std::vector<double>>& record_dims,
                                                 const std::vector<double>& record_units,
                                                 const MicrobatchLossFn& loss_sum_fn,
                                                 const BeforeOptimizerStepFn& before_optimizer_step) {
  if (record_dims.size() != record_units.size()) {
    throw std::invalid_argument("DataParallelTrainer: " + std::to_string(record_dims.size()) +
                                " record dims but " + std::to_string(record_units.size()) + " record units");
  }
  const auto start = std::chrono::steady_clock::now();
  const int world = context_.world_size(), rank = context_.rank();
  const MemoryModel& model = batcher_.model();
  const double usable_bytes = static_cast<double>(batcher_.options().budget.usable_bytes());

  // Split the global batch (every rank computes the same split) and count its units.
  GlobalStepResult result;
  const std::vector<double> costs = marginal_costs_bytes(model, record_dims);
  double global_units = 0;
  for (std::size_t i = 0; i < record_dims.size(); ++i) {
    if (model.fits(record_dims[i], usable_bytes)) global_units += record_units[i];  // as the packer decides
  }
  const RankAssignment assignment = assign_records_to_ranks(costs, world);
  const std::vector<std::size_t>& mine = assignment.records_per_rank[static_cast<std::size_t>(rank)];
  for (const auto& records : assignment.records_per_rank) {
    result.records_per_rank.push_back(static_cast<std::int64_t>(records.size()));
  }
  result.predicted_cost_per_rank = assignment.cost_per_rank;
  result.imbalance = assignment.imbalance();

  // This rank's share: plan, accumulate with the global units as denominator.
  std::vector<std::vector<double>> my_dims;
  std::vector<double> my_units;
  for (std::size_t i : mine) {
    my_dims.push_back(record_dims[i]);
    my_units.push_back(record_units[i]);
  }
  if (meter_ != nullptr) meter_->reset_peak();
  zero_grad();
  StepResult local;
  bool local_oom = false;
  std::vector<double> local_oom_dims;
  try {
    const MicrobatchPlan plan = batcher_.plan(my_dims);
    local = local_.accumulate_gradients(
        plan, my_units,
        [&](const std::vector<std::size_t>& local_records) {
          std::vector<std::size_t> global_records;
          for (std::size_t j : local_records) global_records.push_back(mine[j]);
          const torch::Tensor loss_sum = loss_sum_fn(global_records);
          return loss_scaler_ != nullptr ? loss_scaler_->scale(loss_sum) : loss_sum;
        },
        global_units);
    if (loss_scaler_ != nullptr) local.loss /= loss_scaler_->current_scale();  // report the true loss
  } catch (const c10::OutOfMemoryError&) {
    local_oom = true;
    local_oom_dims = local_.last_oom_microbatch_dims();
    local = StepResult{};
  }
  double step_peak_bytes = meter_ != nullptr ? static_cast<double>(meter_->peak_allocated_bytes()) : 0;
  for (const MicrobatchPeak& peak : local.microbatch_peaks) {
    step_peak_bytes = std::max(step_peak_bytes, peak.forward_backward_peak_bytes);
  }

  // 1. Status: [loss, skipped records, oom per rank (w), microbatches per rank (w), dims of the
  // microbatch that ran out of memory per rank (w x dims; 0 where none), stop requests].
  const std::size_t dim_count = model.formula().variable_names().size();
  const std::size_t w = static_cast<std::size_t>(world);
  std::vector<double> status(2 + 2 * w + w * dim_count + 1, 0.0);
  status.back() = stop_flag_ != nullptr && stop_flag_->load() ? 1 : 0;
  status[0] = local.loss;
  status[1] = static_cast<double>(local.skipped_records);
  status[2 + static_cast<std::size_t>(rank)] = local_oom ? 1 : 0;
  status[2 + static_cast<std::size_t>(world + rank)] = static_cast<double>(local.microbatches);
  if (local_oom_dims.size() == dim_count) {
    std::copy(local_oom_dims.begin(), local_oom_dims.end(),
              status.begin() + static_cast<std::ptrdiff_t>(2 + 2 * w + static_cast<std::size_t>(rank) * dim_count));
  }
  status = context_.all_reduce(status, ReduceOp::kSum);
  result.stop_requested = status.back() > 0;
  result.loss = status[0];
  result.skipped_records = static_cast<std::int64_t>(status[1]);
  std::int64_t max_microbatches = 0;
  for (int r = 0; r < world; ++r) {
    if (status[2 + static_cast<std::size_t>(r)] > 0) {
      result.oom_ranks.push_back(r);
      const auto first = status.begin() + static_cast<std::ptrdiff_t>(2 + 2 * w + static_cast<std::size_t>(r) * dim_count);
      std::vector<double> dims(first, first + static_cast<std::ptrdiff_t>(dim_count));
      if (std::all_of(dims.begin(), dims.end(), [](double d) { return d == 0; })) dims.clear();
      result.oom_microbatch_dims.push_back(std::move(dims));
    }
    const auto count = static_cast<std::int64_t>(status[2 + static_cast<std::size_t>(world + r)]);
    result.microbatches_per_rank.push_back(count);
    result.microbatches += count;
    max_microbatches = std::max(max_microbatches, count);
  }
  result.oom = !result.oom_ranks.empty();

  // 2. Every rank's microbatch peaks: [rank][slot][dims..., predicted, measured].
  const std::size_t fields = dim_count + 2;
  if (meter_ != nullptr && max_microbatches > 0) {
    const std::size_t slots = static_cast<std::size_t>(max_microbatches);
    std::vector<double> peaks(static_cast<std::size_t>(world) * slots * fields, 0.0);
    for (std::size_t j = 0; j < local.microbatch_peaks.size() && j < slots; ++j) {
      double* out = &peaks[(static_cast<std::size_t>(rank) * slots + j) * fields];
      const MicrobatchPeak& peak = local.microbatch_peaks[j];
      std::copy(peak.dims.begin(), peak.dims.end(), out);
      out[dim_count] = peak.predicted_bytes;
      out[dim_count + 1] = peak.forward_backward_peak_bytes;
    }
    peaks = context_.all_reduce(peaks, ReduceOp::kSum);
    for (int r = 0; r < world; ++r) {
      for (std::int64_t j = 0; j < result.microbatches_per_rank[static_cast<std::size_t>(r)]; ++j) {
        const double* in = &peaks[(static_cast<std::size_t>(r) * slots + static_cast<std::size_t>(j)) * fields];
        if (in[dim_count + 1] <= 0) continue;  // that rank ran out of memory before measuring it
        MicrobatchPeak peak;
        peak.dims.assign(in, in + dim_count);
        peak.predicted_bytes = in[dim_count];
        peak.forward_backward_peak_bytes = in[dim_count + 1];
        result.max_predicted_bytes = std::max(result.max_predicted_bytes, peak.predicted_bytes);
        result.microbatch_peaks.push_back(std::move(peak));
        result.microbatch_peak_ranks.push_back(r);
      }
    }
  }

  // 3. Gradients and the optimizer step, or a step skipped on every rank.
  double optimizer_step_peak_bytes = 0;
  if (result.oom) {
    zero_grad();
    result.loss = 0;
  } else if (sharded_ != nullptr) {
    if (meter_ != nullptr) meter_->reset_peak();
    if (result.microbatches > 0) {  // global count: every rank takes the same branch
      sharded_->reduce_gradients();
      if (!unscale_gradients(sharded_->owned_gradients(), sharded_->ownership_context(), result)) {
        if (before_optimizer_step) before_optimizer_step();
        const double max_norm = sharded_->options().max_grad_norm;
        if (max_norm > 0) result.gradient_norm = sharded_->clip_gradients(max_norm).gradient_norm;
        sharded_->step_owned();
        sharded_->gather_parameters();
      }
    }
    if (meter_ != nullptr) optimizer_step_peak_bytes = static_cast<double>(meter_->peak_allocated_bytes());
    result.units = result.loss_scale_overflow ? 0 : global_units;
  } else {
    if (meter_ != nullptr) meter_->reset_peak();
    if (buckets_ != nullptr) buckets_->all_reduce_sum(context_);
    if (result.microbatches > 0 && !unscale_gradients(gradients_of(optimizer_), context_, result)) {
      if (before_optimizer_step) before_optimizer_step();
      optimizer_.step();
    }
    if (meter_ != nullptr) optimizer_step_peak_bytes = static_cast<double>(meter_->peak_allocated_bytes());
    result.units = result.loss_scale_overflow ? 0 : global_units;
  }

  // 4. Peaks over ranks.
  const std::vector<double> peaks =
      context_.all_reduce({step_peak_bytes, optimizer_step_peak_bytes}, ReduceOp::kMax);
  result.peak_allocated_bytes = static_cast<std::int64_t>(std::max(peaks[0], peaks[1]));
  result.optimizer_step_peak_bytes = peaks[1];
  result.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace xpm
