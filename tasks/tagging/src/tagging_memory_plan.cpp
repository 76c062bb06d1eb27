// The tagging job's memory model: batcher options, cache identity, rank-0 probe or lookup.
#include "xpm/tasks/tagging_memory_plan.hpp"

#include <exception>
#include <stdexcept>

#include <torch/torch.h>

#include "xpm/planner/memory_model_lookup.hpp"
#include "xpm/trainer/loop/error_context.hpp"
#include "xpm/tasks/tagging_probe.hpp"

namespace xpm {

PredictiveBatcherOptions tagging_batcher_options(const TaggingJobConfig& config,
                                                 std::size_t max_length, std::int64_t capacity_bytes) {
  PredictiveBatcherOptions options;
  options.formula = CostFormula(config.formula, config.coefficients, config.variables);
  options.batch_size_variable = "bs";
  options.aggregation = {{"l", DimAggregation::kMax}};
  options.probe_points = config.probe_points;
  options.variable_max = {{"bs", static_cast<double>(config.outer_batch_size)},
                          {"l", static_cast<double>(max_length)}};
  options.budget = {capacity_bytes, config.memory_fraction, config.extra_overhead_bytes};
  return options;
}

namespace {

// The kind of device the model was probed on: a memory model of the CPU's meter does not hold
// on a GPU, nor one GPU's caching allocator on the CPU.
std::string device_kind(const TaggingJobConfig& config) {
  return config.device.rfind("cuda", 0) == 0 ? "cuda" : "cpu";
}

}  // namespace

nlohmann::json memory_model_identity(const TaggingJobConfig& config,
                                     const PredictiveBatcherOptions& batcher_options,
                                     const nlohmann::json& model_signature,
                                     std::int64_t capacity_bytes, int world_size) {
  nlohmann::json probe_points = nlohmann::json::array();
  for (const ProbePoint& point : batcher_options.probe_points) probe_points.push_back(point.values);
  const CostFormula& formula = batcher_options.formula;
  return {{"xpm_memory_model_format", 1},
          {"formula", formula.canonical()},
          {"coefficient_names", formula.coefficient_names()},
          {"variable_names", formula.variable_names()},
          {"model_signature", model_signature},
          {"architecture", to_string(config.architecture)},
          {"model", config.architecture == TaggingArchitecture::kBilstm
                        ? nlohmann::json{{"dropout", config.bilstm.dropout}}
                        : nlohmann::json{{"nhead", config.model.nhead},
                                         {"dropout", config.model.dropout},
                                         {"activation_checkpointing", config.model.activation_checkpointing}}},
          {"optimizer", {{"name", "adamw"},
                         {"weight_decay", config.weight_decay},
                         {"groups", config.weight_decay_groups ? "no_decay_bias_norm" : "all"}}},
          {"precision", to_string(config.precision)},
          {"sharding", to_string(config.sharding)},
          {"device", device_kind(config)},
          {"world_size", world_size},
          {"torch_version", TORCH_VERSION},
          {"capacity_bytes", capacity_bytes},
          {"memory_fraction", batcher_options.budget.memory_fraction},
          {"extra_overhead_bytes", batcher_options.budget.extra_overhead_bytes},
          {"probe_points", probe_points},
          {"variable_max", batcher_options.variable_max},
          {"design_fractions", batcher_options.design_fractions},
          {"formula_choice", to_string(batcher_options.formula_choice)},
          {"adaptive_design", {{"max_probes", batcher_options.adaptive.max_probes},
                               {"tolerance", batcher_options.adaptive.tolerance},
                               {"grid_steps", batcher_options.adaptive.grid_steps}}}};
}

namespace {

// Rank 0's part: the cached model, or probes and a fit (the model then stored in the cache).
// Returns what every rank takes: the model and where it came from.
nlohmann::json look_up_or_probe_on_rank0(const TaggingJobConfig& config, TaggingModelSetup& setup,
                                         MemoryMeter& meter, std::int64_t capacity_bytes,
                                         PredictiveBatcher& batcher, int world_size,
                                         const std::function<void(const std::string&)>& log) {
  ModelLookup lookup;
  lookup.cache_dir = config.memory_model_cache;
  lookup.identity = memory_model_identity(config, batcher.options(), setup.signature(), capacity_bytes, world_size);
  lookup.metadata = {{"device", device_kind(config)},
                     {"capacity_bytes", capacity_bytes},
                     {"precision", to_string(config.precision)},
                     {"activation_checkpointing", config.model.activation_checkpointing},
                     {"sharding", to_string(config.sharding)},
                     {"world_size", world_size},
                     {"optimizer", "adamw"},
                     {"torch_version", TORCH_VERSION},
                     {"model_signature", setup.signature()}};
  lookup.needs_time_model = config.packer == PackerKind::kFastest;
  lookup.log_prefix = "xpm-train";
  lookup.log = log;
  const LookedUpModel found = look_up_or_probe(batcher, lookup, [&](PredictiveBatcher& probing) {
    TaggingProbeExecutor executor(setup, meter, config.variables);
    probing.probe_and_fit(executor);
    setup.reset_optimizer_state();  // probes fed synthetic gradients into the AdamW moments
  });
  return {{"model", batcher.model().to_json()},
          {"from_cache", found.from_cache},
          {"probe_s", found.probe_s},
          {"probes_run", static_cast<std::int64_t>(found.probes.size())},
          {"infeasible_probes", static_cast<std::int64_t>(found.infeasible_probes())}};
}

}  // namespace

MemoryModelOrigin obtain_memory_model(const TaggingJobConfig& config, TaggingModelSetup& setup,
                                      MemoryMeter& meter, std::int64_t capacity_bytes,
                                      PredictiveBatcher& batcher, DistributedContext& dist,
                                      const std::function<void(const std::string&)>& log) {
  nlohmann::json shared_model;
  std::exception_ptr failure;  // rank 0 rethrows its own error as it is (its class, its backtrace)
  if (dist.is_main()) {
    try {
      shared_model = look_up_or_probe_on_rank0(config, setup, meter, capacity_bytes, batcher, dist.world_size(), log);
    } catch (...) {
      failure = std::current_exception();
      const ErrorDescription error = describe_current_exception();
      shared_model = {{"error", error.line}, {"kind", to_string(error.kind)}};
    }
  }
  shared_model =
      nlohmann::json::parse(dist.share_from(0, shared_model.dump(), config.rendezvous_timeout()));
  if (failure) std::rethrow_exception(failure);
  if (shared_model.contains("error")) {  // the other ranks: the same line, the same kind
    throw_error_of_kind(parse_error_kind(shared_model.at("kind").get<std::string>()),
                        shared_model.at("error").get<std::string>());
  }
  batcher.set_model(MemoryModel::from_json(shared_model.at("model")));
  MemoryModelOrigin origin;
  origin.from_cache = shared_model.at("from_cache").get<bool>();
  // Every rank reports rank 0's probing (the summary is the same on every rank).
  origin.probe_s = shared_model.at("probe_s").get<double>();
  origin.probes_run = shared_model.at("probes_run").get<std::int64_t>();
  origin.infeasible_probes = shared_model.at("infeasible_probes").get<std::int64_t>();
  return origin;
}

}  // namespace xpm
