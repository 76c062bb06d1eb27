// xpm/planner_torch/probe_runner.hpp — runs probe steps of a LibTorch training step and
// measures the peak allocated bytes of each phase with a MemoryMeter.
//
//   TorchProbeSteps steps;
//   steps.forward_backward = [&](const std::vector<double>& dims) { ... loss.backward(); };
//   steps.optimizer_step = [&] { optimizer.step(); };
//   steps.zero_grad = [&] { optimizer.zero_grad(); };
//   TorchProbeExecutor executor(steps, CpuMemoryMeter::install());
//   batcher.probe_and_fit(executor);
//
// Call on rank 0 before DDP wrapping. The steps must leave the parameters unchanged (e.g. run
// the optimizer with a learning rate of 0) if the model is trained afterwards; they must keep
// gradients and optimizer state allocated between probes, as in training, so every probe sees
// the steady-state memory.
#pragma once

#include <functional>
#include <vector>

#include "xpm/planner/probe.hpp"
#include "xpm/planner_torch/memory_meter.hpp"

namespace xpm {

struct TorchProbeSteps {
  /// Builds a synthetic batch at `dims` (formula variable order), runs forward and backward.
  std::function<void(const std::vector<double>& dims)> forward_backward;
  /// One optimizer step over the accumulated gradients.
  std::function<void()> optimizer_step;
  /// Zeroes the gradients in place (keeps them allocated).
  std::function<void()> zero_grad;
  /// Optional: builds a batch of exactly these records (dims per record, formula variable
  /// order, batch-size column 1; each record its own length), runs forward and backward. Needed
  /// to probe mixes (PredictiveBatcherOptions::record_dims_sample).
  std::function<void(const std::vector<std::vector<double>>& records)> forward_backward_records;
};

class TorchProbeExecutor : public ProbeExecutor {
 public:
  /// Throws std::invalid_argument if a step function is empty.
  TorchProbeExecutor(TorchProbeSteps steps, MemoryMeter& meter);
  /// Runs zero_grad, forward_backward(dims), optimizer_step, measuring each phase's peak
  /// allocated bytes. c10::OutOfMemoryError in any phase gives feasible = false with the message.
  /// capacity_bytes is the meter's capacity (its cap; 0 when unlimited) at the time of the probe.
  /// Where the meter reserves segments (MemoryMeter::reserves_segments), the cache is emptied
  /// first, step_peak_reserved_bytes is measured, and a probe out of memory bounds the model of
  /// allocated bytes at what it had allocated (capacity_bytes: its allocated peak), not at the
  /// capacity its reserved bytes reached.
  ProbeResult run_probe(const std::vector<double>& dims) override;
  /// The same over steps.forward_backward_records(records) (the result's dims left empty: the
  /// batcher sets them); without it, ProbeExecutor's std::logic_error.
  ProbeResult run_probe_records(const std::vector<std::vector<double>>& records) override;
  /// current_allocated_bytes() after zero_grad (nothing in flight).
  double static_bytes() override;

 private:
  ProbeResult measure(const std::function<void()>& forward_backward);
  TorchProbeSteps steps_;
  MemoryMeter& meter_;
};

}  // namespace xpm
