// Runs of xpm-train as users run them (`xpm-train --nproc N` on the real corpus) for the
// data-parallel and sharding tests: run, read its parameters and its step lines.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "scratch_folders.hpp"

namespace xpm_train_runs {

const std::string kTrain = std::string(XPM_BINARY_DIR) + "/bin/xpm-train";
const std::string kData = std::string(XPM_SOURCE_DIR) + "/data/brown";
const std::string kWork = std::string(XPM_BINARY_DIR) + "/tests/ddp";

// kWork/NAME (a run folder or a log), removed when the running test case passes, kept if it fails.
inline std::string scratch(const std::string& name) {
  const std::string path = kWork + "/" + name;
  xpm_test::remove_when_passed(path);
  return path;
}

struct Run {
  int exit_code = -1;
  std::string output;  // stdout and stderr
  double wall_s = 0;
};

// Runs xpm-train with `arguments` (and `environment`, "NAME=value ..."), capturing output. The
// log is removed when the test case passes; the caller registers the run folders it names.
inline Run run_train(const std::string& arguments, const std::string& environment = "") {
  std::filesystem::create_directories(kWork);
  // One log per run: CTest runs these cases as separate processes, possibly at the same time.
  static int runs = 0;  // one counter per test executable (inline function)
  const std::string log = kWork + "/run_" + std::to_string(::getpid()) + "_" + std::to_string(++runs) + ".log";
  xpm_test::remove_when_passed(log);
  const std::string command = environment + " '" + kTrain + "' --data-dir '" + kData + "' " +
                              arguments + " > '" + log + "' 2>&1";
  const auto start = std::chrono::steady_clock::now();
  const int status = std::system(command.c_str());
  Run run;
  run.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  run.output = text.str();
  return run;
}

inline std::map<std::string, torch::Tensor> load_parameters(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  std::map<std::string, torch::Tensor> out;
  for (const std::string& key : archive.keys()) {
    torch::Tensor tensor;
    archive.read(key, tensor);
    out[key] = tensor;
  }
  return out;
}

// The step lines of metrics.jsonl (validation lines, which carry a "validation" field and no
// per-rank counts, are left out).
inline std::vector<nlohmann::json> read_step_metrics(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json entry = nlohmann::json::parse(line);
    if (!entry.contains("validation")) out.push_back(std::move(entry));
  }
  return out;
}

// Small, fast, deterministic: no dropout, a tight cap (1.8 x static memory: several microbatches
// per step), a shared memory-model cache (one automatic probe design per world size).
const std::string kCommon =
    "--dropout 0 --memory-cap-factor 1.8 --threads 1 --max-validation-sentences 200 "
    "--warmup-steps 2 --memory-model-cache '" + kWork + "/cache' ";

}  // namespace xpm_train_runs

namespace xpm_train_runs {

// sqrt(sum |a - b|^2 / sum |a|^2) over every tensor of two parameter files with the same names.
inline double relative_parameter_difference(const std::map<std::string, torch::Tensor>& a,
                                            const std::map<std::string, torch::Tensor>& b) {
  double diff2 = 0, norm2 = 0;
  for (const auto& [name, tensor] : a) {
    const torch::Tensor& other = b.at(name);
    diff2 += (tensor - other).pow(2).sum().item<double>();
    norm2 += tensor.pow(2).sum().item<double>();
  }
  return std::sqrt(diff2 / norm2);
}

// summary.json of a run folder.
inline nlohmann::json read_summary(const std::string& run_dir) {
  std::ifstream in(run_dir + "/summary.json");
  return nlohmann::json::parse(in);
}

}  // namespace xpm_train_runs
