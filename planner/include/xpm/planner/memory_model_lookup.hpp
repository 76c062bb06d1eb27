// xpm/planner/memory_model_lookup.hpp — a memory model from the cache, or probed, fitted and
// stored there: what a job does once before training (rank 0's part).
//
//   ModelLookup lookup;
//   lookup.cache_dir = "runs/xpm-memory-models";   // empty: no cache, always probe
//   lookup.identity = {{"model_signature", ...}, {"optimizer", "adamw"}, {"capacity_bytes", cap}};
//   lookup.metadata = {{"optimizer", "adamw"}};     // written into a probed model
//   lookup.log = [](const std::string& line) { std::cerr << line << '\n'; };
//   LookedUpModel found = look_up_or_probe(batcher, lookup, [&](PredictiveBatcher& b) {
//     b.probe_and_fit(executor);                    // and whatever must surround the probes
//   });
//   // batcher.model() is set either way; found.from_cache, found.probe_s, found.probes
//
// The identity is the cache key (memory_model_cache.hpp): put in it everything the model
// depends on (model, optimizer, precision, device, capacity, formula, probe design). Not
// collective: one process calls it (rank 0); send batcher.model().to_json() to the others.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner/probe.hpp"

namespace xpm {

struct ModelLookup {
  std::string cache_dir;                             // the cache's folder; empty: no cache
  nlohmann::json identity = nlohmann::json::object();  // what the model depends on: the key
  nlohmann::json metadata = nlohmann::json::object();  // merged into a probed model's metadata
  bool needs_time_model = false;  // a cached model without metadata.time_model is probed again
  std::string log_prefix = "xpm";  // the log lines' "<prefix>: "
  std::function<void(const std::string&)> log;       // one line per event; empty: silent
};

struct LookedUpModel {
  bool from_cache = false;
  double probe_s = 0;                // the probe callback's wall time (s); 0 from the cache
  std::vector<ProbeResult> probes;   // batcher.probes() after probing; empty from the cache
  std::size_t infeasible_probes() const;  // probes that ran out of memory
};

/// Sets `batcher`'s model: the cached one for lookup.identity, or else `probe(batcher)` (which
/// must leave the batcher with a fitted model, e.g. by PredictiveBatcher::probe_and_fit) with
/// lookup.metadata merged into the model's metadata, then stored in the cache. Logs where the
/// model came from, a cache file it could not trust, and the probes' summary. Throws
/// std::invalid_argument for an empty `probe`, what `probe` throws as it is, and
/// std::runtime_error when `probe` left the batcher without a model.
LookedUpModel look_up_or_probe(PredictiveBatcher& batcher, const ModelLookup& lookup,
                               const std::function<void(PredictiveBatcher&)>& probe);

}  // namespace xpm
