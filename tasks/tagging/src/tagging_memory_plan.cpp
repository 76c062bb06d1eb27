// The tagging job's memory model: batcher options, cache identity, rank-0 probe or lookup.
#include "xpm/tasks/tagging_memory_plan.hpp"

#include <chrono>
#include <exception>
#include <optional>
#include <stdexcept>

#include <torch/torch.h>

#include "xpm/planner/memory_model_cache.hpp"
#include "xpm/planner/time_model.hpp"
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
nlohmann::json look_up_or_probe(const TaggingJobConfig& config, TaggingModelSetup& setup,
                                MemoryMeter& meter, std::int64_t capacity_bytes,
                                PredictiveBatcher& batcher, int world_size,
                                const std::function<void(const std::string&)>& log) {
  MemoryModelOrigin origin;
  const nlohmann::json identity = memory_model_identity(config, batcher.options(), setup.signature(),
                                                       capacity_bytes, world_size);
  std::optional<MemoryModelCache> cache;
  if (!config.memory_model_cache.empty()) cache.emplace(config.memory_model_cache);
  std::string cache_warning;
  std::optional<MemoryModel> cached = cache ? cache->lookup(identity, &cache_warning) : std::nullopt;
  if (!cache_warning.empty()) log("xpm-train: warning: " + cache_warning);
  if (cached && config.packer == PackerKind::kFastest && !TimeModel::from_metadata(*cached)) {
    log("xpm-train: the cached memory model has no time model, which --packer fastest needs: probing again");
    cached.reset();
  }
  if (cached) {
    batcher.set_model(*cached);
    log("xpm-train: memory model from the cache (" + cache->path_for(identity) + "), no probing");
  } else {
    TaggingProbeExecutor executor(setup, meter, config.variables);
    const auto probe_start = std::chrono::steady_clock::now();
    batcher.probe_and_fit(executor);
    origin.probe_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - probe_start).count();
    setup.reset_optimizer_state();  // probes fed synthetic gradients into the AdamW moments
    origin.probes_run = static_cast<std::int64_t>(batcher.probes().size());
    for (const ProbeResult& probe : batcher.probes()) origin.infeasible_probes += probe.feasible ? 0 : 1;
    log("xpm-train: " + std::to_string(origin.probes_run) + " probes (" +
        std::to_string(origin.infeasible_probes) + " out of memory) in " + std::to_string(origin.probe_s) +
        " s; " + batcher.fit_summary().brief_report());
    MemoryModel fitted = batcher.model();
    fitted.metadata()["device"] = device_kind(config);
    fitted.metadata()["capacity_bytes"] = capacity_bytes;
    fitted.metadata()["precision"] = to_string(config.precision);
    fitted.metadata()["activation_checkpointing"] = config.model.activation_checkpointing;
    fitted.metadata()["sharding"] = to_string(config.sharding);
    fitted.metadata()["world_size"] = world_size;
    fitted.metadata()["optimizer"] = "adamw";
    fitted.metadata()["torch_version"] = TORCH_VERSION;
    fitted.metadata()["model_signature"] = setup.signature();
    batcher.set_model(fitted);
    if (cache) cache->store(identity, fitted);
  }
  return {{"model", batcher.model().to_json()},
          {"from_cache", cached.has_value()},
          {"probe_s", origin.probe_s},
          {"probes_run", origin.probes_run},
          {"infeasible_probes", origin.infeasible_probes}};
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
      shared_model = look_up_or_probe(config, setup, meter, capacity_bytes, batcher, dist.world_size(), log);
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
