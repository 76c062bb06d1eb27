// xpm-plan shared pieces (see common.hpp).
#include "common.hpp"

#include <filesystem>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>


#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner/budget.hpp"
#include "xpm/planner/dims_text.hpp"

namespace xpm_plan {

std::string first_line(const std::string& text) {
  const auto end = text.find_first_of("\r\n");
  return end == std::string::npos ? text : text.substr(0, end);
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> split_list(const std::string& text, const std::string& option) {
  std::vector<std::string> items;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) throw InputError("--" + option + ": empty item in '" + text + "'");
    items.push_back(item);
  }
  if (items.empty()) throw InputError("--" + option + ": expected a comma-separated list");
  const std::string whole = trim(text);
  if (whole.back() == ',') throw InputError("--" + option + ": empty item in '" + text + "'");  // getline drops it
  return items;
}

double parse_number(const std::string& text, const std::string& what) {
  const std::string t = trim(text);
  double value = 0;
  auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), value);
  if (t.empty() || ec != std::errc() || ptr != t.data() + t.size() || !std::isfinite(value)) {
    throw InputError(what + ": '" + text + "' is not a finite number");
  }
  return value;
}

std::string dim_problem(double value, const std::string& text, const std::string& name,
                        bool count) {
  const std::string shown = text.empty() ? number_text(value) : trim(text);
  if (!std::isfinite(value)) return shown + " is not finite; dims must be finite numbers >= 0";
  if (value < 0) return shown + " is negative; dims must be >= 0";
  if (count && value == 0) {
    return shown + " is not a valid " + name +
           ": the batch-size variable counts records and must be > 0";
  }
  if (count && std::floor(value) != value) {
    return shown + " is not a valid " + name +
           ": the batch-size variable counts records and must be a whole number";
  }
  return "";
}

void check_dims(const std::vector<double>& dims, const std::vector<std::string>& names,
                std::size_t count_index, const std::string& where) {
  for (std::size_t v = 0; v < dims.size() && v < names.size(); ++v) {
    const std::string problem = dim_problem(dims[v], "", names[v], v == count_index);
    if (!problem.empty()) throw InputError(where + " " + names[v] + ": " + problem);
  }
}

std::map<std::string, double> parse_assignments(const std::vector<std::string>& args,
                                                const std::string& option) {
  std::map<std::string, double> out;
  for (const std::string& arg : args) {
    for (const std::string& item : split_list(arg, option)) {
      const auto eq = item.find('=');
      if (eq == std::string::npos) {
        throw InputError("--" + option + ": expected NAME=VALUE, got '" + item + "'");
      }
      const std::string name = trim(item.substr(0, eq));
      if (name.empty()) throw InputError("--" + option + ": empty name in '" + item + "'");
      if (out.count(name)) throw InputError("--" + option + ": '" + name + "' given twice");
      out[name] = parse_number(item.substr(eq + 1), "--" + option + " " + name);
    }
  }
  return out;
}

void add_budget_options(po::options_description& desc) {
  desc.add_options()
      ("capacity-bytes", po::value<std::string>()->required(),
       "device total memory or CPU cap, bytes, e.g. 196362432 or 2e8 (required)")
      ("memory-fraction", po::value<double>()->default_value(0.9, "0.9"),
       "share of capacity the plan may use, in (0, 1]")
      ("extra-overhead-bytes", po::value<std::string>()->default_value("0"),
       "bytes kept back for what probes don't see");
}

std::int64_t byte_count(const std::string& text, const std::string& option) {
  const double value = parse_number(text, option);
  if (std::floor(value) != value || std::fabs(value) > 9.0e18) {
    throw InputError(option + ": '" + text + "' is not a whole number of bytes");
  }
  return static_cast<std::int64_t>(value);
}

std::int64_t usable_bytes_from(const po::variables_map& vm) {
  xpm::MemoryBudget budget;
  budget.capacity_bytes = byte_count(vm["capacity-bytes"].as<std::string>(), "--capacity-bytes");
  budget.memory_fraction = vm["memory-fraction"].as<double>();
  budget.extra_overhead_bytes = byte_count(vm["extra-overhead-bytes"].as<std::string>(), "--extra-overhead-bytes");
  try {
    return budget.usable_bytes();
  } catch (const std::invalid_argument& e) {
    // "MemoryBudget: capacity_bytes must be > 0, got 0" -> "--capacity-bytes must be > 0, got 0"
    std::string message = first_line(e.what());
    const std::string prefix = "MemoryBudget: ";
    if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
    for (const char* field : {"capacity_bytes", "memory_fraction", "extra_overhead_bytes"}) {
      std::string option = std::string("--") + field;
      std::replace(option.begin(), option.end(), '_', '-');
      for (auto pos = message.find(field); pos != std::string::npos; pos = message.find(field)) {
        message.replace(pos, std::strlen(field), option);
      }
    }
    throw InputError("budget: " + message);
  }
}

nlohmann::json budget_json(const po::variables_map& vm) {
  return {{"capacity_bytes", byte_count(vm["capacity-bytes"].as<std::string>(), "--capacity-bytes")},
          {"memory_fraction", vm["memory-fraction"].as<double>()},
          {"extra_overhead_bytes", byte_count(vm["extra-overhead-bytes"].as<std::string>(), "--extra-overhead-bytes")},
          {"usable_bytes", usable_bytes_from(vm)}};
}

std::string bytes_text(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f", bytes);
  return buf;
}

std::string mib_text(double bytes) {
  char buf[64];
  const double mib = bytes / (1024.0 * 1024.0);
  if (std::fabs(mib) >= 1024.0 * 10) {
    std::snprintf(buf, sizeof buf, "%.1f GiB", mib / 1024.0);
  } else if (std::fabs(mib) >= 0.1) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", mib);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f KiB", bytes / 1024.0);
  }
  return buf;
}

