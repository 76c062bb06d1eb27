// metrics_lines.hpp — the optimizer-step lines of a run's metrics.jsonl (the Learner also writes
// validation lines there), for the benchmarks that compare runs. Header-only.
#pragma once

#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xpm_bench {

/// Every line of `path` holding "real_tokens" (a step line), parsed. Throws std::runtime_error
/// when the file cannot be read, nlohmann::json::parse_error for a line that is not JSON.
inline std::vector<nlohmann::json> read_step_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("real_tokens")) lines.push_back(std::move(j));
  }
  return lines;
}

}  // namespace xpm_bench
