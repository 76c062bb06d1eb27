// xpm/tasks/tagging_memory_plan.hpp — the tagging job's memory model: the predictive
// batcher's options for the task, the identity the memory-model cache is keyed by, and the
// rank-0 lookup / probe / fit whose result every rank takes.
//
//   PredictiveBatcher batcher(tagging_batcher_options(config, data.max_length, capacity_bytes),
//                             make_packer(config.packer));
//   MemoryModelOrigin origin = obtain_memory_model(config, setup, meter, capacity_bytes, batcher,
//                                                  dist, log);   // every rank; rank 0 probes
//
// A resumed job does not call obtain_memory_model: it sets the model of its checkpoint (the
// one training used at the checkpoint's step, online corrections included).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/tasks/tagging_job.hpp"
#include "xpm/tasks/tagging_task.hpp"

namespace xpm {

/// The predictive batcher's options for the tagging task: the config's formula over {bs, l}
/// (l aggregated by max), the config's probe points or the automatic design up to
/// {bs: outer_batch_size, l: max_length}, the budget {capacity_bytes, memory_fraction,
/// extra_overhead_bytes}.
PredictiveBatcherOptions tagging_batcher_options(const TaggingJobConfig& config,
                                                 std::size_t max_length, std::int64_t capacity_bytes);

/// What the memory model depends on (the cache key): formula, model signature, architecture
/// options that change memory, optimizer, precision, device, world size, torch version,
/// capacity, budget and probe design. A change of any field probes again (docs/design.md section 3).
nlohmann::json memory_model_identity(const TaggingJobConfig& config,
                                     const PredictiveBatcherOptions& batcher_options,
                                     const nlohmann::json& model_signature,
                                     std::int64_t capacity_bytes, int world_size);

/// Where the job's memory model came from.
struct MemoryModelOrigin {
  bool from_cache = false;             // looked up in config.memory_model_cache
  double probe_s = 0;                  // probing wall time (s), 0 from the cache
  std::int64_t probes_run = 0;         // probes run (infeasible ones included)
  std::int64_t infeasible_probes = 0;  // probes that ran out of memory
};

/// Rank 0 looks the model up in the cache or probes full training steps (learning rate 0,
/// optimizer state reset afterwards) and fits it, then publishes it (or its error) through the
/// store; every rank, rank 0 included, sets the published JSON on `batcher`, so all start
/// identical. Collective: every rank calls it. Throws on every rank the error rank 0 met: rank
/// 0 its own exception, the others one of the same ErrorKind with its first line
/// (std::invalid_argument for a bad budget or probe design; error_context.hpp). A probe's
/// error other than out of memory names the probe ("probing at bs=8 l=64: ...").
/// `log` prints on rank 0.
MemoryModelOrigin obtain_memory_model(const TaggingJobConfig& config, TaggingModelSetup& setup,
                                      MemoryMeter& meter, std::int64_t capacity_bytes,
                                      PredictiveBatcher& batcher, DistributedContext& dist,
                                      const std::function<void(const std::string&)>& log);

}  // namespace xpm