std::string number_text(double value) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof buf, value);
  if (ec != std::errc()) return "?";
  return std::string(buf, ptr);
}

std::string dims_text(const xpm::MemoryModel& model, const std::vector<double>& dims) {
  return xpm::dims_text(model.formula().variable_names(), dims);
}

nlohmann::json dims_json(const xpm::MemoryModel& model, const std::vector<double>& dims) {
  nlohmann::json j = nlohmann::json::object();
  const auto& vars = model.formula().variable_names();
  for (std::size_t v = 0; v < vars.size() && v < dims.size(); ++v) j[vars[v]] = dims[v];
  return j;
}

xpm::MemoryModel load_model(const std::string& path) {
  try {
    return xpm::MemoryModel::load(path);
  } catch (const std::exception& e) {
    throw InputError("--model: " + first_line(e.what()));
  }
}

void write_file_atomically(const std::string& path, const std::string& text) {
  xpm::write_file_atomically(path, text);
}

std::string read_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw InputError(what + ": '" + path + "' is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + ": cannot read '" + path + "': " + std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) throw InputError(what + ": error while reading '" + path + "'");
  return os.str();
}

}  // namespace xpm_plan

namespace xpm_plan {

std::vector<std::string> coefficient_terms(const xpm::CostFormula& formula) {
  const auto& coefs = formula.coefficient_names();
  const auto& vars = formula.variable_names();
  std::vector<std::string> terms(coefs.size());
  if (!formula.is_linear()) return terms;  // max(...), l^p: no single term per coefficient
  for (const xpm::Monomial& m : formula.monomials()) {
    if (m.coefficient < 0 || static_cast<std::size_t>(m.coefficient) >= coefs.size()) continue;
    std::string product;
    for (std::size_t v = 0; v < vars.size() && v < m.powers.size(); ++v) {
      if (m.powers[v] == 0) continue;
      product += (product.empty() ? "" : "*") + vars[v];
      if (m.powers[v] > 1) product += "^" + std::to_string(m.powers[v]);
    }
    double factor = m.factor;
    std::string& term = terms[static_cast<std::size_t>(m.coefficient)];
    const bool negative = factor < 0;
    factor = std::fabs(factor);
    std::string text;
    if (factor != 1 || product.empty()) text = number_text(factor);
    if (!product.empty()) text += (text.empty() ? "" : "*") + product;
    if (term.empty()) {
      term = (negative ? "-" : "") + text;
    } else {
      term += (negative ? " - " : " + ") + text;
    }
  }
  return terms;
}

std::string coefficient_unit(const std::string& term, bool linear) {
  if (!linear) return "";
  if (term.empty() || term == "1") return "bytes";
  const bool compound = term.find(' ') != std::string::npos;
  return "bytes per " + (compound ? "(" + term + ")" : term);
}

std::string coefficient_text(double value, const std::string& term, bool linear) {
  char buf[64];
  std::snprintf(buf, sizeof buf, std::fabs(value) >= 1e5 && std::fabs(value) < 1e15 ? "%.0f" : "%.6g",
                value);
  const std::string unit = coefficient_unit(term, linear);
  return unit.empty() ? std::string(buf) : std::string(buf) + " " + unit;
}

nlohmann::json extrapolation_json(const xpm::MemoryModel& model, const std::vector<double>& dims) {
  nlohmann::json out = nlohmann::json::array();
  for (const xpm::Extrapolation& e : model.extrapolation(dims)) {
    out.push_back({{"variable", e.variable},
                   {"value", e.value},
                   {"probed_min", e.probed_min},
                   {"probed_max", e.probed_max},
                   {"description", e.describe()}});
  }
  return out;
}

std::string extrapolation_text(const xpm::MemoryModel& model, const std::vector<double>& dims) {
  std::string out;
  for (const xpm::Extrapolation& e : model.extrapolation(dims)) {
    out += (out.empty() ? "; extrapolated: " : ", ") + e.describe();
  }
  return out;
}

namespace {

// Whether two paths name one file: the same file when both exist, else the same normalised path.
bool same_file(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec);
  return fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
}

}  // namespace

void check_written_files(const std::vector<std::pair<std::string, std::string>>& outputs,
                         const std::vector<std::pair<std::string, std::string>>& inputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const auto& [option, path] = outputs[i];
    if (path.empty()) throw InputError(option + " is empty: give the name of the file to write");
    for (const auto& [read_option, read_path] : inputs) {
      if (same_file(path, read_path)) {
        throw InputError(option + " '" + path + "' is " + read_option + ": writing it would lose it; "
                         "give another file name");
      }
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (same_file(path, outputs[j].second)) {
        throw InputError(outputs[j].first + " and " + option + " name one file, '" + path + "': give two file names");
      }
    }
  }
}

std::string option_names(std::string text) {
  static const std::vector<std::pair<std::string, std::string>> renamed = {
      {"FitOptions::usable_max_rel_error", "--usable-max-rel-error"},
      {"FitOptions::initial_values", "--initial"},
      {" but non_negative is set", " but coefficients are >= 0 without --allow-negative"},
      {"MemoryModel: floor_bytes", "--floor-bytes"},
      {"MemoryModel: batch-size variable", "--batch-size-variable"},
      {"MemoryModel: aggregation given for", "--aggregation given for"},
      {"MemoryModel: the batch-size variable", "--batch-size-variable"}};
  for (const auto& [from, to] : renamed) {
    for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
      text.replace(at, from.size(), to);
    }
  }
  return text;
}

}  // namespace xpm_plan
