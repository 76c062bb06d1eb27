// xpm/planner_torch/step_probing.hpp — one call that probes a user's LibTorch training step at
// a few shapes and fits its memory model: the steady state (gradients and optimizer state
// allocated), learning rate 0 during the probes, the optimizer, the learning rates and the CPU
// random generator restored afterwards, LibTorch's autograd buffers drained after an
// out-of-memory probe, the memory-model cache, and rank-0 probing shared with every rank.
//
//   xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();  // before the model is built
//   torch::nn::GRU gru(...);  torch::optim::Adam optimizer(gru->parameters(), 1e-3);
//   meter.set_capacity_bytes(200'000'000);                         // the cap to plan under
//   xpm::StepProbeOptions options;
//   options.batcher.formula = xpm::CostFormula::with_variables("a*bs*l + b*bs + c", {"bs", "l"});
//   options.batcher.variable_max = {{"bs", 64}, {"l", 300}};       // the automatic design's range
//   xpm::StepProbeResult probed = xpm::probe_and_fit(*gru, optimizer,
//       [&](const std::vector<double>& dims) {                    // dims in variable order
//         return loss_sum_of_random_batch(dims[0], dims[1]);       // forward + summed loss
//       }, options);                                               // budget: the meter's capacity
//   xpm::PredictiveBatcher& batcher = *probed.batcher;              // the model set: plan every outer batch
//
// What a probe runs: gradients zeroed in place, `loss_fn(dims)` then backward() of its result
// (forward/backward peak), optimizer.step() at learning rate 0 (optimizer-step peak), each
// phase's peak allocated bytes read from the meter. `loss_fn` builds its own batch at `dims`
// (synthetic data is fine: memory depends on shapes, not values) and returns a scalar tensor.
//
// Ranks: every rank calls probe_and_fit with the same options. Rank 0 (options.rank) looks the
// model up in the cache or probes and fits; with options.share_from_rank0 set, its result (or
// its error) reaches every rank, which all return the same model or throw the same message.
// Call before wrapping the model for data parallelism: a probe's backward must not start a
// gradient all-reduce that the other ranks do not join.
//
// Requirements: the optimizer's update must scale with its learning rate (every torch::optim
// optimizer but LBFGS): the parameters are unchanged by the probes. Call it between optimizer
// steps: the gradients are left allocated and zero. Gradients stay allocated during the probes
// whatever zero_grad() does in the LibTorch version (it frees them from 2.0 on): the probes
// zero them in place themselves.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/planner/option_setters.hpp"
#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner/probe.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"

namespace xpm {

/// Forward and summed loss of a microbatch built at `dims` (the formula's variable order).
using ProbeLossFn = std::function<torch::Tensor(const std::vector<double>& dims)>;
/// Forward and summed loss of a microbatch of exactly these records (dims per record, the
/// formula's variable order, batch-size column 1; each record its own length).
using ProbeRecordsLossFn = std::function<torch::Tensor(const std::vector<std::vector<double>>& records)>;

struct StepProbeOptions {
  /// Formula, budget, probe points or automatic design, fit options (predictive_batcher.hpp).
  /// A budget.capacity_bytes of 0 is the meter's capacity (meter_budget): give it once.
  PredictiveBatcherOptions batcher;
  /// With batcher.record_dims_sample (required then): the loss of a mix of the sample's
  /// records, what the design probes instead of loss_fn at aggregated dims.
  ProbeRecordsLossFn records_loss_fn;
  /// The meter the peaks are read from; null: CpuMemoryMeter::instance() (installed first).
  MemoryMeter* meter = nullptr;
  /// Folder of the memory-model cache (memory_model_cache.hpp); empty: no cache.
  std::string memory_model_cache;
  /// What else the memory depends on (precision, device, ...): joins the cache key, which
  /// already holds the formula, the budget, the probe design, the parameters' names, shapes and
  /// dtypes, the optimizer's type and the LibTorch version.
  nlohmann::json identity;
  /// This process's rank; only rank 0 probes.
  int rank = 0;
  /// World size above 1: sends rank 0's payload to every rank and returns it (rank 0 passes
  /// its payload, the others pass ""); a broadcast of the user's collectives or c10d store.
  std::function<std::string(const std::string& payload)> share_from_rank0;
  /// Progress lines (rank 0); empty: silent.
  std::function<void(const std::string& line)> log;
  /// The packer of the result's batcher (make_packer, packer_kind.hpp) and its sort variables.
  PackerKind packer = PackerKind::kAdaptive;
  std::string sort_by;

