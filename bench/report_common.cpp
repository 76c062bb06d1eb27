// report_common.cpp — see report_common.hpp.
#include "report_common.hpp"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace xpm_bench {

std::string thousands(double value) {
  const long long v = std::llround(value);
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string format(const char* fmt, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buffer, sizeof buffer, fmt, args);
  va_end(args);
  return buffer;
}

std::string duration(double seconds) {
  const char* unit = "s";
  double v = seconds;
  if (seconds < 1e-6) {
    v = seconds * 1e9;
    unit = "ns";
  } else if (seconds < 1e-3) {
    v = seconds * 1e6;
    unit = "µs";
  } else if (seconds < 1) {
    v = seconds * 1e3;
    unit = "ms";
  }
  const int decimals = v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return format("%.*f %s", decimals, v, unit);
}

double BenchmarkRow::counter(const std::string& key) const {
  auto it = counters.find(key);
  if (it == counters.end()) throw std::out_of_range("benchmark " + name + " has no counter '" + key + "'");
  return it->second;
}

namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& error) {
    throw std::runtime_error("'" + path + "' is not JSON: " + error.what());
  }
}

double to_seconds(double value, const std::string& unit) {
  if (unit == "ns") return value * 1e-9;
  if (unit == "us") return value * 1e-6;
  if (unit == "ms") return value * 1e-3;
  return value;
}

}  // namespace

std::vector<BenchmarkRow> read_benchmark_rows(const std::string& path) {
  const nlohmann::json j = read_json(path);
  if (!j.contains("benchmarks") || !j.at("benchmarks").is_array()) {
    throw std::runtime_error("'" + path + "' is not Google Benchmark JSON (no \"benchmarks\" array)");
  }
  static const std::map<std::string, bool> kNotCounters = {
      {"name", true}, {"run_name", true}, {"run_type", true}, {"repetitions", true},
      {"repetition_index", true}, {"threads", true}, {"iterations", true}, {"real_time", true},
      {"cpu_time", true}, {"time_unit", true}, {"family_index", true},
      {"per_family_instance_index", true}, {"aggregate_name", true}, {"aggregate_unit", true}};
  std::vector<BenchmarkRow> rows;
  for (const nlohmann::json& b : j.at("benchmarks")) {
    if (b.value("run_type", "iteration") != "iteration") continue;
    BenchmarkRow row;
    row.name = b.at("name");
    std::size_t start = 0;
    while (true) {
      const std::size_t slash = row.name.find('/', start);
      row.parts.push_back(row.name.substr(start, slash - start));
      if (slash == std::string::npos) break;
      start = slash + 1;
    }
    const std::string unit = b.value("time_unit", "ns");
    row.cpu_s = to_seconds(b.at("cpu_time").get<double>(), unit);
    row.real_s = to_seconds(b.at("real_time").get<double>(), unit);
    for (const auto& [key, value] : b.items()) {
      if (kNotCounters.count(key) == 0U && value.is_number()) row.counters[key] = value.get<double>();
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

nlohmann::json read_benchmark_context(const std::string& path) {
  const nlohmann::json j = read_json(path);
  return j.value("context", nlohmann::json::object());
}

std::string replace_section(const std::string& document, const std::string& name, const std::string& body) {
  const std::string begin = "<!-- bench-report:" + name + " begin -->";
  const std::string end = "<!-- bench-report:" + name + " end -->";
  const std::size_t b = document.find(begin);
  const std::size_t e = document.find(end);
  if (b == std::string::npos || e == std::string::npos || e < b) {
    throw std::runtime_error("docs: the markers '" + begin + "' and '" + end + "' are missing");
  }
  return document.substr(0, b + begin.size()) + "\n" + body + document.substr(e);
}

}  // namespace xpm_bench
