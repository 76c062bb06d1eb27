// step_plan.cpp — an outer batch shared among the ranks and packed (step_plan.hpp).
#include "xpm/planner/step_plan.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace xpm {
namespace {

// The share's records (indices into the outer batch) packed; the plan's indices mapped back.
MicrobatchPlan pack_share(const std::vector<std::vector<double>>& record_dims, const std::vector<std::size_t>& share,
                          const MemoryModel& model, const MicrobatchPacker& packer, std::int64_t planning_bytes) {
  if (share.empty()) return {};
  std::vector<std::vector<double>> dims;
  dims.reserve(share.size());
  for (std::size_t i : share) dims.push_back(record_dims[i]);
  MicrobatchPlan plan = packer.pack(dims, model, planning_bytes);
  for (Microbatch& microbatch : plan.microbatches) {
    for (std::size_t& index : microbatch.record_indices) index = share[index];
  }
  for (std::size_t& index : plan.over_budget_records) index = share[index];
  return plan;
}

Microbatch whole_microbatch(const std::vector<std::vector<double>>& record_dims, std::vector<std::size_t> records,
                            const MemoryModel& model) {
  Microbatch microbatch;
  microbatch.dims = records.empty() ? std::vector<double>(model.formula().variable_names().size(), 0.0)
                                    : aggregate_dims(record_dims, records, model);
  microbatch.predicted_bytes = model.predict_bytes(microbatch.dims);
  microbatch.record_indices = std::move(records);
  return microbatch;
}

// `plan` split to `target` microbatches (step_plan.hpp: halving, then empty microbatches).
void split_to(std::size_t target, MicrobatchPlan& plan, const std::vector<std::vector<double>>& record_dims,
              const MemoryModel& model) {
  std::vector<Microbatch>& microbatches = plan.microbatches;
  while (microbatches.size() < target) {
    std::size_t k = 0;
    for (std::size_t i = 1; i < microbatches.size(); ++i) {
      if (microbatches[i].record_indices.size() > microbatches[k].record_indices.size()) k = i;
    }
    if (microbatches.empty() || microbatches[k].record_indices.size() < 2) {
      microbatches.push_back(whole_microbatch(record_dims, {}, model));
      continue;
    }
    const std::vector<std::size_t>& records = microbatches[k].record_indices;
    const auto middle = records.begin() + static_cast<std::ptrdiff_t>((records.size() + 1) / 2);
    Microbatch first = whole_microbatch(record_dims, {records.begin(), middle}, model);
    Microbatch second = whole_microbatch(record_dims, {middle, records.end()}, model);
    microbatches[k] = std::move(first);
    microbatches.insert(microbatches.begin() + static_cast<std::ptrdiff_t>(k) + 1, std::move(second));
  }
}

// `steady_bytes` lowered to `phase`'s prediction at `dims` where it has a fit, or by what it
// lowers `fitted_with`'s (StepPhaseModels).
double phase_prediction(double steady_bytes, const std::vector<double>& dims, const MemoryModel* phase,
                        const MemoryModel* fitted_with) {
  if (phase == nullptr) return steady_bytes;
  if (fitted_with == nullptr) return std::min(steady_bytes, phase->predict_bytes(dims));
  const double lowered_bytes = std::max(0.0, fitted_with->predict_bytes(dims) - phase->predict_bytes(dims));
  return std::max(0.0, steady_bytes - lowered_bytes);
}

// `plan`'s first and last microbatches with records predicted in their phases (step_plan.hpp).
void predict_phases(MicrobatchPlan& plan, const StepPhaseModels& phases) {
  std::vector<Microbatch>& microbatches = plan.microbatches;
  if (microbatches.empty()) return;
  if (microbatches.size() == 1) {
    Microbatch& alone = microbatches.front();
    if (!alone.record_indices.empty())
      alone.predicted_bytes = phase_predicted_bytes(alone.predicted_bytes, alone.dims, MicrobatchPosition::kAlone, phases);
    return;
  }
  for (auto [microbatch, position] : {std::pair{&microbatches.front(), MicrobatchPosition::kFirst},
                                      std::pair{&microbatches.back(), MicrobatchPosition::kLast}}) {
    if (!microbatch->record_indices.empty())
      microbatch->predicted_bytes = phase_predicted_bytes(microbatch->predicted_bytes, microbatch->dims, position, phases);
  }
}

void check_phase_formulas(const StepPhaseModels& phases, const MemoryModel& model) {
  for (const MemoryModel* phase : {phases.first_of_several, phases.first_alone, phases.synchronised, phases.fitted_with}) {
    if (phase != nullptr && phase->formula().variable_names() != model.formula().variable_names()) {
      throw std::invalid_argument("plan_step: a phase model's formula '" + phase->formula().canonical() +
                                  "' is not over the model's variables ('" + model.formula().canonical() + "')");
    }
  }
}

}  // namespace

