// xpm-plan show: print a memory model file — formula, coefficients with units, floor, metadata
// and the probes with the model's prediction at each.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>

#include "common.hpp"
#include "verbs.hpp"

namespace xpm_plan {
namespace {

// Probe fields shown as table columns, in this order, when present.
const char* const kProbeColumns[] = {"forward_backward_peak_bytes", "optimizer_step_peak_bytes",
                                     "step_peak_bytes"};

std::string scalar_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) return number_text(v.get<double>());
  return v.dump();
}

// Probe dims as a vector in the model's variable order (list or object by name).
std::vector<double> probe_dims(const nlohmann::json& probe, const xpm::MemoryModel& model,
                               const std::string& where) {
  const auto& vars = model.formula().variable_names();
  if (!probe.is_object() || !probe.contains("dims")) {
    throw InputError(where + ": expected an object with dims");
  }
  const nlohmann::json& d = probe["dims"];
  std::vector<double> dims;
  for (std::size_t v = 0; v < vars.size(); ++v) {
    const nlohmann::json* x = nullptr;
    if (d.is_array() && d.size() == vars.size()) x = &d[v];
    if (d.is_object() && d.contains(vars[v])) x = &d[vars[v]];
    if (x == nullptr || !x->is_number()) {
      throw InputError(where + ".dims: no number for variable '" + vars[v] + "'");
    }
    dims.push_back(x->get<double>());
  }
  return dims;
}

}  // namespace

po::options_description show_options() {
  po::options_description desc(
      "xpm-plan show [--model] M [--json]\n"
      "Prints a memory model file: formula (as given and canonical), coefficients with their\n"
      "units (bytes per unit of the term), floor, metadata, and the probes with the model's\n"
      "prediction at each.\nOptions");
  desc.add_options()
      ("help,h", "show this help")
      ("model", po::value<std::string>()->required(), "memory model JSON (required; positional)")
      ("json", po::bool_switch()->default_value(false), "print one JSON object instead of text");
  return desc;
}

