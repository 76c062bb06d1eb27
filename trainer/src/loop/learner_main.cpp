// learner_main.cpp — run_learner_main (see learner_main.hpp).
#include "xpm/trainer/loop/learner_main.hpp"

#include <csignal>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include <boost/program_options.hpp>
#include <c10/util/Exception.h>

#include "xpm/planner_torch/device_meter.hpp"
#include "xpm/trainer/distributed/local_launcher.hpp"
#include "xpm/trainer/loop/error_context.hpp"

namespace xpm {
namespace {

namespace po = boost::program_options;

constexpr int kExitStoppedBySignal = 4;

struct SharedFlags {
  std::string run_dir, device = "cpu", backend = "auto";
  std::int64_t steps = 0, stop_after_steps = 0, memory_cap_bytes = 0, seed = 1;
  int nproc = 1, threads = 1;
  bool resume = false;
};

po::options_description describe_flags(const LearnerProgram& program, SharedFlags& shared,
                                       std::map<std::string, std::string>& extras) {
  shared.memory_cap_bytes = program.default_memory_cap_bytes;
  po::options_description flags(program.name + (program.description.empty() ? "" : ": " + program.description));
  flags.add_options()("help", "this text")
      ("run-dir", po::value(&shared.run_dir), "run folder (default: the program's)")
      ("steps", po::value(&shared.steps)->default_value(0), "optimizer steps (0: the program's)")
      ("stop-after-steps", po::value(&shared.stop_after_steps)->default_value(0), "stop with a checkpoint after step N")
      ("resume", po::bool_switch(&shared.resume), "continue from the newest valid checkpoint")
      ("memory-cap-bytes", po::value(&shared.memory_cap_bytes)->default_value(shared.memory_cap_bytes),
       "the memory cap in bytes (a whole number) the plan and the steps run under; 0: none (on a GPU, the "
       "device's memory; on the CPU a memory plan needs one)")
      ("device", po::value(&shared.device)->default_value("cpu"), "cpu, cuda (cuda:LOCAL_RANK) or cuda:N")
      ("backend", po::value(&shared.backend)->default_value("auto"), "auto, gloo or nccl (auto: nccl on CUDA)")
      ("nproc", po::value(&shared.nproc)->default_value(1), "local worker processes")
      ("threads", po::value(&shared.threads)->default_value(1), "LibTorch threads per process")
      ("seed", po::value(&shared.seed)->default_value(1), "torch::manual_seed before the model is built");
  for (const auto& [name, fallback] : program.extra_flags) {
    flags.add_options()(name.c_str(), po::value(&extras[name])->default_value(fallback), "the program's own");
  }
  return flags;
}

void check_shared_flags(const SharedFlags& shared) {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(shared.steps >= 0, "--steps must be >= 0, got " + std::to_string(shared.steps));
  require(shared.stop_after_steps >= 0, "--stop-after-steps must be >= 0, got " + std::to_string(shared.stop_after_steps));
  require(shared.memory_cap_bytes >= 0, "--memory-cap-bytes must be >= 0, got " + std::to_string(shared.memory_cap_bytes));
  require(shared.nproc >= 1, "--nproc must be >= 1, got " + std::to_string(shared.nproc));
  require(shared.threads >= 1, "--threads must be >= 1, got " + std::to_string(shared.threads));
}

DistributedContext make_context(const std::optional<WorkerEnvironment>& worker, const SharedFlags& shared,
                                const torch::Device& device) {
  DistributedOptions options;
  options.backend = parse_collective_backend(shared.backend, "--backend");
  if (options.backend == CollectiveBackend::kAuto) {
    options.backend = device.is_cuda() ? CollectiveBackend::kNccl : CollectiveBackend::kGloo;
  }
  options.validate();
  return worker ? DistributedContext(*worker, options) : DistributedContext();
}

void apply_flags(LearnerOptions& options, const SharedFlags& shared, const std::map<std::string, std::string>& flags,
                 const std::optional<WorkerEnvironment>& worker, const torch::Device& device) {
  if (!shared.run_dir.empty()) options.run_dir = shared.run_dir;
  if (shared.steps > 0) options.max_steps = shared.steps;
  options.stop_after_steps = shared.stop_after_steps;
  options.resume = shared.resume || (worker && worker->restart_count > 0);
  options.device = device;
  if (options.stop_signals.empty()) options.stop_signals = {SIGINT, SIGTERM};
  for (const auto& [name, value] : flags) {
    if (!options.config.contains(name)) options.config[name] = value;
  }
}

// `build()`'s value; an out-of-memory error while the model, its optimizer and the Learner are
// built is the cap's: too small for the model itself (bad input, not an internal error).
template <typename Build>
auto under_the_cap(const SharedFlags& shared, Build build) -> decltype(build()) {
  try {
    return build();
  } catch (const c10::OutOfMemoryError& error) {
    throw std::invalid_argument("--memory-cap-bytes " + std::to_string(shared.memory_cap_bytes) +
                                ": the model and its optimizer alone run out of memory under it, before any "
                                "step (" + error.what_without_backtrace() + ")");
  }
}

int train(const LearnerProgram& program, const SharedFlags& shared, const std::map<std::string, std::string>& flags) {
  const auto worker = WorkerEnvironment::from_environment();
  const torch::Device device = training_device(shared.device, "--device", worker ? worker->local_rank : 0);
  torch::set_num_threads(shared.threads);
  DistributedContext dist = make_context(worker, shared, device);
  const std::shared_ptr<MemoryMeter> meter = make_device_meter(device, shared.memory_cap_bytes);
  torch::manual_seed(static_cast<std::uint64_t>(shared.seed));
  LearnerRun run{device, &dist, flags};
  LearnerJob job = under_the_cap(shared, [&] { return program.make_job(run); });
  if (!job.task || !job.optimizer) throw std::logic_error(program.name + ": make_job returned no task or no optimizer");
  apply_flags(job.options, shared, flags, worker, device);
  if (job.options.memory_plan && device.is_cpu() && shared.memory_cap_bytes == 0) {
    throw std::invalid_argument("--memory-cap-bytes is 0: on the CPU the memory plan needs a cap, the bytes the "
                                "probes and the steps run under (e.g. --memory-cap-bytes 200000000)");
  }
  LearnerComponents parts;
  parts.dist = &dist;
  parts.meter = meter.get();
  const std::unique_ptr<Learner> learner = under_the_cap(
      shared, [&] { return std::make_unique<Learner>(*job.task, *job.optimizer, job.options, parts); });
  const LearnerOutcome outcome = learner->run();
  if (dist.is_main()) {
    if (program.report) {
      program.report(outcome, job);
    } else {
      std::cout << outcome.brief_report() << std::endl;
    }
  }
  return outcome.stopped_by_signal ? kExitStoppedBySignal : 0;
}

}  // namespace

const std::string& LearnerRun::flag(const std::string& name) const {
  const auto it = flags.find(name);
  if (it == flags.end()) throw std::invalid_argument("no flag --" + name + " in this program");
  return it->second;
}

int run_learner_main(int argc, char** argv, const LearnerProgram& program) {
  try {
    if (!program.make_job) throw std::logic_error("LearnerProgram.make_job is not set");
    SharedFlags shared;
    std::map<std::string, std::string> extras;
    const po::options_description flags = describe_flags(program, shared, extras);
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(flags).run(), vm);
    if (vm.count("help")) {
      std::cout << flags << std::endl;
      return 0;
    }
    po::notify(vm);
    check_shared_flags(shared);
    if (shared.nproc > 1 && !WorkerEnvironment::from_environment()) {
      LocalLaunchOptions launch;
      launch.nproc = shared.nproc;
      return launch_local_workers(std::vector<std::string>(argv + 1, argv + argc), launch);
    }
    return train(program, shared, extras);
  } catch (const po::error& error) {
    std::cerr << program.name << ": error: " << error.what() << std::endl;
    return exit_code_of(ErrorKind::kBadInput);
  } catch (...) {
    const ErrorDescription error = describe_current_exception();
    std::cerr << program.name << ": error: " << error.line << std::endl;
    return error.kind == ErrorKind::kBadInput ? exit_code_of(ErrorKind::kBadInput) : 3;
  }
}

}  // namespace xpm
