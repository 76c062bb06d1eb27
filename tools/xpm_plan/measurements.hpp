// xpm-plan measurements: the data `fit` reads, from a CSV file or a JSON file.
//
// CSV: a header row with one column per variable and the bytes column (see csv_table.hpp). An
// optional `feasible` column (1/0, true/false) marks probes that ran out of memory.
//
// JSON, one of:
//   - a list of objects, one per measurement, with a number per variable and the bytes key:
//       [{"bs": 1, "l": 16, "peak_bytes": 1000768}, ...]
//   - a memory model file (xpm-train's memory_model.json, `xpm-plan fit --output`): its
//     metadata.probes, dims in formula.variable_names order;
//   - the output of `xpm-plan probe --json`: its probes, dims in variable_names order.
// A probe's dims may be a list (in the file's variable order) or an object by name; its
// "feasible" (default true) false marks a probe that ran out of memory.
//
// Dims must be finite numbers >= 0, and the batch-size variable (count_variable) > 0: anything
// else is an InputError naming the file, the line (CSV) or entry (JSON) and the variable.
//
// Infeasible probes are not fitted as points (their peak is unknown, only that it exceeds the
// capacity they ran under): they are kept in `infeasible`, with that capacity when the probe
// records it (a `capacity_bytes` column or key > 0; `xpm-plan fit` falls back on
// --probe-capacity-bytes, then on the file's capacity_bytes), and become lower bounds of the fit
// and limits of the model (xpm::InfeasibleBound); never dropped silently.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/memory_model.hpp"

namespace xpm_plan {

/// How a measurements file is written: kAuto reads JSON when the text starts with [ or {.
enum class MeasurementFormat { kAuto, kCsv, kJson };
std::string to_string(MeasurementFormat format);  // "auto" | "csv" | "json"

struct MeasurementRequest {
  std::string path;                   // file to read
  MeasurementFormat format = MeasurementFormat::kAuto;
  std::vector<std::string> variables; // formula variable order; empty: from the JSON file
  std::string bytes_column;           // the measured peak to fit
  std::string floor_column;           // optional: floor = max of this column over feasible rows
  std::string verb = "fit";           // first word of dim errors
  std::string count_variable;         // batch-size variable (dims > 0); "": the first variable
};

struct MeasurementSet {
  std::string path;
  MeasurementFormat format = MeasurementFormat::kCsv;  // as read: kCsv or kJson
  std::vector<std::string> variables;         // order of every dims vector below
  std::vector<std::string> columns;           // CSV: every column the header names
  std::vector<xpm::Measurement> measurements; // feasible ones, fitted
  std::vector<std::string> labels;            // where each came from: "line 3", "probes[2]"
  std::vector<nlohmann::json> records;        // each feasible one as a probe record (for saving)
  std::vector<std::vector<double>> infeasible;// dims of probes that ran out of memory
  std::vector<std::string> infeasible_labels; // where each came from, as `labels`
  std::vector<double> infeasible_capacity_bytes;  // capacity each ran under; 0: not recorded
  std::vector<nlohmann::json> infeasible_records;
  std::vector<nlohmann::json> all_records;    // feasible and infeasible, in file order
  std::optional<double> floor_bytes;          // from floor_column: its largest value
  std::vector<xpm::Measurement> floor_peaks;  // from floor_column: one per feasible measurement
  nlohmann::json setup = nlohmann::json::object();  // JSON files: device, capacity_bytes,
                                              // static_bytes, task, ... of the probes
  std::vector<xpm::Measurement> below_floor;  // feasible but not fitted (keep_above_floor)
  std::vector<std::string> below_floor_labels;

  /// Moves the measurements with bytes <= the floor at their dims (floor.floor_bytes_at) to
  /// below_floor: where the floor is the prediction, they say nothing about the formula
  /// (docs/design.md, section 3).
  void keep_above_floor(const xpm::MemoryModel& floor);
};

/// Reads the measurements; InputError naming the file, the entry and the field on bad input.
MeasurementSet read_measurements(const MeasurementRequest& request);

}  // namespace xpm_plan
