// report_common.hpp — helpers of bench-report: number formatting for Markdown tables, Google
// Benchmark JSON access, and the generated sections of docs/benchmarks.md.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xpm_bench {

/// 1234567.8 -> "1,234,568" (rounded to an integer, thousands separated).
std::string thousands(double value);
/// A duration in seconds as "12.3 µs", "4.56 ms", "0.123 s" (3 significant digits).
std::string duration(double seconds);
/// printf-style formatting into a std::string.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

/// One Google Benchmark result: name split at '/', time in seconds, counters.
struct BenchmarkRow {
  std::string name;                        // full name, e.g. BM_Packer_FFD/brown/quadratic/64
  std::vector<std::string> parts;          // name split at '/'
  double cpu_s = 0;                        // CPU time per iteration, seconds
  double real_s = 0;                       // wall time per iteration, seconds
  std::map<std::string, double> counters;  // user counters and items_per_second
  double counter(const std::string& key) const;  // throws std::out_of_range naming the key
};

/// The "benchmarks" of a Google Benchmark JSON file (--benchmark_out_format=json), aggregates
/// skipped. Throws std::runtime_error naming the path when unreadable or not that format.
std::vector<BenchmarkRow> read_benchmark_rows(const std::string& path);

/// The context block of a Google Benchmark JSON file ({} when absent).
nlohmann::json read_benchmark_context(const std::string& path);

/// Replaces the text between "<!-- bench-report:NAME begin -->" and
/// "<!-- bench-report:NAME end -->" in `document` by `body` (markers kept). Throws
/// std::runtime_error naming NAME when the markers are missing.
std::string replace_section(const std::string& document, const std::string& name, const std::string& body);

}  // namespace xpm_bench
