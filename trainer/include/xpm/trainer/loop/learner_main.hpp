// xpm/trainer/loop/learner_main.hpp — what every training program around a Learner repeats, in one
// call: the shared command-line flags, `--nproc N` (N local workers), torchrun's environment,
// the device and its memory meter installed before the model, resume after a restart, the
// report, and exit codes.
//
//   int main(int argc, char** argv) {
//     xpm::LearnerProgram program;
//     program.name = "my-trainer";
//     program.extra_flags = {{"data-dir", "data/brown"}};
//     program.make_job = [](const xpm::LearnerRun& run) {       // on every rank, after the meter
//       auto task = std::make_unique<MyTask>(run.flag("data-dir"), run.device);
//       auto optimizer = std::make_unique<torch::optim::Adam>(task->module().parameters(), 2e-3);
//       xpm::LearnerOptions options = xpm::LearnerOptions().set_outer_batch_size(64);
//       options.memory_plan = xpm::MemoryPlanOptions(formula).set_variable_max({{"bs", 64}, {"l", 256}});
//       return xpm::LearnerJob{std::move(task), std::move(optimizer), options};
//     };
//     return xpm::run_learner_main(argc, argv, program);
//   }
//
// Flags (each overrides the job's LearnerOptions): --run-dir, --steps (max_steps; the epochs
// still bound the run: set epochs high for a step budget), --stop-after-steps, --resume,
// --memory-cap-bytes (the meter's cap; on the CPU a memory plan needs one, else the budget is
// refused; on CUDA 0 is the device's memory), --device cpu|cuda|cuda:N ("cuda" is
// cuda:LOCAL_RANK; it decides LearnerOptions::device), --backend auto|gloo|nccl (auto: nccl on
// CUDA, gloo on the CPU), --nproc, --threads (torch::set_num_threads), --seed
// (torch::manual_seed before make_job), --help; plus the program's extra_flags, all taking a
// value, which also go into LearnerOptions::config (what a resume compares). A worker started
// again by a launcher (TORCHELASTIC_RESTART_COUNT > 0) resumes.
//
// Exit codes: 0 done (also stopped by --stop-after-steps), 2 bad input (one line on stderr:
// "<name>: error: ..."), 3 any other error, 4 stopped by a signal (SIGINT, SIGTERM; a
// checkpoint was written). Rank 0 prints LearnerOutcome::brief_report() at the end.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/loop/learner.hpp"

namespace xpm {

/// What make_job gets: the device the meter measures, the job's collectives, the flags.
struct LearnerRun {
  torch::Device device = torch::kCPU;
  DistributedContext* dist = nullptr;         // world size 1 without a launcher
  std::map<std::string, std::string> flags;   // the program's extra_flags' values, by name without "--"
  /// The value of the program's flag `name`; throws std::invalid_argument for a name that is
  /// not one of its extra_flags.
  const std::string& flag(const std::string& name) const;
};

/// What a program trains: its task (with its model on run.device), optimizer and options.
struct LearnerJob {
  std::unique_ptr<TrainingTask> task;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  LearnerOptions options;
};

struct LearnerProgram {
  std::string name = "xpm-learner";                   // in error lines and --help
  std::string description;                            // --help's first line
  std::map<std::string, std::string> extra_flags;     // the program's own flags and defaults
  std::int64_t default_memory_cap_bytes = 0;          // --memory-cap-bytes' default (0: none)
  std::function<LearnerJob(const LearnerRun& run)> make_job;
  /// Rank 0, after the run; default: prints outcome.brief_report() to std::cout.
  std::function<void(const LearnerOutcome& outcome, const LearnerJob& job)> report;
};

/// Runs `program` as described above and returns the process's exit code. Every rank calls it
/// (with --nproc N the first process only launches the workers and waits for them).
int run_learner_main(int argc, char** argv, const LearnerProgram& program);

}  // namespace xpm
