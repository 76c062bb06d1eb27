// xpm/tasks/tagging_probe.hpp — probes of the bundled tagging task without training: builds
// the task's model (config.architecture: transformer or bilstm) and AdamW as xpm-train does
// (same config), allocates gradients and optimizer state, applies the CPU memory cap, and
// measures full training steps at the given dims.
//
//   TaggingJobConfig config;                     // data_dir, model, memory cap, ...
//   TaggingProbeReport r = probe_tagging_task(config, {{8, 64}, {16, 128}});
//   r.probes[0].step_peak_bytes();
//
// Used by `xpm-plan probe` and the held-out prediction benchmark. Single process; the caller's
// process-wide CPU allocator is replaced by the CpuMemoryMeter (see cpu_memory_meter.hpp).
//
// TaggingProbeExecutor runs the task's probe steps (the job's probing on rank 0 too); an error
// other than out of memory says where: "probing at bs=8 l=64: ..." (error_context.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xpm/planner/probe.hpp"
#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/tasks/tagging_job.hpp"
#include "xpm/tasks/tagging_task.hpp"

namespace xpm {

/// A TorchProbeExecutor over setup.probe_steps() whose errors name the probe's dims.
class TaggingProbeExecutor : public ProbeExecutor {
 public:
  /// `variable_names`: the formula's variables, in the order of the probes' dims.
  TaggingProbeExecutor(TaggingModelSetup& setup, MemoryMeter& meter,
                       std::vector<std::string> variable_names);
  /// TorchProbeExecutor::run_probe; errors read "probing at bs=8 l=64: <what>".
  ProbeResult run_probe(const std::vector<double>& dims) override;
  double static_bytes() override;

 private:
  TorchProbeExecutor executor_;
  std::vector<std::string> variable_names_;
};

struct TaggingProbeReport {
  std::int64_t static_bytes = 0;     // weights + gradients + AdamW state, allocated bytes
  std::int64_t capacity_bytes = 0;   // the CPU cap applied (0: none)
  std::vector<ProbeResult> probes;   // one per requested dims, in order; OOM -> feasible false
  std::int64_t max_length = 0;       // longest sentence in the corpus (tokens)
};

/// Measures each dims = {bs, l} (formula variable order bs, l) as one full training step with
/// learning rate 0. Throws std::invalid_argument for a bad config or dims (bs or l < 1, l above
/// the model's max_length), std::runtime_error for missing data.
TaggingProbeReport probe_tagging_task(const TaggingJobConfig& config,
                                      const std::vector<std::vector<double>>& dims_list);

}  // namespace xpm
