// probe_and_fit over a user's module and optimizer: steady state, restored state, cache,
// rank-0 probing shared with every rank.
#include "xpm/planner_torch/step_probing.hpp"

#include <exception>
#include <functional>
#include <optional>
#include <sstream>
#include <limits>
#include <stdexcept>
#include <typeinfo>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include "xpm/planner/dims_text.hpp"
#include "xpm/planner/memory_model_lookup.hpp"
#include "xpm/planner/stable_hash.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"

namespace xpm {
namespace {

void zero_gradients_in_place(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (torch::Tensor& parameter : module.parameters()) {
    if (!parameter.requires_grad()) continue;  // frozen: no gradient, no optimizer state
    if (parameter.grad().defined()) {
      parameter.mutable_grad().zero_();
    } else {
      parameter.mutable_grad() = torch::zeros_like(parameter);
    }
  }
}

// LibTorch keeps the gradients of a backward() that ran out of memory (those computed but not
// yet consumed) until the next backward() on the same thread; a tiny backward, with the CPU
// cap lifted for its few bytes, releases them, so the next probe measures only itself.
void drain_autograd_buffers(MemoryMeter& meter) {
  auto* cpu_meter = dynamic_cast<CpuMemoryMeter*>(&meter);
  const std::int64_t capacity_bytes = cpu_meter != nullptr ? cpu_meter->capacity_bytes() : 0;
  if (cpu_meter != nullptr) cpu_meter->set_capacity_bytes(0);
  try {
    torch::zeros({1}, torch::requires_grad()).sum().backward();
  } catch (...) {
    if (cpu_meter != nullptr) cpu_meter->set_capacity_bytes(capacity_bytes);
    throw;
  }
  if (cpu_meter != nullptr) cpu_meter->set_capacity_bytes(capacity_bytes);
}

// backward() of the loss `forward` returns (a scalar); after an out-of-memory error the
// autograd buffers are drained before it propagates.
void backward_draining_on_oom(const std::function<torch::Tensor()>& forward, MemoryMeter& meter) {
  try {
    torch::Tensor loss = forward();
    if (!loss.defined() || loss.numel() != 1) {
      throw std::invalid_argument("the loss function must return a scalar tensor");
    }
    if (!torch::isfinite(loss.detach()).all().item<bool>()) {
      // 0 x NaN is NaN: its gradients would change the parameters at learning rate 0.
      throw std::invalid_argument("the loss is not finite (" + std::to_string(loss.detach().item<double>()) +
                                  "): its gradients would turn the parameters into NaN at the probes' "
                                  "optimizer steps, learning rate 0 or not");
    }
    loss.backward();
  } catch (const c10::OutOfMemoryError&) {
    drain_autograd_buffers(meter);
    throw;
  }
}

// TorchProbeExecutor whose errors (other than out of memory) name the probe's dims.
class NamedProbeExecutor : public ProbeExecutor {
 public:
  NamedProbeExecutor(TorchProbeSteps steps, MemoryMeter& meter, std::vector<std::string> names)
      : executor_(std::move(steps), meter), names_(std::move(names)) {}
  ProbeResult run_probe(const std::vector<double>& dims) override {
    try {
      return executor_.run_probe(dims);
    } catch (const std::invalid_argument& error) {
      throw std::invalid_argument("probing at " + dims_text(names_, dims) + ": " + error.what());
    } catch (const c10::Error& error) {
      throw std::runtime_error("probing at " + dims_text(names_, dims) + ": " +
                               error.what_without_backtrace());
    } catch (const std::exception& error) {
      throw std::runtime_error("probing at " + dims_text(names_, dims) + ": " + error.what());
    }
  }
  ProbeResult run_probe_records(const std::vector<std::vector<double>>& records) override {
    const std::string where = "probing a mix of " + std::to_string(records.size()) + " records: ";
    try {
      return executor_.run_probe_records(records);
    } catch (const std::invalid_argument& error) {
      throw std::invalid_argument(where + error.what());
    } catch (const c10::Error& error) {
      throw std::runtime_error(where + error.what_without_backtrace());
    }
  }
  double static_bytes() override { return executor_.static_bytes(); }

