// xpm-plan measurements from CSV or JSON (see measurements.hpp).
#include "measurements.hpp"

#include <algorithm>
#include <cmath>

#include "common.hpp"
#include "csv_table.hpp"
#include "xpm/planner/enum_names.hpp"

namespace xpm_plan {
namespace {

// Probe fields copied into saved records when present.
const char* const kProbeFields[] = {"forward_backward_peak_bytes", "optimizer_step_peak_bytes",
                                    "step_peak_bytes", "duration_s"};

std::string brief(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

bool is_field(const std::string& name, const std::string& bytes, const std::string& floor) {
  if (name == bytes || name == floor) return true;
  for (const char* f : kProbeFields) {
    if (name == f) return true;
  }
  return false;
}

MeasurementSet read_csv_measurements(const MeasurementRequest& req, const std::string& text) {
  if (req.variables.empty()) {
    throw InputError("--variables is required with CSV measurements (" + req.path + ")");
  }
  const CsvTable table = parse_csv(text, req.path);
  MeasurementSet set;
  set.path = req.path;
  set.format = MeasurementFormat::kCsv;
  set.variables = req.variables;
  set.columns = table.header;
  std::vector<std::size_t> var_columns;
  for (const auto& v : req.variables) var_columns.push_back(table.column(v));
  const std::size_t bytes_column = table.column(req.bytes_column);
  std::optional<std::size_t> floor_column;
  if (!req.floor_column.empty()) floor_column = table.column(req.floor_column);
  std::optional<std::size_t> feasible_column;
  if (std::find(req.variables.begin(), req.variables.end(), "feasible") == req.variables.end()) {
    feasible_column = table.find_column("feasible");
  }
  const std::string& count_variable =
      req.count_variable.empty() ? req.variables.front() : req.count_variable;
  std::optional<std::size_t> capacity_column = table.find_column("capacity_bytes");
  std::vector<std::pair<std::string, std::size_t>> extra;
  for (const char* f : kProbeFields) {
    if (f == req.bytes_column || f == req.floor_column) continue;
    if (auto c = table.find_column(f)) extra.emplace_back(f, *c);
  }
  for (std::size_t r = 0; r < table.rows.size(); ++r) {
    std::vector<double> dims;
    for (std::size_t v = 0; v < var_columns.size(); ++v) {
      dims.push_back(table.dim(r, var_columns[v], req.verb, req.variables[v] == count_variable));
    }
    nlohmann::json record = {{"dims", dims}};
    const bool feasible = feasible_column ? table.boolean(r, *feasible_column) : true;
    record["feasible"] = feasible;
    double capacity = 0;  // checked on every row that has one: no cell is ignored
    if (capacity_column && !table.rows[r][*capacity_column].empty()) {
      capacity = table.number(r, *capacity_column);
      if (!(capacity > 0)) {
        throw InputError(table.where(r, *capacity_column) + ": capacity must be > 0, got " +
                         table.rows[r][*capacity_column]);
      }
      record["capacity_bytes"] = capacity;
    }
    if (!feasible) {
      set.infeasible.push_back(dims);
      set.infeasible_labels.push_back("line " + std::to_string(table.line_numbers[r]));
      set.infeasible_capacity_bytes.push_back(capacity);
      set.infeasible_records.push_back(record);
      set.all_records.push_back(std::move(record));
      continue;
    }
    const double bytes = table.number(r, bytes_column);
    if (!(bytes > 0)) {
      throw InputError(table.where(r, bytes_column) + ": bytes must be > 0, got " +
                       table.rows[r][bytes_column]);
    }
    record[req.bytes_column] = bytes;
    if (floor_column) {
      const double floor = table.number(r, *floor_column);
      if (floor < 0) {
        throw InputError(table.where(r, *floor_column) + ": bytes must be >= 0, got " +
                         table.rows[r][*floor_column]);
      }
      record[req.floor_column] = floor;
      set.floor_bytes = std::max(set.floor_bytes.value_or(0.0), floor);
      set.floor_peaks.push_back({dims, floor});
    }
    for (const auto& [name, c] : extra) {
      const std::string& cell = table.rows[r][c];
      if (!cell.empty()) record[name] = table.number(r, c);
    }
    set.measurements.push_back({dims, bytes});
    set.labels.push_back("line " + std::to_string(table.line_numbers[r]));
    set.records.push_back(record);
    set.all_records.push_back(std::move(record));
  }
  return set;
}

double json_number(const nlohmann::json& v, const std::string& where) {
  if (!v.is_number()) throw InputError(where + ": expected a number, got " + brief(v));
  const double x = v.get<double>();
  if (!std::isfinite(x)) throw InputError(where + ": not a finite number");
  return x;
}

// Where a JSON file keeps its measurements, in one of three formats: a list of measurements,
// `xpm-plan probe --json` output (probes, variable_names) or a memory model file
// (metadata.probes, formula.variable_names).
struct JsonEntries {
  nlohmann::json* entries = nullptr;
  std::string name;                    // "", "probes" or "metadata.probes"
  std::vector<std::string> variables;  // the file's variable names: the order of list-valued dims
};

std::vector<std::string> json_variable_names(const nlohmann::json& names, const std::string& p) {
  if (!names.is_array()) throw InputError(p + ": variable names: expected a list of strings");
  std::vector<std::string> out;
  for (const auto& n : names) {
    if (!n.is_string()) throw InputError(p + ": variable names: expected a list of strings");
    out.push_back(n.get<std::string>());
  }
  return out;
}

// xpm-plan probe --json
JsonEntries probe_output_entries(nlohmann::json& root, const std::string& p) {
  JsonEntries found{&root["probes"], "probes", {}};
  if (root.contains("variable_names")) found.variables = json_variable_names(root["variable_names"], p);
  return found;
}

// A memory model file.
JsonEntries model_file_entries(nlohmann::json& root, const std::string& p) {
  JsonEntries found{&root["metadata"]["probes"], "metadata.probes", {}};
  if (root.contains("formula") && root["formula"].is_object() &&
      root["formula"].contains("variable_names")) {
    found.variables = json_variable_names(root["formula"]["variable_names"], p);
  }
  return found;
}

// The entries of `root`, a non-empty list in any of the three formats.
JsonEntries locate_json_entries(nlohmann::json& root, const std::string& p) {
  JsonEntries found;
  if (root.is_array()) {
    found.entries = &root;
  } else if (!root.is_object()) {
    throw InputError(p + ": expected a JSON list or object, got " + brief(root));
  } else if (root.contains("probes")) {
    found = probe_output_entries(root, p);
  } else if (root.contains("metadata") && root["metadata"].is_object() &&
             root["metadata"].contains("probes")) {
    found = model_file_entries(root, p);
  } else {
    throw InputError(p + ": expected a list of measurements, a memory model file with "
                     "metadata.probes, or `xpm-plan probe --json` output with probes");
  }
  if (!found.entries->is_array()) {
    throw InputError(p + ": " + found.name + ": expected a list, got " + brief(*found.entries));
  }
  if (found.entries->empty()) {
    throw InputError(p + ": " + (found.name.empty() ? "the list" : found.name) + " is empty");
  }
  return found;
}

// What the probes ran on, kept in the fitted model's metadata: from the top level of probe
// output, from metadata of a model file.
void read_json_setup(const nlohmann::json& root, MeasurementSet& set) {
  const char* const kSetupKeys[] = {"task",      "device",        "capacity_bytes", "static_bytes",
                                    "precision", "optimizer",     "torch_version",  "signature",
                                    "max_length", "data_dir"};
  if (!root.is_object()) return;
  const nlohmann::json* source = &root;
  if (!root.contains("probes") && root.contains("metadata")) source = &root["metadata"];
  for (const char* key : kSetupKeys) {
    if (source->contains(key)) set.setup[key] = (*source)[key];
  }
}

// dims as a list in the order of the file's variables, picked in the order of `variables`.
std::vector<double> json_list_dims(const nlohmann::json& d, const std::string& where,
                                   const std::vector<std::string>& variables,
                                   const std::vector<std::string>& file_variables) {
  if (file_variables.empty()) {
    throw InputError(where + ".dims: a list, but the file does not name its variables; "
                     "give dims as an object by name");
  }
  if (d.size() != file_variables.size()) {
    throw InputError(where + ".dims: " + std::to_string(d.size()) + " values for " +
                     std::to_string(file_variables.size()) + " variables");
  }
  std::vector<double> dims;
  for (const auto& v : variables) {
    auto it = std::find(file_variables.begin(), file_variables.end(), v);
    if (it == file_variables.end()) {
      throw InputError(where + ".dims: no variable '" + v + "' in the file's variables");
    }
    const auto k = static_cast<std::size_t>(it - file_variables.begin());
    dims.push_back(json_number(d[k], where + ".dims[" + std::to_string(k) + "]"));
  }
  return dims;
}

// An entry's dims: "dims" as a list or an object by name, or the variables as fields.
std::vector<double> json_dims(const nlohmann::json& e, const std::string& where,
                              const std::vector<std::string>& variables,
                              const std::vector<std::string>& file_variables) {
  std::vector<double> dims;
  if (!e.contains("dims")) {
    for (const auto& v : variables) {
      if (!e.contains(v)) throw InputError(where + ": no variable '" + v + "'");
      dims.push_back(json_number(e[v], where + "." + v));
    }
    return dims;
  }
  const nlohmann::json& d = e["dims"];
  if (d.is_array()) return json_list_dims(d, where, variables, file_variables);
  if (!d.is_object()) throw InputError(where + ".dims: expected a list or an object, got " + brief(d));
  for (const auto& v : variables) {
    if (!d.contains(v)) throw InputError(where + ".dims: no variable '" + v + "'");
    dims.push_back(json_number(d[v], where + ".dims." + v));
  }
  return dims;
}

bool json_feasible(const nlohmann::json& e, const std::string& where) {
  if (!e.contains("feasible")) return true;
  const nlohmann::json& f = e["feasible"];
  if (f.is_boolean()) return f.get<bool>();
  if (f.is_number_integer() && (f.get<int>() == 0 || f.get<int>() == 1)) return f.get<int>() == 1;
  throw InputError(where + ".feasible: expected true or false, got " + brief(f));
}

// An entry whose probe ran out of memory: an infeasible bound (with its capacity, if any).
void add_json_infeasible(const nlohmann::json& e, const std::string& where, const std::string& label,
                         std::vector<double> dims, nlohmann::json record, MeasurementSet& set) {
  if (e.contains("error") && e["error"].is_string()) record["error"] = e["error"];
  double capacity = 0;
  if (e.contains("capacity_bytes")) {
    capacity = json_number(e["capacity_bytes"], where + ".capacity_bytes");
    if (capacity < 0) throw InputError(where + ".capacity_bytes: must be >= 0");
    if (capacity > 0) record["capacity_bytes"] = capacity;
  }
  set.infeasible.push_back(std::move(dims));
  set.infeasible_labels.push_back(label);
  set.infeasible_capacity_bytes.push_back(capacity);
  set.infeasible_records.push_back(record);
  set.all_records.push_back(std::move(record));
}

// A measured entry: its bytes, its floor (--floor-column) and the probe fields of its record.
void add_json_measurement(const MeasurementRequest& req, const nlohmann::json& e,
                          const std::string& where, const std::string& label,
                          std::vector<double> dims, nlohmann::json record, MeasurementSet& set) {
  if (!e.contains(req.bytes_column)) {
    throw InputError(where + ": no bytes field '" + req.bytes_column + "' (--bytes-column)");
  }
  const double bytes = json_number(e[req.bytes_column], where + "." + req.bytes_column);
  if (!(bytes > 0)) {
    throw InputError(where + "." + req.bytes_column + ": bytes must be > 0, got " +
                     brief(e[req.bytes_column]));
  }
  if (!req.floor_column.empty()) {
    if (!e.contains(req.floor_column)) {
      throw InputError(where + ": no field '" + req.floor_column + "' (--floor-column)");
    }
    const double floor = json_number(e[req.floor_column], where + "." + req.floor_column);
    if (floor < 0) throw InputError(where + "." + req.floor_column + ": must be >= 0");
    set.floor_bytes = std::max(set.floor_bytes.value_or(0.0), floor);
    set.floor_peaks.push_back({dims, floor});
  }
  for (const auto& item : e.items()) {
    if (is_field(item.key(), req.bytes_column, req.floor_column) && item.value().is_number()) {
      record[item.key()] = item.value();
    }
  }
  set.measurements.push_back({std::move(dims), bytes});
  set.labels.push_back(label);
  set.records.push_back(record);
  set.all_records.push_back(std::move(record));
}

// Entry i of the file: its dims, checked, then a measurement or an infeasible bound.
void read_json_entry(const MeasurementRequest& req, const JsonEntries& found, std::size_t i,
                     MeasurementSet& set) {
  const nlohmann::json& e = (*found.entries)[i];
  const std::string label = found.name + "[" + std::to_string(i) + "]";
  const std::string where = req.path + ": " + label;
  if (!e.is_object()) throw InputError(where + ": expected an object, got " + brief(e));
  std::vector<double> dims = json_dims(e, where, set.variables, found.variables);
  const std::string& count = req.count_variable.empty() ? set.variables.front() : req.count_variable;
  const auto it = std::find(set.variables.begin(), set.variables.end(), count);
  check_dims(dims, set.variables, static_cast<std::size_t>(it - set.variables.begin()),
             req.verb + ": " + where + ", variable");
  const bool feasible = json_feasible(e, where);
  nlohmann::json record = {{"dims", dims}, {"feasible", feasible}};
  if (feasible) {
    add_json_measurement(req, e, where, label, std::move(dims), std::move(record), set);
  } else {
    add_json_infeasible(e, where, label, std::move(dims), std::move(record), set);
  }
}

MeasurementSet read_json_measurements(const MeasurementRequest& req, const std::string& text) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(req.path + ": not valid JSON: " + first_line(e.what()));
  }
  const JsonEntries found = locate_json_entries(root, req.path);
  MeasurementSet set;
  set.path = req.path;
  set.format = MeasurementFormat::kJson;
  read_json_setup(root, set);
  set.variables = req.variables.empty() ? found.variables : req.variables;
  if (set.variables.empty()) {
    throw InputError("--variables is required: " + req.path + " does not name its variables");
  }
  for (std::size_t i = 0; i < found.entries->size(); ++i) read_json_entry(req, found, i, set);
  return set;
}

}  // namespace

