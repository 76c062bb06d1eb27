// xpm-train — trains the bundled task (part-of-speech tagging of the Brown corpus with a small
// Transformer or BiLSTM) with memory planned by xpm's predictive batcher, or, for comparison,
// with the fixed or power-adaptive batcher (--batcher). See `xpm-train --help`.
// Data-parallel: `--nproc N` starts N workers of this program; a worker started by torchrun (or
// by hand) reads RANK, WORLD_SIZE, ... (docs/distributed.md).
// Exit codes: 0 success, 2 bad input (option, config, data), 1 other failure. Under --nproc: the
// first failing worker's code. A worker's errors read "xpm-train: rank R: error: ...".
// Options and the --config file: xpm_train_config.hpp.
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "xpm/planner/formula.hpp"
#include "xpm/trainer/distributed.hpp"
#include "xpm/trainer/local_launcher.hpp"
#include "xpm/trainer/tagging_job.hpp"
#include "xpm_train_config.hpp"
#include "xpm_train_report.hpp"

using xpm_train::with_option_names;

int main(int argc, char** argv) {
  // `xpm-train report RUN_DIR`: figures of a finished run (xpm_train_report.hpp).
  if (argc > 1 && std::string(argv[1]) == "report") {
    return xpm::run_train_report(argc - 1, argv + 1);
  }
  xpm::TaggingJobConfig config;
  int nproc = 1;
  std::optional<xpm::WorkerEnvironment> worker;
  bool run_dir_is_new = false;  // this invocation created --run-dir
  // A run that fails before writing anything leaves no empty run folder behind.
  const auto remove_run_dir_if_unused = [&] {
    std::error_code ignored;
    if (run_dir_is_new && std::filesystem::is_empty(config.run_dir, ignored) && !ignored) {
      std::filesystem::remove(config.run_dir, ignored);
    }
  };
  try {
    const xpm_train::TrainSettings settings = xpm_train::parse_train_settings(argc, argv);
    if (settings.help) {
      std::cout << settings.help_text;
      return 0;
    }
    config = settings.config;
    nproc = settings.nproc;
    worker = xpm::WorkerEnvironment::from_environment();
    if (worker && nproc > 1 && worker->world_size != nproc) {
      throw std::invalid_argument("--nproc " + std::to_string(nproc) + " disagrees with WORLD_SIZE=" +
                                  std::to_string(worker->world_size) + " set by the launcher");
    }
    std::error_code run_dir_error;
    run_dir_is_new = !std::filesystem::exists(config.run_dir, run_dir_error);
    std::filesystem::create_directories(config.run_dir, run_dir_error);
    if (run_dir_error || !std::filesystem::is_directory(config.run_dir)) {
      throw std::invalid_argument("--run-dir '" + config.run_dir + "' cannot be created as a folder" +
                                  (run_dir_error ? ": " + run_dir_error.message() : ""));
    }
  } catch (const std::exception& error) {
    std::cerr << "xpm-train: error: " << with_option_names(error.what()) << "\n";
    return 2;
  }
  // Launcher: start the workers (same command line; they see RANK etc. and run as workers).
  if (nproc > 1 && !worker) {
    try {
      xpm::LocalLaunchOptions launch;
      launch.nproc = nproc;
      launch.grace_s = config.collective_timeout_s + 30;
      const int code = xpm::launch_local_workers(std::vector<std::string>(argv + 1, argv + argc), launch);
      if (code != 0) remove_run_dir_if_unused();
      return code;
    } catch (const std::exception& error) {
      std::cerr << "xpm-train: error: " << error.what() << "\n";
      remove_run_dir_if_unused();
      return 1;
    }
  }
  // A worker (or a single process): errors name the rank when there are several.
  const std::string who = worker && worker->world_size > 1
                              ? "xpm-train: rank " + std::to_string(worker->rank) + ": error: "
                              : std::string("xpm-train: error: ");
  xpm::DistributedContext dist;
  const auto fail = [&](std::string message, int code) {
    const std::string rank_prefix = "rank " + std::to_string(dist.rank()) + ": ";
    if (message.rfind(rank_prefix, 0) == 0) message.erase(0, rank_prefix.size());  // said by `who`
    std::cerr << who << message << std::endl;
    dist.report_failure(message);
    remove_run_dir_if_unused();
    return code;
  };
  try {
    if (worker) dist = xpm::DistributedContext(*worker, config.distributed_options());
    const nlohmann::json summary = xpm::run_tagging_job(config, dist);
    if (dist.is_main()) {
      std::cout << "summary: " << config.run_dir << "/summary.json\n" << summary.dump(2) << "\n";
    }
  } catch (const xpm::FormulaError& error) {
    return fail("--formula: " + error.brief(), 2);
  } catch (const std::invalid_argument& error) {
    return fail(with_option_names(error.what()), 2);
  } catch (const c10::Error& error) {  // LibTorch: the message without its C++ backtrace
    return fail(error.what_without_backtrace(), 1);
  } catch (const std::exception& error) {
    return fail(error.what(), 1);
  }
  return 0;
}
