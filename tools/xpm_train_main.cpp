// xpm-train — trains the bundled task (part-of-speech tagging of the Brown corpus with a small
// Transformer or BiLSTM) with memory planned by xpm's predictive batcher, or, for comparison,
// with the fixed or power-adaptive batcher (--batcher). See `xpm-train --help`.
// Data-parallel: `--nproc N` starts N workers of this program; a worker started by torchrun (or
// by hand) reads RANK, WORLD_SIZE, ... (docs/distributed.md).
// Exit codes: 0 success; 1 the run failed (out of memory where no batcher can help, a rank died
// or a collective timed out, a file could not be written); 2 bad input (option, config, data,
// checkpoint settings); 3 internal error (a LibTorch error other than out of memory, a bug);
// 4 stopped by a signal after a step, with a checkpoint. Under --nproc: the first failing
// worker's code, after up to --max-restarts restarts of the group from the newest checkpoint. Errors are one line, "xpm-train: error: ..."
// ("xpm-train: rank R: error: ..." from a worker of several), saying where (step 12, probing at
// bs=8 l=64, validation after step 40, checkpoint write of step 40, resume); with codes 1 and 3
// the full text (LibTorch's backtrace included) goes to RUN_DIR/error.log (error-rank<R>.log
// from rank R > 0).
// Options and the --config file: xpm_train_config.hpp.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/loop/error_context.hpp"
#include "xpm/trainer/loop/hooks.hpp"
#include "xpm/trainer/distributed/local_launcher.hpp"
#include "xpm/tasks/tagging_job.hpp"
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
  std::string line = xpm::with_option_names(error.line);
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

// Fault injection for the tests of failing ranks: XPM_FAULT_EXIT_AT=R:S makes rank R exit
// (code 17) at the start of step S; XPM_FAULT_EXIT_AT=R:S:kill makes it kill itself with
// SIGKILL there instead. Only in the first XPM_FAULT_ATTEMPTS attempts of a restarted group
// (default 1: a restart gets past the fault).
class FaultInjectionHook : public xpm::StepTrainingHook {
 public:
  FaultInjectionHook(int rank, long long step, bool kill) : rank_(rank), step_(step), kill_(kill) {}
  std::string name() const override { return "fault-injection"; }
  void before_step(xpm::TrainerContext& context) override {
    if (context.state().step + 1 != step_) return;
    std::cerr << "xpm-train: rank " << rank_ << ": XPM_FAULT_EXIT_AT: " << (kill_ ? "killing myself" : "exiting")
              << " at step " << step_ << " (test hook)" << std::endl;
    if (kill_) ::kill(::getpid(), SIGKILL);
    std::_Exit(17);
  }

 private:
  int rank_;
  long long step_;
  bool kill_;
};

long long positive_environment_number(const char* name, long long fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  long long value = 0;
  char tail = 0;
  if (std::sscanf(text, "%lld%c", &value, &tail) != 1 || value < 1) {
    throw std::invalid_argument("environment variable " + std::string(name) + "='" + text +
                                "' must be a whole number >= 1");
  }
  return value;
}

// The hook XPM_FAULT_EXIT_AT asks for on this rank; null when it names another rank, is unset,
// or this attempt is past XPM_FAULT_ATTEMPTS.
std::shared_ptr<FaultInjectionHook> fault_injection_hook(int this_rank,
                                                         const std::optional<xpm::WorkerEnvironment>& worker) {
  const char* text = std::getenv("XPM_FAULT_EXIT_AT");
  if (text == nullptr) return nullptr;
  long long rank = -1, step = -1;
  char mode[8] = {0}, tail = 0;
  const int fields = std::sscanf(text, "%lld:%lld:%7[a-z]%c", &rank, &step, mode, &tail);
  if (fields < 2 || fields > 3 || rank < 0 || step < 1 || (fields == 3 && std::string(mode) != "kill")) {
    throw std::invalid_argument("environment variable XPM_FAULT_EXIT_AT='" + std::string(text) +
                                "' must be RANK:STEP or RANK:STEP:kill with RANK >= 0 and STEP >= 1");
  }
  const long long attempts = positive_environment_number("XPM_FAULT_ATTEMPTS", 1);
  if (rank != this_rank || (worker ? worker->restart_count : 0) >= attempts) return nullptr;
  return std::make_shared<FaultInjectionHook>(this_rank, step, fields == 3);
}

// --max-restarts belongs to the launcher that restarts the workers: ours (which passes it on
// as TORCHELASTIC_MAX_RESTARTS) or torchrun's own --max-restarts.
void check_restart_limit(const xpm_train::TrainSettings& settings,
                         const std::optional<xpm::WorkerEnvironment>& worker) {
  if (!worker || settings.max_restarts == 0 || worker->max_restarts == settings.max_restarts) return;
  throw std::invalid_argument(
      "--max-restarts " + std::to_string(settings.max_restarts) +
      (worker->max_restarts ? " disagrees with TORCHELASTIC_MAX_RESTARTS=" + std::to_string(*worker->max_restarts) +
                                  " set by the launcher"
                            : " needs the --nproc launcher; a worker started by another launcher is restarted "
                              "by it (torchrun --max-restarts)"));
}

// Launcher: the workers run the same command line; they see RANK etc. and run as workers.
int launch_workers(int argc, char** argv, const xpm_train::TrainSettings& settings,
                   TrainProcess& process) {
  xpm::LocalLaunchOptions launch;
  launch.nproc = settings.nproc;
  launch.grace_s = settings.config.collective_timeout_s + 30;
  launch.max_restarts = settings.max_restarts;
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
  check_restart_limit(settings, worker);
  create_run_dir(process, config.run_dir);
  if ((settings.nproc > 1 || settings.max_restarts > 0) && !worker) {
    return launch_workers(argc, argv, settings, process);
  }
  if (worker && worker->world_size > 1) {
    process.who = "xpm-train: rank " + std::to_string(worker->rank) + ": error: ";
    process.rank = worker->rank;
  }
  if (worker) process.dist = xpm::DistributedContext(*worker, config.distributed_options());
  xpm::TaggingJobExtensions extensions;
  if (auto hook = fault_injection_hook(process.dist.rank(), worker)) extensions.hooks.add(hook);
  // A restarted group (ours or torchrun's) continues from the newest valid checkpoint.
  xpm::TaggingJobConfig job_config = config;
  extensions.restart_count = worker ? worker->restart_count : 0;
  if (extensions.restart_count > 0) job_config.resume = true;
  const nlohmann::json summary = xpm::run_tagging_job(job_config, process.dist, extensions);
  if (process.dist.is_main()) {
    remove_error_logs(config.run_dir);
    std::cout << "summary: " << config.run_dir << "/summary.json\n" << summary.dump(2) << "\n";
  }
  // Stopped by a signal with a checkpoint: a distinct code, so a scheduler's wrapper can requeue.
  return summary.value("interrupted", false) ? xpm::kInterruptedExitCode : 0;
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