void MeasurementSet::keep_above_floor(const xpm::MemoryModel& floor) {
  std::vector<xpm::Measurement> kept;
  std::vector<std::string> kept_labels;
  std::vector<nlohmann::json> kept_records;
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    if (measurements[i].bytes > floor.floor_bytes_at(measurements[i].dims)) {
      kept.push_back(measurements[i]);
      kept_labels.push_back(labels[i]);
      kept_records.push_back(records[i]);
    } else {
      below_floor.push_back(measurements[i]);
      below_floor_labels.push_back(labels[i]);
    }
  }
  measurements = std::move(kept);
  labels = std::move(kept_labels);
  records = std::move(kept_records);
}

MeasurementSet read_measurements(const MeasurementRequest& request) {
  const std::string text = read_file(request.path, "measurements");
  MeasurementFormat format = request.format;
  if (format == MeasurementFormat::kAuto) {
    const auto first = text.find_first_not_of(" \t\r\n");
    const bool json = first != std::string::npos && (text[first] == '[' || text[first] == '{');
    format = json ? MeasurementFormat::kJson : MeasurementFormat::kCsv;
  }
  return format == MeasurementFormat::kCsv ? read_csv_measurements(request, text)
                                           : read_json_measurements(request, text);
}

std::string to_string(MeasurementFormat format) {
  constexpr xpm::EnumNames<MeasurementFormat, 3> kNames{
      {{MeasurementFormat::kAuto, "auto"}, {MeasurementFormat::kCsv, "csv"}, {MeasurementFormat::kJson, "json"}}};
  return xpm::enum_name(kNames, format);
}

}  // namespace xpm_plan
