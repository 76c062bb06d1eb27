// xpm-train — trains the bundled task (part-of-speech tagging of the Brown corpus with a small
// Transformer or BiLSTM) with memory planned by xpm's predictive batcher, or, for comparison,
// with the fixed or power-adaptive batcher (--batcher). See `xpm-train --help`.
// Data-parallel: `--nproc N` starts N workers of this program; a worker started by torchrun (or
// by hand) reads RANK, WORLD_SIZE, ... (docs/distributed.md).
// Exit codes: 0 success; 1 the run failed (out of memory where no batcher can help, a rank died
// or a collective timed out, a file could not be written); 2 bad input (option, config, data,
// checkpoint settings); 3 internal error (a LibTorch error other than out of memory, a bug).
// Under --nproc: the first failing worker's code. Errors are one line, "xpm-train: error: ..."
// ("xpm-train: rank R: error: ..." from a worker of several), saying where (step 12, probing at
// bs=8 l=64, validation after step 40, checkpoint write of step 40, resume); with codes 1 and 3
// the full text (LibTorch's backtrace included) goes to RUN_DIR/error.log (error-rank<R>.log
// from rank R > 0).
// Options and the --config file: xpm_train_config.hpp.
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/trainer/distributed.hpp"
#include "xpm/trainer/error_context.hpp"
#include "xpm/trainer/local_launcher.hpp"
#include "xpm/trainer/tagging_job.hpp"
#include "xpm_train_config.hpp"
#include "xpm_train_report.hpp"

namespace {

namespace fs = std::filesystem;

// What the error path needs to know about this process.
struct TrainProcess {
  std::string who = "xpm-train: error: ";  // "xpm-train: rank R: error: " in a world of several
  int rank = 0;                            // this worker's RANK
  std::string run_dir;                     // "" until the run folder exists
  bool run_dir_is_new = false;             // this invocation created it
  xpm::DistributedContext dist;            // single process until the worker joins its job
};

void create_run_dir(TrainProcess& process, const std::string& run_dir) {
  std::error_code error;
  process.run_dir_is_new = !fs::exists(run_dir, error);
  fs::create_directories(run_dir, error);
  if (error || !fs::is_directory(run_dir)) {
    throw std::invalid_argument("--run-dir '" + run_dir + "' cannot be created as a folder" +
                                (error ? ": " + error.message() : ""));
  }
  process.run_dir = run_dir;
}

// error.log, or error-rank<R>.log from rank R > 0 (every rank of a job may fail).
std::string error_log_path(const TrainProcess& process) {
  const std::string rank = std::to_string(process.rank);
  return process.run_dir + (process.rank == 0 ? "/error.log" : "/error-rank" + rank + ".log");
}

// A run that succeeds leaves no error log of an earlier failed one behind.
void remove_error_logs(const std::string& run_dir) {
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(run_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name == "error.log" || (name.rfind("error-rank", 0) == 0 && entry.path().extension() == ".log")) {
      fs::remove(entry.path(), error);
    }
  }
}

// The error path of every failure, in a catch block: one line on stderr, the other ranks told,
// the full text in the run folder (bad input: the line says it all, and a run folder this
// invocation created and left empty is removed).
int fail(TrainProcess& process) {
  const xpm::ErrorDescription error = xpm::describe_current_exception();
  std::string line = xpm_train::with_option_names(error.line);
  const std::string rank_prefix = "rank " + std::to_string(process.rank) + ": ";
  if (line.rfind(rank_prefix, 0) == 0) line.erase(0, rank_prefix.size());  // said by `who`
  std::cerr << process.who + line + "\n" << std::flush;  // one write: ranks share stderr
  process.dist.report_failure(line);
  std::error_code ignored;
  if (error.kind == xpm::ErrorKind::kBadInput || process.run_dir.empty()) {
    if (process.run_dir_is_new && fs::is_empty(process.run_dir, ignored) && !ignored) {
      fs::remove(process.run_dir, ignored);
    }
  } else {
    try {
      xpm::write_file_atomically(error_log_path(process),
                                 process.who + line + "\n\n" + error.full_text + "\n");
    } catch (const std::exception& log_error) {
      std::cerr << "xpm-train: warning: " << log_error.what() << std::endl;
    }
  }
  return xpm::exit_code_of(error.kind);
}

// Launcher: the workers run the same command line; they see RANK etc. and run as workers.
int launch_workers(int argc, char** argv, const xpm_train::TrainSettings& settings,
                   TrainProcess& process) {
  xpm::LocalLaunchOptions launch;
  launch.nproc = settings.nproc;
  launch.grace_s = settings.config.collective_timeout_s + 30;
  const int code = xpm::launch_local_workers(std::vector<std::string>(argv + 1, argv + argc), launch);
  std::error_code ignored;
  if (code != 0 && process.run_dir_is_new && fs::is_empty(process.run_dir, ignored) && !ignored) {
    fs::remove(process.run_dir, ignored);
  }
  return code;
}

int train(int argc, char** argv, TrainProcess& process) {
  const xpm_train::TrainSettings settings = xpm_train::parse_train_settings(argc, argv);
  if (settings.help) {
    std::cout << settings.help_text;
    return 0;
  }
  const xpm::TaggingJobConfig& config = settings.config;
  const std::optional<xpm::WorkerEnvironment> worker = xpm::WorkerEnvironment::from_environment();
  if (worker && settings.nproc > 1 && worker->world_size != settings.nproc) {
    throw std::invalid_argument("--nproc " + std::to_string(settings.nproc) + " disagrees with WORLD_SIZE=" +
                                std::to_string(worker->world_size) + " set by the launcher");
  }
  create_run_dir(process, config.run_dir);
  if (settings.nproc > 1 && !worker) return launch_workers(argc, argv, settings, process);
  if (worker && worker->world_size > 1) {
    process.who = "xpm-train: rank " + std::to_string(worker->rank) + ": error: ";
    process.rank = worker->rank;
  }
  if (worker) process.dist = xpm::DistributedContext(*worker, config.distributed_options());
  const nlohmann::json summary = xpm::run_tagging_job(config, process.dist);
  if (process.dist.is_main()) {
    remove_error_logs(config.run_dir);
    std::cout << "summary: " << config.run_dir << "/summary.json\n" << summary.dump(2) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // `xpm-train report RUN_DIR`: figures of a finished run (xpm_train_report.hpp).
  if (argc > 1 && std::string(argv[1]) == "report") {
    return xpm::run_train_report(argc - 1, argv + 1);
  }
  TrainProcess process;
  try {
    return train(argc, argv, process);
  } catch (...) {
    return fail(process);
  }
}
