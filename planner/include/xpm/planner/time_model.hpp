// xpm/planner/time_model.hpp — how long a microbatch's forward and backward take, from the probes.
//
//   std::optional<TimeModel> time = fit_time_model(model, probes);  // after probing
//   if (time) model.metadata()["time_model"] = time->to_json();     // travels with the model
//   TimeModel::from_metadata(model)->seconds(model, {8, 128});      // seconds at bs 8, l 128
//
// A microbatch's forward and backward take overhead_s + seconds_per_byte * work_bytes(dims)
// seconds. work_bytes is the memory model's formula at dims less its value at batch size 0: the
// bytes of activations the records add, standing in for their arithmetic (padding included).
// overhead_s is what every microbatch costs whatever its records (kernel launches, Python,
// reading the weights). Both are fitted by fit_coefficients (relative residuals, non-negative)
// to the feasible probes' forward_backward_s, as measured on the machine that probed.
// FastestPacker (fastest_packer.hpp) minimises the sum over a step's microbatches. Timings differ
// between machines and ranks: fit it once (rank 0's probes, or lockstep's slowest rank's, as
// PredictiveBatcher::probe_and_fit and xpm.probe do) and send the model, so every rank plans alike.
// No function here communicates; seconds are wall-clock seconds, work in bytes.
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/probe.hpp"

namespace xpm {

struct TimeModel {
  double overhead_s = 0;          // seconds every microbatch takes, >= 0
  double seconds_per_byte = 0;    // seconds per byte of work_bytes, >= 0
  double max_rel_error = 0;       // the fit's largest relative error at its probes, signed
  std::size_t fitted_points = 0;  // probes it was fitted to

  /// model.added_bytes(dims): the formula at dims less its value at batch size 0 (0 at least),
  /// bytes; dims in variable_names() order. Throws std::invalid_argument for dims of the wrong
  /// width.
  static double work_bytes(const MemoryModel& model, const std::vector<double>& dims);
  /// overhead_s + seconds_per_byte * work_bytes(model, dims).
  double seconds(const MemoryModel& model, const std::vector<double>& dims) const;

  /// {"overhead_s", "seconds_per_byte", "max_rel_error", "fitted_points"}.
  nlohmann::json to_json() const;
  /// The model's metadata.time_model; nullopt without one. Throws std::invalid_argument naming
  /// the field when it is there but malformed (a missing or negative number).
  static std::optional<TimeModel> from_metadata(const MemoryModel& model);
};

/// Fits the time model of `model` to the feasible probes with forward_backward_s > 0. nullopt
/// when fewer than 3 such probes differ in work_bytes (their times cannot separate the two
/// terms), or both terms fit to 0. Never throws for the probes' values.
std::optional<TimeModel> fit_time_model(const MemoryModel& model, const std::vector<ProbeResult>& probes);

}  // namespace xpm