StepPhaseModels phases_beside(const MemoryModel& model, StepPhaseModels phases) {
  if (phases.fitted_with == nullptr && model.refit_region() != nullptr)
    phases.fitted_with = model.refit_region()->outside.get();
  return phases;
}

double phase_predicted_bytes(double steady_bytes, const std::vector<double>& dims, MicrobatchPosition position,
                             const StepPhaseModels& phases) {
  switch (position) {
    case MicrobatchPosition::kFirst:
      return phase_prediction(steady_bytes, dims, phases.first_of_several, phases.fitted_with);
    case MicrobatchPosition::kLast: return phase_prediction(steady_bytes, dims, phases.synchronised, phases.fitted_with);
    case MicrobatchPosition::kAlone: {
      const double first = phase_prediction(steady_bytes, dims, phases.first_alone, phases.fitted_with);
      return phases.synchronised == nullptr
                 ? first
                 : std::max(first, phase_prediction(steady_bytes, dims, phases.synchronised, phases.fitted_with));
    }
    case MicrobatchPosition::kMiddle: break;
  }
  return steady_bytes;
}

StepPlan plan_step(const std::vector<std::vector<double>>& record_dims, const MemoryModel& model,
                   const MicrobatchPacker& packer, std::int64_t planning_bytes, const StepPlanOptions& options) {
  if (options.world_size < 1) {
    throw std::invalid_argument("plan_step: world_size must be >= 1, got " + std::to_string(options.world_size));
  }
  if (options.only_rank >= options.world_size) {
    throw std::invalid_argument("plan_step: only_rank " + std::to_string(options.only_rank) +
                                " is not a rank of world_size " + std::to_string(options.world_size));
  }
  if (planning_bytes <= 0) {
    throw std::invalid_argument("plan_step: planning_bytes must be > 0, got " + std::to_string(planning_bytes));
  }
  const StepPhaseModels phases = phases_beside(model, options.phases);
  check_phase_formulas(phases, model);
  const auto world = static_cast<std::int64_t>(options.world_size);
  const std::int64_t share_records =
      std::max<std::int64_t>(1, (static_cast<std::int64_t>(record_dims.size()) + world - 1) / world);
  StepPlan step;
  step.assignment = assign_records_to_ranks(record_costs_bytes(model, record_dims, planning_bytes, share_records),
                                            options.world_size);
  step.rank_plans.resize(static_cast<std::size_t>(options.world_size));
  for (int rank = 0; rank < options.world_size; ++rank) {
    if (!options.lockstep && options.only_rank >= 0 && rank != options.only_rank) continue;
    step.rank_plans[static_cast<std::size_t>(rank)] =
        pack_share(record_dims, step.assignment.records_per_rank[static_cast<std::size_t>(rank)], model, packer,
                   planning_bytes);
  }
  if (options.lockstep) {
    std::size_t target = 1;
    for (const MicrobatchPlan& plan : step.rank_plans) target = std::max(target, plan.microbatches.size());
    for (MicrobatchPlan& plan : step.rank_plans) split_to(target, plan, record_dims, model);
  }
  for (MicrobatchPlan& plan : step.rank_plans) predict_phases(plan, phases);
  return step;
}

}  // namespace xpm
