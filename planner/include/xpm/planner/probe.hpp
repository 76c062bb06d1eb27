// xpm/planner/probe.hpp — probe points and probe results: measured peaks of full training
// steps at chosen dims, the data the memory model is fitted to.
//
// A probe runs one full training step (forward, backward, optimizer step with its state
// allocated) at given dims on rank 0, before any DDP wrapping, and records the peak allocated
// bytes of each phase. The step's peak is the maximum over phases (docs/design.md section 3):
// the forward/backward peak grows with the dims, the optimizer-step peak is the static floor
// (weights + gradients + optimizer state + temporaries of the update) and does not.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xpm {

/// Dims to probe, by variable name, e.g. {{"bs", 8}, {"l", 128}}.
struct ProbePoint {
  std::map<std::string, double> values;
};

/// What one probe measured.
struct ProbeResult {
  std::vector<double> dims;                // formula variable_names() order
  bool feasible = true;                    // false: the step ran out of memory at these dims
  double forward_backward_peak_bytes = 0;  // peak allocated bytes during forward + backward
  double optimizer_step_peak_bytes = 0;    // peak allocated bytes during the optimizer step
  double duration_s = 0;                   // wall time of the probe step
  double forward_backward_s = 0;           // wall time of its forward + backward (0: not timed)
  std::string error;                       // the OOM message when infeasible
  double capacity_bytes = 0;               // memory limit the probe ran under, bytes; 0: not
                                           // recorded (PredictiveBatcher assumes its budget's)
  /// Under a caching allocator: the step's peak reserved bytes (allocated + cached, the cache
  /// emptied before the step); 0: not measured. PredictiveBatcher then plans reserved bytes
  /// (MemoryModel::prediction_budget_bytes, metadata.reserved_gap).
  double step_peak_reserved_bytes = 0;

  /// Peak of the whole step: max over phases.
  double step_peak_bytes() const;
};

/// Runs probe steps; implemented by the LibTorch side (planner_torch::TorchProbeExecutor) or by
/// a test double. Only rank 0 calls it.
class ProbeExecutor {
 public:
  virtual ~ProbeExecutor() = default;
  /// Runs one full training step at `dims` and measures it. An out-of-memory condition is
  /// reported as feasible = false, not thrown. Other errors are thrown.
  virtual ProbeResult run_probe(const std::vector<double>& dims) = 0;
  /// Runs one full training step over a microbatch made of these records (each record's dims
  /// in the formula's variable order, its batch-size column 1): a mix of lengths like the
  /// training data's, probed when PredictiveBatcherOptions::record_dims_sample is given (the
  /// batcher sets the result's dims to the records' aggregated dims). The default throws
  /// std::logic_error: an executor that builds batches from aggregated dims alone cannot build
  /// a mix.
  virtual ProbeResult run_probe_records(const std::vector<std::vector<double>>& records);
  /// Allocated bytes with weights, gradients and optimizer state resident and no batch in
  /// flight (the static memory).
  virtual double static_bytes() = 0;
};

nlohmann::json to_json(const ProbeResult& probe);

}  // namespace xpm
