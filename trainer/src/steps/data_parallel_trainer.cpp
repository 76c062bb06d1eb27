#include "xpm/trainer/steps/data_parallel_trainer.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

#include "xpm/planner/rank_assignment.hpp"
#include "xpm/planner/step_plan.hpp"

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

// This rank's share of the global batch and what running it gave.
struct DataParallelTrainer::LocalShare {
  std::vector<std::size_t> records;  // indices into the global batch
  std::vector<std::vector<double>> dims;  // their dims and units
  std::vector<double> units;
  MicrobatchPlan plan;               // this rank's microbatches, indices into `records`
  double global_units = 0;           // units of the global batch's records that fit alone
  StepResult result;
  bool oom = false;
  std::vector<double> oom_dims;      // the microbatch that ran out of memory (empty: outside one)
  double step_peak_bytes = 0;
};

namespace {

// The step status every rank contributes to collective 1, summed over ranks: each rank writes
// only its own slots, so the sum is every rank's value in its slot.
struct StepStatus {
  double loss = 0;
  double skipped_records = 0;
  std::vector<double> oom_per_rank;           // [world]: 1 where the rank ran out of memory
  std::vector<double> microbatches_per_rank;  // [world]
  std::vector<double> oom_dims_per_rank;      // [world x dims]: its OOM microbatch's dims, 0 where none
  double stop_requests = 0;                   // ranks whose stop flag was set

  StepStatus(std::size_t world, std::size_t dims)
      : oom_per_rank(world, 0), microbatches_per_rank(world, 0), oom_dims_per_rank(world * dims, 0) {}

  std::vector<double> pack() const {
    std::vector<double> flat = {loss, skipped_records, stop_requests};
    for (const auto* part : {&oom_per_rank, &microbatches_per_rank, &oom_dims_per_rank}) {
      flat.insert(flat.end(), part->begin(), part->end());
    }
    return flat;
  }

  static StepStatus unpack(const std::vector<double>& flat, std::size_t world, std::size_t dims) {
    StepStatus status(world, dims);
    status.loss = flat.at(0);
    status.skipped_records = flat.at(1);
    status.stop_requests = flat.at(2);
    auto next = flat.begin() + 3;
    for (auto* part : {&status.oom_per_rank, &status.microbatches_per_rank, &status.oom_dims_per_rank}) {
      std::copy(next, next + static_cast<std::ptrdiff_t>(part->size()), part->begin());
      next += static_cast<std::ptrdiff_t>(part->size());
    }
    return status;
  }

  // Rank r's OOM microbatch dims; empty when all zero (the error came outside a microbatch).
  std::vector<double> oom_dims_of(std::size_t rank, std::size_t dims) const {
    const auto first = oom_dims_per_rank.begin() + static_cast<std::ptrdiff_t>(rank * dims);
    std::vector<double> out(first, first + static_cast<std::ptrdiff_t>(dims));
    if (std::all_of(out.begin(), out.end(), [](double d) { return d == 0; })) out.clear();
    return out;
  }
};

}  // namespace

