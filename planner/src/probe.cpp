#include "xpm/planner/probe.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace xpm {

double ProbeResult::step_peak_bytes() const {
  return std::max(forward_backward_peak_bytes, optimizer_step_peak_bytes);
}

ProbeResult ProbeExecutor::run_probe_records(const std::vector<std::vector<double>>& records) {
  throw std::logic_error("ProbeExecutor::run_probe_records: this executor builds batches from aggregated dims only, "
                         "and the design asked for a mix of " + std::to_string(records.size()) +
                         " records (PredictiveBatcherOptions::record_dims_sample): override run_probe_records");
}

nlohmann::json to_json(const ProbeResult& probe) {
  return {{"dims", probe.dims},
          {"feasible", probe.feasible},
          {"forward_backward_peak_bytes", probe.forward_backward_peak_bytes},
          {"optimizer_step_peak_bytes", probe.optimizer_step_peak_bytes},
          {"step_peak_bytes", probe.step_peak_bytes()},
          {"duration_s", probe.duration_s},
          {"forward_backward_s", probe.forward_backward_s},
          {"error", probe.error},
          {"capacity_bytes", probe.capacity_bytes},
          {"step_peak_reserved_bytes", probe.step_peak_reserved_bytes}};
}

}  // namespace xpm
