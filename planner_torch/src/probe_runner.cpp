#include "xpm/planner_torch/probe_runner.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <utility>

#include <c10/util/Exception.h>

namespace xpm {

TorchProbeExecutor::TorchProbeExecutor(TorchProbeSteps steps, MemoryMeter& meter)
    : steps_(std::move(steps)), meter_(meter) {
  if (!steps_.forward_backward || !steps_.optimizer_step || !steps_.zero_grad) {
    throw std::invalid_argument(
        "TorchProbeExecutor: forward_backward, optimizer_step and zero_grad must all be set");
  }
}

ProbeResult TorchProbeExecutor::run_probe(const std::vector<double>& dims) {
  ProbeResult result = measure([&] { steps_.forward_backward(dims); });
  result.dims = dims;
  return result;
}

ProbeResult TorchProbeExecutor::run_probe_records(const std::vector<std::vector<double>>& records) {
  if (!steps_.forward_backward_records) return ProbeExecutor::run_probe_records(records);
  return measure([&] { steps_.forward_backward_records(records); });
}

ProbeResult TorchProbeExecutor::measure(const std::function<void()>& forward_backward) {
  ProbeResult result;
  // The limit the probe runs under: an out-of-memory probe bounds the fit at this many bytes.
  result.capacity_bytes = static_cast<double>(meter_.capacity_bytes());
  const auto start = std::chrono::steady_clock::now();
  steps_.zero_grad();
  const bool reserving = meter_.reserves_segments();
  double reserved_bytes = 0;
  try {
    start_peak(meter_);
    const auto forward_start = std::chrono::steady_clock::now();
    forward_backward();
    result.forward_backward_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - forward_start).count();
    result.forward_backward_peak_bytes = static_cast<double>(meter_.peak_allocated_bytes());
    reserved_bytes = static_cast<double>(meter_.peak_reserved_bytes());
    start_peak(meter_);  // as training measures it: the optimizer's state in segments of its own
    steps_.optimizer_step();
    result.optimizer_step_peak_bytes = static_cast<double>(meter_.peak_allocated_bytes());
    if (reserving)
      result.step_peak_reserved_bytes = std::max(reserved_bytes, static_cast<double>(meter_.peak_reserved_bytes()));
  } catch (const c10::OutOfMemoryError& error) {
    result.feasible = false;
    result.error = error.what_without_backtrace();
    if (reserving) result.capacity_bytes = static_cast<double>(meter_.peak_allocated_bytes());
  }
  steps_.zero_grad();
  result.duration_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

double TorchProbeExecutor::static_bytes() {
  steps_.zero_grad();
  return static_cast<double>(meter_.current_allocated_bytes());
}

}  // namespace xpm