GlobalStepResult DataParallelTrainer::train_step(const std::vector<std::vector<double>>& record_dims,
                                                 const std::vector<double>& record_units,
                                                 const MicrobatchLossFn& loss_sum_fn,
                                                 const BeforeOptimizerStepFn& before_optimizer_step) {
  if (record_dims.size() != record_units.size()) {
    throw std::invalid_argument("DataParallelTrainer: " + std::to_string(record_dims.size()) +
                                " record dims but " + std::to_string(record_units.size()) + " record units");
  }
  const auto start = std::chrono::steady_clock::now();
  GlobalStepResult result;
  LocalShare share;
  split_among_ranks(record_dims, record_units, share, result);
  run_local_share(share, [&](const std::vector<std::size_t>& local_records) {
    std::vector<std::size_t> global_records;
    for (std::size_t j : local_records) global_records.push_back(share.records[j]);
    return loss_sum_fn(global_records);
  });
  exchange_status(share, result);
  exchange_peaks(share, result);
  const double optimizer_step_peak_bytes = apply_gradients(share.global_units, before_optimizer_step, result);
  const double optimizer_step_peak_reserved_bytes =
      meter_ != nullptr && meter_->reserves_segments() && !result.oom
          ? static_cast<double>(meter_->peak_reserved_bytes()) : 0.0;
  // Collective 4: the peaks over ranks.
  const std::vector<double> peaks = context_.all_reduce(
      {share.step_peak_bytes, optimizer_step_peak_bytes, optimizer_step_peak_reserved_bytes}, ReduceOp::kMax);
  result.peak_allocated_bytes = static_cast<std::int64_t>(std::max(peaks[0], peaks[1]));
  result.optimizer_step_peak_bytes = peaks[1];
  result.optimizer_step_peak_reserved_bytes = peaks[2];
  result.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

void DataParallelTrainer::split_among_ranks(const std::vector<std::vector<double>>& record_dims,
                                            const std::vector<double>& record_units, LocalShare& share,
                                            GlobalStepResult& result) const {
  // Every rank computes the same split and counts the units of the records that fit alone (as
  // the packer decides).
  const MemoryModel& model = batcher_.model();
  const double usable_bytes = static_cast<double>(batcher_.planning_bytes());
  for (std::size_t i = 0; i < record_dims.size(); ++i) {
    if (model.fits(record_dims[i], usable_bytes)) share.global_units += record_units[i];
  }
  // The step's plan, the policy the Python sampler follows too (step_plan.hpp); this rank's
  // microbatches renumbered into its share.
  StepPlanOptions options;
  options.world_size = context_.world_size();
  options.only_rank = context_.rank();
  StepPlan step = plan_step(record_dims, model, *batcher_.shared_packer(), batcher_.planning_bytes(), options);
  const RankAssignment& assignment = step.assignment;
  share.records = assignment.records_per_rank[static_cast<std::size_t>(context_.rank())];
  std::vector<std::size_t> position_in_share(record_dims.size(), 0);
  for (std::size_t k = 0; k < share.records.size(); ++k) {
    position_in_share[share.records[k]] = k;
    share.dims.push_back(record_dims[share.records[k]]);
    share.units.push_back(record_units[share.records[k]]);
  }
  share.plan = std::move(step.rank_plans[static_cast<std::size_t>(context_.rank())]);
  for (Microbatch& microbatch : share.plan.microbatches) {
    for (std::size_t& index : microbatch.record_indices) index = position_in_share[index];
  }
  for (std::size_t& index : share.plan.over_budget_records) index = position_in_share[index];
  for (const auto& records : assignment.records_per_rank) {
    result.records_per_rank.push_back(static_cast<std::int64_t>(records.size()));
  }
  result.predicted_cost_per_rank = assignment.cost_per_rank;
  result.imbalance = assignment.imbalance();
}

void DataParallelTrainer::run_local_share(LocalShare& share, const MicrobatchLossFn& loss_sum_fn) {
  // Plan this rank's records and accumulate with the global units as the denominator.
  if (meter_ != nullptr) meter_->reset_peak();
  zero_grad();
  try {
    share.result = local_.accumulate_gradients(
        share.plan, share.units,
        [&](const std::vector<std::size_t>& local_records) {
          const torch::Tensor loss_sum = loss_sum_fn(local_records);
          return loss_scaler_ != nullptr ? loss_scaler_->scale(loss_sum) : loss_sum;
        },
        share.global_units);
    if (loss_scaler_ != nullptr) share.result.loss /= loss_scaler_->current_scale();  // report the true loss
  } catch (const c10::OutOfMemoryError&) {
    share.oom = true;
    share.oom_dims = local_.last_oom_microbatch_dims();
    share.result = StepResult{};
  }
  share.step_peak_bytes = meter_ != nullptr ? static_cast<double>(meter_->peak_allocated_bytes()) : 0;
  for (const MicrobatchPeak& peak : share.result.microbatch_peaks) {
    share.step_peak_bytes = std::max(share.step_peak_bytes, peak.forward_backward_peak_bytes);
  }
}

void DataParallelTrainer::exchange_status(const LocalShare& share, GlobalStepResult& result) {
  const std::size_t world = static_cast<std::size_t>(context_.world_size()), rank = static_cast<std::size_t>(context_.rank());
  const std::size_t dims = batcher_.model().formula().variable_names().size();
  StepStatus mine(world, dims);
  mine.loss = share.result.loss;
  mine.skipped_records = static_cast<double>(share.result.skipped_records);
  mine.oom_per_rank[rank] = share.oom ? 1 : 0;
  mine.microbatches_per_rank[rank] = static_cast<double>(share.result.microbatches);
  if (share.oom_dims.size() == dims) {
    std::copy(share.oom_dims.begin(), share.oom_dims.end(), mine.oom_dims_per_rank.begin() + static_cast<std::ptrdiff_t>(rank * dims));
  }
  mine.stop_requests = stop_flag_ != nullptr && stop_flag_->load() ? 1 : 0;
  const StepStatus all = StepStatus::unpack(context_.all_reduce(mine.pack(), ReduceOp::kSum), world, dims);
  result.stop_requested = all.stop_requests > 0;
  result.loss = all.loss;
  result.skipped_records = static_cast<std::int64_t>(all.skipped_records);
  for (std::size_t r = 0; r < world; ++r) {
    if (all.oom_per_rank[r] > 0) {
      result.oom_ranks.push_back(static_cast<int>(r));
      result.oom_microbatch_dims.push_back(all.oom_dims_of(r, dims));
    }
    const auto count = static_cast<std::int64_t>(all.microbatches_per_rank[r]);
    result.microbatches_per_rank.push_back(count);
    result.microbatches += count;
  }
  result.oom = !result.oom_ranks.empty();
}

void DataParallelTrainer::exchange_peaks(const LocalShare& share, GlobalStepResult& result) {
  // Every rank's microbatch peaks, [rank][slot][dims..., predicted, measured, measured reserved],
  // slots sized by the largest microbatch count of collective 1 (the same on every rank).
  const auto& counts = result.microbatches_per_rank;
  const std::int64_t max_microbatches = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  if (meter_ == nullptr || max_microbatches == 0) return;
  const std::size_t world = static_cast<std::size_t>(context_.world_size()), rank = static_cast<std::size_t>(context_.rank());
  const std::size_t dims = batcher_.model().formula().variable_names().size(), fields = dims + 3;
  const auto slots = static_cast<std::size_t>(max_microbatches);
  std::vector<double> peaks(world * slots * fields, 0.0);
  for (std::size_t j = 0; j < share.result.microbatch_peaks.size() && j < slots; ++j) {
    double* out = &peaks[(rank * slots + j) * fields];
    const MicrobatchPeak& peak = share.result.microbatch_peaks[j];
    std::copy(peak.dims.begin(), peak.dims.end(), out);
    out[dims] = peak.predicted_bytes;
    out[dims + 1] = peak.forward_backward_peak_bytes;
    out[dims + 2] = peak.forward_backward_peak_reserved_bytes;
  }
  peaks = context_.all_reduce(peaks, ReduceOp::kSum);
  for (std::size_t r = 0; r < world; ++r) {
    for (std::int64_t j = 0; j < counts[r]; ++j) {
      const double* in = &peaks[(r * slots + static_cast<std::size_t>(j)) * fields];
      if (in[dims + 1] <= 0) continue;  // that rank ran out of memory before measuring it
      MicrobatchPeak peak;
      peak.dims.assign(in, in + dims);
      peak.predicted_bytes = in[dims];
      peak.forward_backward_peak_bytes = in[dims + 1];
      peak.forward_backward_peak_reserved_bytes = in[dims + 2];
      result.max_predicted_bytes = std::max(result.max_predicted_bytes, peak.predicted_bytes);
      result.microbatch_peaks.push_back(std::move(peak));
      result.microbatch_peak_ranks.push_back(static_cast<int>(r));
    }
  }
}

double DataParallelTrainer::apply_gradients(double global_units, const BeforeOptimizerStepFn& before_optimizer_step,
                                            GlobalStepResult& result) {
  // The gradients and the optimizer step, or a step skipped on every rank.
  if (result.oom) {
    zero_grad();
    result.loss = 0;
    return 0;
  }
  if (meter_ != nullptr) start_peak(*meter_);  // the optimizer's state in segments of its own
  if (sharded_ != nullptr) {
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
  } else {
    if (buckets_ != nullptr) buckets_->all_reduce_sum(context_);
    if (result.microbatches > 0 && !unscale_gradients(gradients_of(optimizer_), context_, result)) {
      if (before_optimizer_step) before_optimizer_step();
      optimizer_.step();
    }
  }
  result.units = result.loss_scale_overflow ? 0 : global_units;
  return meter_ != nullptr ? static_cast<double>(meter_->peak_allocated_bytes()) : 0;
}

}  // namespace xpm
