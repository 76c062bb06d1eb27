#include "xpm/planner/probe.hpp"

#include <algorithm>

namespace xpm {

double ProbeResult::step_peak_bytes() const {
  return std::max(forward_backward_peak_bytes, optimizer_step_peak_bytes);
}

nlohmann::json to_json(const ProbeResult& probe) {
  return {{"dims", probe.dims},
          {"feasible", probe.feasible},
          {"forward_backward_peak_bytes", probe.forward_backward_peak_bytes},
          {"optimizer_step_peak_bytes", probe.optimizer_step_peak_bytes},
          {"step_peak_bytes", probe.step_peak_bytes()},
          {"duration_s", probe.duration_s},
          {"error", probe.error},
          {"capacity_bytes", probe.capacity_bytes}};
}

}  // namespace xpm