 private:
  TorchProbeExecutor executor_;
  std::vector<std::string> names_;
};

nlohmann::json cache_identity(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                              const StepProbeOptions& options) {
  const PredictiveBatcherOptions& b = options.batcher;
  const CostFormula& formula = b.formula;
  nlohmann::json probe_points = nlohmann::json::array();
  for (const ProbePoint& point : b.probe_points) probe_points.push_back(point.values);
  return {{"xpm_memory_model_format", 1},
          {"formula", formula.canonical()},
          {"variable_names", formula.variable_names()},
          {"model_signature", parameter_signature(module)},
          {"optimizer", c10::demangle(typeid(optimizer).name())},
          {"torch_version", TORCH_VERSION},
          {"capacity_bytes", b.budget.capacity_bytes},
          {"memory_fraction", b.budget.memory_fraction},
          {"extra_overhead_bytes", b.budget.extra_overhead_bytes},
          {"probe_points", probe_points},
          {"variable_max", b.variable_max},
          {"design_fractions", b.design_fractions},
          {"record_dims_sample", stable_hash_hex(nlohmann::json(b.record_dims_sample).dump())},
          {"formula_choice", to_string(b.formula_choice)},
          {"adaptive_design", {{"max_probes", b.adaptive.max_probes},
                               {"tolerance", b.adaptive.tolerance},
                               {"grid_steps", b.adaptive.grid_steps}}},
          {"user", options.identity}};
}

// A CPU meter installed after the model was built never saw the weights: the floor would miss
// them and every prediction would be short by their bytes.
void check_meter_sees_weights(torch::nn::Module& module, const MemoryMeter& meter) {
  if (dynamic_cast<const CpuMemoryMeter*>(&meter) == nullptr) return;
  std::int64_t weight_bytes = 0;
  for (const torch::Tensor& p : module.parameters()) {
    if (p.device().is_cpu()) weight_bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
  }
  const std::int64_t counted = meter.current_allocated_bytes();
  if (counted < weight_bytes) {
    throw std::invalid_argument(
        "probe_and_fit: the CPU meter counts " + std::to_string(counted) + " bytes allocated, but the "
        "model's parameters alone take " + std::to_string(weight_bytes) + " bytes: the meter was installed "
        "after the model was built (or the weights live in memory it does not see); call "
        "CpuMemoryMeter::install() before building the model");
  }
}

// Rank 0: the cached model, or probes and a fit (then stored in the cache).
StepProbeResult probe_on_rank0(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                               const ProbeLossFn& loss_fn, const StepProbeOptions& options) {
  MemoryMeter& meter = options.meter != nullptr ? *options.meter : CpuMemoryMeter::instance();
  ModelLookup lookup;
  lookup.cache_dir = options.memory_model_cache;
  lookup.identity = cache_identity(module, optimizer, options);
  lookup.metadata = {{"model_signature", lookup.identity.at("model_signature")},
                     {"optimizer", lookup.identity.at("optimizer")},
                     {"torch_version", TORCH_VERSION}};
  lookup.log = options.log;
  PredictiveBatcher batcher(options.batcher, std::make_shared<AdaptivePacker>());
  LookedUpModel found = look_up_or_probe(batcher, lookup, [&](PredictiveBatcher& probing) {
    std::optional<ProbeStateGuard> guard;
    try {
      guard.emplace(module, optimizer);
    } catch (const c10::OutOfMemoryError&) {
      throw std::invalid_argument(
          "the steady state (gradients and optimizer state) does not fit under the meter's capacity of " +
          std::to_string(meter.capacity_bytes()) + " bytes: raise the capacity");
    }
    NamedProbeExecutor executor(probe_steps_for(module, optimizer, loss_fn, meter, options.records_loss_fn), meter,
                                options.batcher.formula.variable_names());
    probing.probe_and_fit(executor);
  });
  return {batcher.model(), std::move(found.probes), found.from_cache, found.probe_s, {}, nullptr};
}

// Rank 0 looks up or probes; with share_from_rank0 its result or error reaches every rank.
StepProbeResult share_or_probe(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                               const ProbeLossFn& loss_fn, const StepProbeOptions& options) {
  if (!loss_fn) throw std::invalid_argument("probe_and_fit: loss_fn is empty");
  if (!options.share_from_rank0) return probe_on_rank0(module, optimizer, loss_fn, options);
  std::optional<StepProbeResult> result;
  nlohmann::json shared;
  std::exception_ptr failure;  // rank 0 rethrows its own exception as it is
  if (options.rank == 0) {
    try {
      result = probe_on_rank0(module, optimizer, loss_fn, options);
      shared = {{"model", result->model.to_json()}, {"from_cache", result->from_cache},
                {"probe_s", result->probe_s}};
    } catch (const std::invalid_argument& error) {
      failure = std::current_exception();
      shared = {{"error", error.what()}, {"invalid_argument", true}};
    } catch (const std::exception& error) {
      failure = std::current_exception();
      shared = {{"error", error.what()}, {"invalid_argument", false}};
    }
  }
  shared = nlohmann::json::parse(options.share_from_rank0(options.rank == 0 ? shared.dump() : ""));
  if (failure) std::rethrow_exception(failure);
  if (shared.contains("error")) {
    const std::string line = "rank 0: " + shared.at("error").get<std::string>();
    if (shared.at("invalid_argument").get<bool>()) throw std::invalid_argument(line);
    throw std::runtime_error(line);
  }
  if (result) return std::move(*result);
  return {MemoryModel::from_json(shared.at("model")), {}, shared.at("from_cache").get<bool>(),
          shared.at("probe_s").get<double>(), {}, nullptr};
}

}  // namespace

nlohmann::json parameter_signature(torch::nn::Module& module) {
  nlohmann::json parameters = nlohmann::json::array();
  for (const auto& item : module.named_parameters()) {
    parameters.push_back({{"name", item.key()},
                          {"shape", item.value().sizes().vec()},
                          {"dtype", std::string(c10::toString(item.value().scalar_type()))},
                          {"requires_grad", item.value().requires_grad()}});
  }
  return parameters;
}

ProbeStateGuard::ProbeStateGuard(torch::nn::Module& module, torch::optim::Optimizer& optimizer)
    : module_(module), optimizer_(optimizer), generator_(at::detail::getDefaultCPUGenerator()) {
  {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_state_ = generator_.get_state();
  }
  had_state_ = !optimizer_.state().empty();
  if (had_state_) {
    torch::serialize::OutputArchive archive;
    optimizer_.save(archive);
    std::ostringstream stream;
    archive.save_to(stream);
    state_archive_ = stream.str();
  }
  for (auto& group : optimizer_.param_groups()) learning_rates_.push_back(group.options().get_lr());
  try {
    for (auto& group : optimizer_.param_groups()) group.options().set_lr(0.0);
    zero_gradients_in_place(module_);
    optimizer_.step();  // allocates the optimizer state; learning rate 0 keeps the parameters
    zero_gradients_in_place(module_);
  } catch (...) {
    restore();  // the caller's optimizer as it was, then the error
    throw;
  }
}

ProbeStateGuard::~ProbeStateGuard() {
  try {
    restore();
  } catch (...) {
    // A destructor must not throw; the restore reads back what this process wrote moments ago.
  }
}

void ProbeStateGuard::restore() {
  if (had_state_) {
    torch::serialize::InputArchive archive;
    std::istringstream stream(state_archive_);
    archive.load_from(stream);
    optimizer_.load(archive);
  } else {
    optimizer_.state().clear();
  }
  std::size_t i = 0;
  for (auto& group : optimizer_.param_groups()) group.options().set_lr(learning_rates_.at(i++));
  zero_gradients_in_place(module_);
  std::lock_guard<std::mutex> lock(generator_.mutex());
  generator_.set_state(generator_state_);
}

TorchProbeSteps probe_steps_for(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                ProbeLossFn loss_fn, MemoryMeter& meter, ProbeRecordsLossFn records_loss_fn) {
  if (!loss_fn) throw std::invalid_argument("probe_steps_for: loss_fn is empty");
  TorchProbeSteps steps;
  steps.forward_backward = [loss_fn = std::move(loss_fn), &meter](const std::vector<double>& dims) {
    backward_draining_on_oom([&] { return loss_fn(dims); }, meter);
  };
  if (records_loss_fn) {
    steps.forward_backward_records = [records_loss_fn = std::move(records_loss_fn),
                                      &meter](const std::vector<std::vector<double>>& records) {
      backward_draining_on_oom([&] { return records_loss_fn(records); }, meter);
    };
  }
  steps.optimizer_step = [&optimizer] { optimizer.step(); };
  steps.zero_grad = [&module] { zero_gradients_in_place(module); };
  return steps;
}

void StepProbeOptions::validate() const {
  PredictiveBatcherOptions checked = batcher;
  if (checked.budget.capacity_bytes == 0) {  // the meter's, known in probe_and_fit: any capacity here
    checked.budget.capacity_bytes = std::numeric_limits<std::int64_t>::max() / 2;
  }
  checked.validate();
  if (!batcher.record_dims_sample.empty() && !records_loss_fn) {
    throw std::invalid_argument("probe_and_fit: batcher.record_dims_sample is given but records_loss_fn is empty: "
                                "the design probes mixes of those records through it");
  }
  if (!share_from_rank0 && rank != 0) {
    throw std::invalid_argument("probe_and_fit: rank " + std::to_string(rank) +
                                " without share_from_rank0 (only rank 0 probes)");
  }
  if (!sort_by.empty() && !packer_takes_sort_by(packer)) {
    throw std::invalid_argument("sort_by '" + sort_by + "' applies to the adaptive packer only, not '" +
                                to_string(packer) + "'");
  }
}

StepProbeResult probe_and_fit(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                              const ProbeLossFn& loss_fn, const StepProbeOptions& given) {
  given.validate();
  StepProbeOptions options = given;
  MemoryBudget& budget = options.batcher.budget;
  if (budget.capacity_bytes == 0) {
    MemoryMeter& meter = options.meter != nullptr ? *options.meter : CpuMemoryMeter::instance();
    budget = meter_budget(meter, budget.memory_fraction, budget.extra_overhead_bytes);
  }
  options.batcher.validate();
  const std::shared_ptr<const MicrobatchPacker> packer = make_packer(options.packer, options.sort_by);
  check_meter_sees_weights(module, options.meter != nullptr ? *options.meter : CpuMemoryMeter::instance());
  StepProbeResult result = share_or_probe(module, optimizer, loss_fn, options);
  result.batcher_options = options.batcher;
  result.batcher = std::make_shared<PredictiveBatcher>(result.batcher_options, packer);
  result.batcher->set_model(result.model);
  return result;
}

}  // namespace xpm
