// xpm/planner/step_plan.hpp — one optimizer step's plan, the same on every rank: the outer
// batch shared among the ranks by predicted cost, each share packed into microbatches under the
// budget, and in lockstep the shares split further to one microbatch count.
//
//   xpm::StepPlanOptions options;
//   options.world_size = 4;
//   options.lockstep = true;  // every rank the same number of microbatches
//   xpm::StepPlan step = xpm::plan_step(outer_batch_dims, model, packer, planning_bytes, options);
//   const xpm::MicrobatchPlan& mine = step.rank_plans[rank];  // indices into the outer batch
//
// The one policy of both trainers: the C++ DataParallelTrainer (and so the Learner) and the
// Python PredictiveBatchSampler call it (tests/planner/step_plans.json is the table both check).
// Shares: assign_records_to_ranks over record_costs_bytes(model, dims, planning_bytes,
// ceil(records / world_size)) (rank_assignment.hpp). Packing: `packer` over each share at
// planning_bytes (a prediction plus its calibration's correction must fit the budget:
// Correction::planning_bytes). Lockstep: while a share has fewer microbatches than the most any
// share packs into, its microbatch of the most records (the first such) is halved in record
// order (the first half one record longer when odd), which fits as the whole did; when every
// microbatch holds one record, empty microbatches (zero dims) are added. An empty share's plan
// has no microbatch (without lockstep). Phases: where `options.phases` holds fits of the gradient
// phases (StepPhaseModels), each rank's first and last microbatch are predicted in the phase they
// run in; the packing is the steady model's, so each phase's prediction fits as the steady one
// did. Pure and deterministic: every rank computes every
// rank's plan alike from the same inputs, without communicating; nothing here communicates.
#pragma once

#include <cstdint>
#include <vector>

#include "xpm/planner/calibration.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/rank_assignment.hpp"

namespace xpm {

/// Fits of the gradient phases a step's microbatches run in (the Python package probes them:
/// docs/python.md), each a model of its own over the same variables (the same formula, or the
/// probes' formula after a TrainingRefit chose another for the steady model); null: that phase is predicted
/// by the steady model ("with gradients", what the probes measure). Not owned. A rank's first
/// microbatch with records, when the step starts without gradients held (zero_grad(set_to_none)),
/// is predicted by min(steady, first_of_several) when the plan has several microbatches (no
/// optimizer step in it: a fit without the floor) or min(steady, first_alone) when it is the only
/// one (with the floor). Its last microbatch with records, when it reduce-scatters the gradients
/// (FSDP2's accumulation), by min(steady, synchronised); a plan of one microbatch by the larger
/// of that and its first-phase prediction.
struct StepPhaseModels {
  const MemoryModel* first_of_several = nullptr;
  const MemoryModel* first_alone = nullptr;
  const MemoryModel* synchronised = nullptr;
  /// The steady model the phases were fitted beside (the probes'), where the steady model is a
  /// TrainingRefit's: a phase then lowers the refit's prediction by what it lowered that
  /// model's, steady - max(0, fitted_with(dims) - phase(dims)), not to min(steady, phase), so
  /// that the refit's correction of a shape reaches its first microbatch too. Null: min();
  /// plan_step takes the model's refit region's outside model (phases_beside).
  const MemoryModel* fitted_with = nullptr;
};

/// `phases` with fitted_with, where null, the model `model` was refitted from (its
/// RefitRegion's outside model; none when it is not a refit).
StepPhaseModels phases_beside(const MemoryModel& model, StepPhaseModels phases);

struct StepPlanOptions {
  int world_size = 1;     // ranks sharing the outer batch, >= 1
  bool lockstep = false;  // every rank's plan the same number of microbatches
  int only_rank = -1;     // >= 0 and no lockstep: that rank's share alone is packed (the others' plans empty)
  StepPhaseModels phases;  // none by default: every microbatch predicted by the steady model
};

struct StepPlan {
  RankAssignment assignment;               // each rank's records (indices into the outer batch)
  std::vector<MicrobatchPlan> rank_plans;  // world_size plans; record indices into the outer batch
};

/// The prediction plan_step gives a microbatch with records at `position` in its rank's plan,
/// from its steady prediction `steady_bytes` (model.predict_bytes(dims)): kFirst by its first
/// phase, kLast by its synchronised one, kAlone by both (StepPhaseModels), kMiddle steady. Bytes.
double phase_predicted_bytes(double steady_bytes, const std::vector<double>& dims, MicrobatchPosition position,
                             const StepPhaseModels& phases);

/// The step's plan of the outer batch `record_dims` (one row per record, the formula's variable
/// order) under `model` and `planning_bytes` (above). Throws std::invalid_argument when
/// world_size < 1, only_rank is out of range, planning_bytes <= 0, or a row's width is not the
/// formula's variable count, or a phase model's formula is not over the model's variables.
StepPlan plan_step(const std::vector<std::vector<double>>& record_dims, const MemoryModel& model,
                   const MicrobatchPacker& packer, std::int64_t planning_bytes, const StepPlanOptions& options);

}  // namespace xpm