  XPM_OPTION_SETTER(StepProbeOptions, PredictiveBatcherOptions, batcher)
  XPM_OPTION_SETTER(StepProbeOptions, ProbeRecordsLossFn, records_loss_fn)
  XPM_OPTION_SETTER(StepProbeOptions, MemoryMeter*, meter)
  XPM_OPTION_SETTER(StepProbeOptions, std::string, memory_model_cache)
  XPM_OPTION_SETTER(StepProbeOptions, nlohmann::json, identity)
  XPM_OPTION_SETTER(StepProbeOptions, int, rank)
  XPM_OPTION_SETTER(StepProbeOptions, std::function<std::string(const std::string&)>, share_from_rank0)
  XPM_OPTION_SETTER(StepProbeOptions, std::function<void(const std::string&)>, log)
  XPM_OPTION_SETTER(StepProbeOptions, PackerKind, packer)
  XPM_OPTION_SETTER(StepProbeOptions, std::string, sort_by)

  /// Throws std::invalid_argument naming the option: batcher's own (PredictiveBatcherOptions::
  /// validate; a budget capacity of 0 stands for the meter's and is not refused), a rank other
  /// than 0 without share_from_rank0, batcher.record_dims_sample without records_loss_fn, a
  /// sort_by for a packer that takes none. probe_and_fit calls it first.
  void validate() const;
};

struct StepProbeResult {
  MemoryModel model;                // the fitted (or cached) model; the same on every rank
  std::vector<ProbeResult> probes;  // rank 0's probes, infeasible ones included; empty from the cache
  bool from_cache = false;
  double probe_s = 0;               // rank 0's probing wall time (s); 0 from the cache
  PredictiveBatcherOptions batcher_options;  // options.batcher with the capacity resolved
  /// Ready to plan: batcher_options, options.packer, the model set.
  std::shared_ptr<PredictiveBatcher> batcher;
};

/// Probes `module` trained by `optimizer` (see the header comment) and fits the model.
/// Throws on every rank: std::invalid_argument for bad options (a capacity of 0 with an
/// uncapped meter among them) or a budget the probes cannot
/// work under (PredictiveBatcher::probe_and_fit), std::runtime_error for an unusable fit or
/// an error of `loss_fn` (the message names the probe: "probing at bs=8 l=64: ...").
StepProbeResult probe_and_fit(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                              const ProbeLossFn& loss_fn, const StepProbeOptions& options);

/// The probe steps probe_and_fit runs, for a caller who drives PredictiveBatcher::probe_and_fit
/// itself: zero_grad zeroes the gradients in place (allocating the missing ones),
/// forward_backward runs loss_fn(dims).backward() and drains the autograd buffers after an
/// out-of-memory error, optimizer_step calls optimizer.step(). Set the learning rates to 0
/// first (ProbeStateGuard does).
/// With records_loss_fn, forward_backward_records runs records_loss_fn(records).backward() the
/// same way.
TorchProbeSteps probe_steps_for(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                ProbeLossFn loss_fn, MemoryMeter& meter,
                                ProbeRecordsLossFn records_loss_fn = {});

/// Brings `module` and `optimizer` into the steady state of training (every trainable
/// parameter's gradient allocated, zero; the optimizer's state allocated by a step at
/// learning rate 0) and, on destruction, restores the optimizer's state as it was (an empty
/// state stays empty), its learning rates and the CPU random generator.
class ProbeStateGuard {
 public:
  ProbeStateGuard(torch::nn::Module& module, torch::optim::Optimizer& optimizer);
  ~ProbeStateGuard();
  ProbeStateGuard(const ProbeStateGuard&) = delete;
  ProbeStateGuard& operator=(const ProbeStateGuard&) = delete;

 private:
  void restore();

  torch::nn::Module& module_;
  torch::optim::Optimizer& optimizer_;
  std::vector<double> learning_rates_;
  bool had_state_ = false;
  std::string state_archive_;
  at::Generator generator_;
  at::Tensor generator_state_;
};

/// A model signature for cache keys: each parameter's name, shape and dtype.
nlohmann::json parameter_signature(torch::nn::Module& module);

}  // namespace xpm
