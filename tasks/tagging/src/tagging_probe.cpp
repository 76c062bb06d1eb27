#include "xpm/tasks/tagging_probe.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "xpm/planner/dims_text.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/loop/error_context.hpp"

namespace xpm {

TaggingProbeExecutor::TaggingProbeExecutor(TaggingModelSetup& setup, MemoryMeter& meter,
                                           std::vector<std::string> variable_names)
    : executor_(setup.probe_steps(), meter), variable_names_(std::move(variable_names)) {}

ProbeResult TaggingProbeExecutor::run_probe(const std::vector<double>& dims) {
  return with_error_context("probing at " + dims_text(variable_names_, dims),
                            [&] { return executor_.run_probe(dims); });
}

double TaggingProbeExecutor::static_bytes() { return executor_.static_bytes(); }

TaggingProbeReport probe_tagging_task(const TaggingJobConfig& config,
                                      const std::vector<std::vector<double>>& dims_list) {
  config.validate();
  if (!tagging_device(config.device, "--device").is_cpu()) {
    throw std::invalid_argument("--device '" + config.device + "': probing the bundled task alone measures with the "
                                "CPU meter; on a GPU, xpm-train --device cuda probes on the device before it trains");
  }
  // config.threads 0 (automatic, as xpm-train): every hardware thread, one process.
  torch::set_num_threads(config.threads > 0
                             ? config.threads
                             : static_cast<int>(std::max(1U, std::thread::hardware_concurrency())));
  torch::manual_seed(config.seed);
  const TaggingData data = load_tagging_data(config);
  CpuMemoryMeter& meter = CpuMemoryMeter::install();
  meter.set_capacity_bytes(0);
  TaggingModelSetup setup(config, data);
  for (std::size_t i = 0; i < dims_list.size(); ++i) {
    const auto& dims = dims_list[i];
    if (dims.size() != 2 || dims[0] < 1 || dims[1] < 1 ||
        dims[1] > static_cast<double>(setup.max_length())) {
      throw std::invalid_argument(
          "probe point " + std::to_string(i) + " must be {bs >= 1, 1 <= l <= " +
          std::to_string(setup.max_length()) + "}");
    }
  }
  TaggingProbeReport report;
  report.static_bytes = meter.current_allocated_bytes();
  report.max_length = static_cast<std::int64_t>(data.max_length);
  report.capacity_bytes = config.memory_cap_bytes;
  if (report.capacity_bytes == 0 && config.memory_cap_factor > 0) {
    report.capacity_bytes =
        static_cast<std::int64_t>(config.memory_cap_factor * static_cast<double>(report.static_bytes));
  }
  ScopedMemoryCap cap(report.capacity_bytes);
  TaggingProbeExecutor executor(setup, meter, {"bs", "l"});
  for (const auto& dims : dims_list) report.probes.push_back(executor.run_probe(dims));
  return report;
}

}  // namespace xpm
