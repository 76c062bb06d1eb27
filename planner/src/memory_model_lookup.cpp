// memory_model_lookup.cpp — the cached model or probes and a fit (memory_model_lookup.hpp).
#include "xpm/planner/memory_model_lookup.hpp"

#include <chrono>
#include <optional>
#include <stdexcept>

#include "xpm/planner/memory_model_cache.hpp"
#include "xpm/planner/time_model.hpp"

namespace xpm {
namespace {

void say(const ModelLookup& lookup, const std::string& line) {
  if (lookup.log) lookup.log(lookup.log_prefix + ": " + line);
}

// The cached model for the identity, if the cache holds one that can be used.
std::optional<MemoryModel> cached_model(const MemoryModelCache& cache, const ModelLookup& lookup) {
  std::string warning;
  std::optional<MemoryModel> cached = cache.lookup(lookup.identity, &warning);
  if (!warning.empty()) say(lookup, "warning: " + warning);
  if (cached && lookup.needs_time_model && !TimeModel::from_metadata(*cached)) {
    say(lookup, "the cached memory model has no time model, which the fastest packer needs: probing again");
    cached.reset();
  }
  if (cached) say(lookup, "memory model from the cache (" + cache.path_for(lookup.identity) + "), no probing");
  return cached;
}

}  // namespace

std::size_t LookedUpModel::infeasible_probes() const {
  std::size_t infeasible = 0;
  for (const ProbeResult& probe : probes) infeasible += probe.feasible ? 0 : 1;
  return infeasible;
}

LookedUpModel look_up_or_probe(PredictiveBatcher& batcher, const ModelLookup& lookup,
                               const std::function<void(PredictiveBatcher&)>& probe) {
  if (!probe) throw std::invalid_argument("look_up_or_probe: the probe function is empty");
  std::optional<MemoryModelCache> cache;
  if (!lookup.cache_dir.empty()) cache.emplace(lookup.cache_dir);
  LookedUpModel found;
  if (cache) {
    if (std::optional<MemoryModel> cached = cached_model(*cache, lookup)) {
      batcher.set_model(*cached);
      found.from_cache = true;
      return found;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  probe(batcher);
  found.probe_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!batcher.has_model()) throw std::runtime_error("look_up_or_probe: probing left the batcher without a model");
  found.probes = batcher.probes();
  say(lookup, std::to_string(found.probes.size()) + " probes (" + std::to_string(found.infeasible_probes()) +
                  " out of memory) in " + std::to_string(found.probe_s) + " s; " +
                  batcher.fit_summary().brief_report());
  MemoryModel fitted = batcher.model();
  for (const auto& item : lookup.metadata.items()) fitted.metadata()[item.key()] = item.value();
  batcher.set_model(fitted);
  if (cache) cache->store(lookup.identity, fitted);
  return found;
}

}  // namespace xpm