namespace {

// What `show` prints: the model, its metadata without the probes, the probes and their dims.
struct ShownModel {
  std::string path;
  xpm::MemoryModel model;
  nlohmann::json metadata;
  nlohmann::json probes = nlohmann::json::array();
  std::vector<std::vector<double>> dims;  // of each probe, the model's variable order
};

ShownModel load_shown_model(const std::string& path) {
  ShownModel shown{path, load_model(path), {}, nlohmann::json::array(), {}};
  shown.metadata = shown.model.metadata();
  if (shown.metadata.contains("probes")) {
    if (!shown.metadata["probes"].is_array()) throw InputError(path + ": metadata.probes is not a list");
    shown.probes = shown.metadata["probes"];
    shown.metadata.erase("probes");
  }
  for (std::size_t i = 0; i < shown.probes.size(); ++i) {
    shown.dims.push_back(
        probe_dims(shown.probes[i], shown.model, path + ": metadata.probes[" + std::to_string(i) + "]"));
  }
  return shown;
}

nlohmann::json shown_json(ShownModel shown) {
  const xpm::MemoryModel& model = shown.model;
  const xpm::CostFormula& formula = model.formula();
  const auto& names = formula.coefficient_names();
  const auto& vars = formula.variable_names();
  const auto terms = coefficient_terms(formula);
  nlohmann::json j;
  j["path"] = shown.path;
  j["formula"] = formula.text();
  j["canonical"] = formula.canonical();
  j["identity_hash"] = formula.identity_hash();
  j["linear"] = formula.is_linear();
  j["variables"] = vars;
  j["batch_size_variable"] = model.batch_size_variable();
  nlohmann::json agg = nlohmann::json::object();
  for (std::size_t v = 0; v < vars.size(); ++v) agg[vars[v]] = xpm::to_string(model.aggregation()[v]);
  j["aggregation"] = std::move(agg);
  nlohmann::json coefs = nlohmann::json::array();
  for (std::size_t k = 0; k < names.size(); ++k) {
    coefs.push_back({{"name", names[k]},
                     {"value", model.coefficients()[k]},
                     {"term", terms[k]},
                     {"unit", coefficient_unit(terms[k], formula.is_linear())}});
  }
  j["coefficients"] = std::move(coefs);
  j["floor_bytes"] = model.floor_bytes();
  j["single_record_factor"] = model.single_record_factor();
  const nlohmann::json file = model.to_json();
  j["single_record_coefficients"] = file.contains("single_record_coefficients") ? file["single_record_coefficients"]
                                                                                : nlohmann::json(nullptr);
  j["floor_formula"] = file.contains("floor_formula") ? file["floor_formula"] : nlohmann::json(nullptr);
  j["probed_ranges"] = file.contains("probed_ranges") ? file["probed_ranges"] : nlohmann::json(nullptr);
  nlohmann::json limits = nlohmann::json::array();
  for (const xpm::InfeasibleBound& p : model.infeasible_probes()) {
    limits.push_back({{"dims", dims_json(model, p.dims)}, {"exceeds_bytes", p.exceeds_bytes}});
  }
  j["infeasible_probes"] = std::move(limits);
  j["metadata"] = shown.metadata;
  for (std::size_t i = 0; i < shown.probes.size(); ++i) {
    shown.probes[i]["dims"] = dims_json(model, shown.dims[i]);
    shown.probes[i]["predicted_bytes"] = model.predict_bytes(shown.dims[i]);
  }
  j["probes"] = std::move(shown.probes);
  return j;
}

// Formula, variables, coefficients, floor, probed range and plan limits.
void print_model_text(std::ostream& os, const ShownModel& shown) {
  const xpm::MemoryModel& model = shown.model;
  const xpm::CostFormula& formula = model.formula();
  const auto& names = formula.coefficient_names();
  const auto& vars = formula.variable_names();
  const auto terms = coefficient_terms(formula);
  os << "memory model  " << shown.path << "\n"
     << "formula       " << formula.text() << "\n"
     << "canonical     " << formula.canonical() << "\n"
     << "variables     ";
  for (std::size_t v = 0; v < vars.size(); ++v) {
    os << (v ? ", " : "") << vars[v] << " ("
       << (v == model.batch_size_index() ? "batch size, " : "")
       << xpm::to_string(model.aggregation()[v]) << " over records)";
  }
  os << "\nidentity      " << formula.identity_hash() << "\n"
     << "coefficients  "
     << (formula.is_linear() ? "(bytes per unit of the term each multiplies)" : "(non-linear formula)")
     << "\n";
  for (std::size_t k = 0; k < names.size(); ++k) {
    os << "  " << names[k] << " = "
       << coefficient_text(model.coefficients()[k], terms[k], formula.is_linear()) << "\n";
  }
  os << "floor         " << bytes_text(model.floor_bytes()) << " bytes ("
     << mib_text(model.floor_bytes()) << "); prediction = max(floor, formula)\n";
  if (const xpm::FloorFormula* moving = model.floor_formula()) {
    os << "floor formula " << moving->formula.canonical() << " (";
    for (std::size_t k = 0; k < moving->coefficients.size(); ++k) {
      os << (k ? ", " : "") << moving->formula.coefficient_names()[k] << " = "
         << bytes_text(moving->coefficients[k]);
    }
    os << "); prediction = max(floor, floor formula, formula)\n";
  }
  if (model.single_record_factor() != 1) {
    os << "one record    the formula's prediction at " << model.batch_size_variable() << " = 1 times "
       << number_text(model.single_record_factor()) << " (probes of one record peaked above the trend)\n";
  }
  if (const auto& single = model.single_record_coefficients(); !single.empty()) {
    os << "one record    at " << model.batch_size_variable() << " = 1 the smaller of the formula and its fit of the "
       << "probes of one record (they peaked below the trend):\n";
    for (std::size_t k = 0; k < single.size(); ++k)
      os << "  " << names[k] << " = " << coefficient_text(single[k], terms[k], formula.is_linear()) << "\n";
  }
  if (!model.probed_ranges().empty()) {
    os << "probed range  ";
    for (std::size_t v = 0; v < vars.size(); ++v) {
      os << (v ? ", " : "") << vars[v] << " " << number_text(model.probed_ranges()[v].min) << ".."
         << number_text(model.probed_ranges()[v].max);
    }
    os << " (answers beyond it are extrapolations)\n";
  }
  if (!model.infeasible_probes().empty()) {
    os << "plan limits   no microbatch reaches these probes that ran out of memory (under a "
          "budget at or below their capacity):\n";
    for (const xpm::InfeasibleBound& p : model.infeasible_probes()) {
      os << "  " << dims_text(model, p.dims) << " under " << bytes_text(p.exceeds_bytes)
         << " bytes (" << mib_text(p.exceeds_bytes) << ")\n";
    }
  }
}

// The phases xpm.probe fitted apart (metadata.phases), one line each: "without_gradients: a =
// 31.2, b = 7901, c = 1.9e+06 bytes (max error +0.41 % over 9 shapes)".
void print_phases_text(std::ostream& os, const nlohmann::json& phases) {
  bool first = true;
  for (const auto& phase : phases.items()) {
    const nlohmann::json& record = phase.value();
    std::string line = phase.key() + ":";
    if (record.is_object() && record.contains("coefficients") && record["coefficients"].is_object()) {
      std::string values;
      for (const auto& c : record["coefficients"].items()) {
        char value[64];
        std::snprintf(value, sizeof value, "%g", c.value().is_number() ? c.value().get<double>() : NAN);
        values += (values.empty() ? " " : ", ") + c.key() + " = " + value;
      }
      line += values + " bytes";
      if (record.contains("max_rel_error") && record["max_rel_error"].is_number()) {
        char error[64];
        std::snprintf(error, sizeof error, " (max error %+.2f %%", 100 * record["max_rel_error"].get<double>());
        line += error;
        if (record.contains("fitted_points")) line += " over " + scalar_text(record["fitted_points"]) + " shapes";
        line += ")";
      }
    }
    os << (first ? "phases        " : "              ") << line << "\n";
    first = false;
  }
}

// One line per metadata entry: the fit's report, objects' scalar fields, scalars.
void print_metadata_text(std::ostream& os, const nlohmann::json& metadata) {
  auto label = [](const std::string& key) {  // "key" padded to the value column
    return key + std::string(key.size() < 14 ? 14 - key.size() : 1, ' ');
  };
  for (const auto& item : metadata.items()) {
    const nlohmann::json& v = item.value();
    if (item.key() == "fit" && v.is_object()) {  // the fit's one-paragraph report
      if (v.contains("brief_report") && v["brief_report"].is_string()) {
        os << "fit           " << v["brief_report"].get<std::string>() << "\n";
      }
      std::string line;
      for (const char* key : {"fitted_to", "points", "below_floor_not_fitted", "infeasible_probes",
                              "usable"}) {
        if (v.contains(key) && !v[key].is_structured()) {
          line += (line.empty() ? "" : ", ") + std::string(key) + " " + scalar_text(v[key]);
        }
      }
      if (!line.empty()) os << "              " << line << "\n";
    } else if (item.key() == "phases" && v.is_object()) {
      print_phases_text(os, v);
    } else if (v.is_object()) {
      std::string line;
      for (const auto& sub : v.items()) {
        if (sub.value().is_structured()) continue;  // lists such as rel_errors: see --json
        line += (line.empty() ? "" : ", ") + sub.key() + " " + scalar_text(sub.value());
      }
      os << label(item.key()) << line << "\n";
    } else if (!v.is_array()) {
      os << label(item.key()) << scalar_text(v);
      if (v.is_number() && item.key().size() > 6 &&
          item.key().compare(item.key().size() - 6, 6, "_bytes") == 0) {
        os << " (" << mib_text(v.get<double>()) << ")";
      }
      os << "\n";
    }
  }
}

std::string metadata_string(const nlohmann::json& metadata, const std::string& key) {
  return metadata.contains(key) && metadata[key].is_string() ? metadata[key].get<std::string>() : "";
}

// The probe table's byte columns: the known ones, other byte fields (a CSV fit's fitted column),
// and the fitted and floor columns whatever their names (a CSV's "fb", "opt").
std::vector<std::string> probe_columns(const nlohmann::json& probes, const std::string& fitted_to,
                                       const std::string& floor_from) {
  std::vector<std::string> columns;
  const auto present = [&](const std::string& c) {
    return std::any_of(probes.begin(), probes.end(), [&](const nlohmann::json& p) { return p.contains(c); });
  };
  for (const char* c : kProbeColumns) {
    if (present(c)) columns.push_back(c);
  }
  for (const auto& p : probes) {
    for (const auto& item : p.items()) {
      const std::string& k = item.key();
      if (item.value().is_number() && k.size() > 5 && k.find("bytes") != std::string::npos &&
          std::find(columns.begin(), columns.end(), k) == columns.end()) {
        columns.push_back(k);
      }
    }
  }
  for (const std::string& c : {fitted_to, floor_from}) {
    if (!c.empty() && std::find(columns.begin(), columns.end(), c) == columns.end() && present(c)) {
      columns.push_back(c);
    }
  }
  return columns;
}

std::string short_column_name(std::string c) {
  const std::string suffix = "_peak_bytes";
  if (c.size() > suffix.size() && c.compare(c.size() - suffix.size(), suffix.size(), suffix) == 0) {
    c = c.substr(0, c.size() - suffix.size());
  }
  return c;
}

int column_width(const std::string& c) {
  return std::max<int>(14, static_cast<int>(short_column_name(c).size()) + 2);
}

// The probes, each with its byte columns, the prediction and its error: against the step peak,
// or the larger of the fitted and floor columns without one; for a probe that ran out of memory
// under the recorded cap, whether the model predicts it above the cap ("> cap") or, wrongly,
// under it ("UNDER cap").
void print_probes_text(std::ostream& os, const ShownModel& shown) {
  const xpm::MemoryModel& model = shown.model;
  const nlohmann::json& probes = shown.probes;
  if (probes.empty()) {
    os << "probes        none recorded\n";
    return;
  }
  std::size_t infeasible = 0;
  for (const auto& p : probes) infeasible += p.value("feasible", true) ? 0 : 1;
  os << "probes        " << probes.size() << " (" << infeasible
     << " out of memory); bytes, predicted = max(floor, formula)\n";
  const std::string floor_from = metadata_string(shown.metadata, "floor_from");  // `fit --floor-column`
  const double capacity = shown.metadata.contains("capacity_bytes") && shown.metadata["capacity_bytes"].is_number()
                              ? shown.metadata["capacity_bytes"].get<double>()
                              : 0.0;
  const std::string fitted_to =
      shown.metadata.contains("fit") ? metadata_string(shown.metadata["fit"], "fitted_to") : "";
  const std::vector<std::string> columns = probe_columns(probes, fitted_to, floor_from);
  os << " ";
  for (const auto& v : model.formula().variable_names()) os << std::setw(7) << v;
  for (const auto& c : columns) os << std::setw(column_width(c)) << short_column_name(c);
  os << std::setw(14) << "predicted" << std::setw(10) << "error" << "  feasible\n";
  for (std::size_t i = 0; i < probes.size(); ++i) {
    const nlohmann::json& p = probes[i];
    os << " ";
    for (double d : shown.dims[i]) os << std::setw(7) << number_text(d);
    const double predicted = model.predict_bytes(shown.dims[i]);
    const bool feasible = p.value("feasible", true);
    for (const auto& c : columns) {  // out of memory: no peak measured
      os << std::setw(column_width(c))
         << (feasible && p.contains(c) && p[c].is_number() ? bytes_text(p[c].get<double>()) : std::string("-"));
    }
    os << std::setw(14) << bytes_text(predicted);
    const auto number_of = [&](const std::string& c) {
      return !c.empty() && p.contains(c) && p[c].is_number() ? p[c].get<double>() : 0.0;
    };
    const double reference = p.contains("step_peak_bytes")
                                 ? number_of("step_peak_bytes")
                                 : std::max(number_of(fitted_to), number_of(floor_from));
    if (!feasible && capacity > 0) {  // an out-of-memory probe is an upper bound
      os << std::setw(10) << (predicted > capacity ? "> cap" : "UNDER cap");
    } else if (feasible && reference > 0) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%+.4f%%", (predicted - reference) / reference * 100);
      os << std::setw(10) << buf;
    } else {
      os << std::setw(10) << "-";
    }
    os << "  " << (feasible ? "yes" : "NO (out of memory)") << "\n";
  }
}

}  // namespace

int run_show(const po::variables_map& vm) {
  const ShownModel shown = load_shown_model(vm["model"].as<std::string>());
  if (vm["json"].as<bool>()) {
    std::cout << shown_json(shown).dump() << "\n";
    return 0;
  }
  print_model_text(std::cout, shown);
  print_metadata_text(std::cout, shown.metadata);
  print_probes_text(std::cout, shown);
  return 0;
}

}  // namespace xpm_plan
