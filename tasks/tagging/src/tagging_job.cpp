// run_tagging_job: data, model (initialization hooks, resumed parameters), static memory and
// cap, memory model (checkpoint, cache or probes), then the Learner (learner.hpp) over the tagging task
// and the summary.
#include "xpm/tasks/tagging_job.hpp"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include <torch/torch.h>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/device_meter.hpp"
#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/trainer/loop/error_context.hpp"
#include "xpm/trainer/steps/fixed_step_engines.hpp"
#include "xpm/trainer/distributed/gradient_buckets.hpp"
#include "xpm/trainer/loop/hook_library.hpp"
#include "xpm/trainer/loop/learner.hpp"
#include "xpm/trainer/state/learner_checkpoint.hpp"
#include "xpm/tasks/tagging_training_task.hpp"
#include "xpm/tasks/tagging_memory_plan.hpp"
#include "xpm/tasks/tagging_task.hpp"

namespace xpm {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::int64_t physical_memory_bytes() {
  return static_cast<std::int64_t>(::sysconf(_SC_PHYS_PAGES)) *
         static_cast<std::int64_t>(::sysconf(_SC_PAGE_SIZE));
}

// Intra-op threads per worker when --threads is 0: the host's hardware threads shared among the
// workers on this host, so N workers do not oversubscribe the cores.
int default_worker_threads(int local_world_size) {
  const int hardware = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  return std::max(1, hardware / std::max(1, local_world_size));
}

// The newest valid checkpoint of the run folder (every rank reads the one rank 0 chose), checked
// against the config; nullopt when there is none (the run starts at step 0).
std::optional<LearnerCheckpoint> find_job_checkpoint(const TaggingJobConfig& config, DistributedContext& dist,
                                                     const std::function<void(const std::string&)>& log) {
  std::optional<LearnerCheckpoint> checkpoint = find_resume_checkpoint(
      config.run_dir + "/checkpoints", config.checkpoint_settings(), dist, config.to_json(),
      tagging_settings_free_on_resume(),
      [](const std::string& warning) { std::cerr << "xpm-train: warning: " << warning << std::endl; });
  if (!checkpoint) {
    log("xpm-train: --resume: no valid checkpoint in " + config.run_dir + "/checkpoints; starting at step 0");
    return std::nullopt;
  }
  check_optimizer_loadable(*checkpoint, dist.world_size(), config.sharding);  // before anything is written
  log("xpm-train: resuming from " + checkpoint->info.path + " (step " + std::to_string(checkpoint->state.step) + ")");
  return checkpoint;
}

// The batchers without a memory model and unfreezing run in a single process: every rank
// refuses, before loading any data.
void check_job_config(const TaggingJobConfig& config, const DistributedContext& dist) {
  config.validate();
  if (config.batcher == BatcherKind::kPower) PowerAdaptativeBatcher::check_single_process(dist.world_size());
  if (config.batcher == BatcherKind::kFixed && dist.world_size() > 1) {
    throw std::invalid_argument(
        "TaggingJobConfig.batcher 'fixed' runs in a single process only, got world_size " +
        std::to_string(dist.world_size()) + ": the data-parallel step exists for the predictive "
        "batcher (TaggingJobConfig.batcher predictive, the default)");
  }
  if (config.freeze_until_step > 0 && dist.world_size() > 1) {
    throw std::invalid_argument(
        "TaggingJobConfig.freeze_until_step runs in a single process only, got world_size " +
        std::to_string(dist.world_size()) + ": the gradient buckets are laid out once, without the "
        "frozen parameters, so their gradients would never be all-reduced after unfreezing");
  }
}

// The corpus, split and encoded; a missing or malformed corpus is bad input. Checks what
// depends on the data (--stop-after-steps within the run, probe points within the model).
TaggingData load_job_data(const TaggingJobConfig& config) {
  TaggingData data = [&] {
    try {
      return load_tagging_data(config);
    } catch (const std::runtime_error& error) {
      throw std::invalid_argument(std::string("--data-dir: ") + error.what());
    }
  }();
  const std::int64_t total_steps = tagging_learner_options(config, {}).total_steps(data.train.size());
  if (config.stop_after_steps > total_steps) {
    throw std::invalid_argument("--stop-after-steps " + std::to_string(config.stop_after_steps) +
                                " is beyond the run's " + std::to_string(total_steps) +
                                " steps (--epochs, --max-steps): it would never stop the run");
  }
  const std::int64_t max_length = max_sequence_length(config, data);
  for (const ProbePoint& point : config.probe_points) {
    const double l = point.values.at("l");
    if (l > static_cast<double>(max_length)) {
      throw std::invalid_argument("--probe-points: l = " + std::to_string(static_cast<long long>(l)) +
                                  " is longer than the model's max length " + std::to_string(max_length));
    }
  }
  return data;
}

// A fresh run must not mix its checkpoints with an earlier run's (a later --resume would pick
// the newest, maybe the earlier run's). Every rank sees the same folder, so every rank refuses.
void refuse_earlier_checkpoints(const TaggingJobConfig& config) {
  if (config.resume) return;  // a signal makes every run write a checkpoint
  const std::string folder = config.run_dir + "/checkpoints";
  std::error_code error;
  if (std::filesystem::is_directory(folder, error) &&
      !CheckpointStore(folder, config.checkpoint_settings()).list().empty()) {
    throw std::invalid_argument("--run-dir '" + config.run_dir +
                                "' holds checkpoints of an earlier run: pass --resume to continue "
                                "it, or remove '" + folder + "' to start again");
  }
}

// Every rank's static and AdamW-state bytes (one all-reduce of a slot per rank).
struct StaticMemory {
  std::int64_t static_bytes = 0;            // this rank's, after the model and optimizer exist
  std::int64_t optimizer_state_bytes = 0;   // this rank's AdamW state
  std::vector<std::int64_t> static_bytes_per_rank;
  std::vector<std::int64_t> optimizer_state_bytes_per_rank;
};

StaticMemory measure_static_memory(const TaggingModelSetup& setup, const MemoryMeter& meter,
                                   DistributedContext& dist) {
  StaticMemory memory;
  memory.static_bytes = meter.current_allocated_bytes();
  memory.optimizer_state_bytes = setup.optimizer_state_bytes();
  const auto world = static_cast<std::size_t>(dist.world_size());
  std::vector<double> slots(2 * world, 0.0);
  slots[static_cast<std::size_t>(dist.rank())] = static_cast<double>(memory.static_bytes);
  slots[world + static_cast<std::size_t>(dist.rank())] = static_cast<double>(memory.optimizer_state_bytes);
  slots = dist.all_reduce(slots, ReduceOp::kSum);
  for (std::size_t r = 0; r < world; ++r) {
    memory.static_bytes_per_rank.push_back(static_cast<std::int64_t>(slots[r]));
    memory.optimizer_state_bytes_per_rank.push_back(static_cast<std::int64_t>(slots[world + r]));
  }
  return memory;
}

struct JobCapacity {
  std::int64_t capacity_bytes = 0;
  bool capped = false;                     // a CPU cap (else physical memory)
  bool same_layout_as_checkpoint = false;  // resumed at the checkpoint's world size and sharding
};

// The cap: bytes given, or a factor of the unsharded static bytes (this rank's plus the AdamW
// state the other ranks hold for it, so sharding frees room inside the same capacity), or the
// physical memory. A resumed run budgets with the stopped run's capacity (its static bytes may
// differ, e.g. parameters frozen then and unfrozen now), so it plans the same microbatches;
// another world size or sharding changes what a rank holds: that resume budgets of its own.
JobCapacity job_capacity(const TaggingJobConfig& config, TaggingModelSetup& setup,
                         const StaticMemory& memory, const DistributedContext& dist,
                         const std::optional<LearnerCheckpoint>& resume_from, std::int64_t device_bytes) {
  JobCapacity capacity;
  capacity.capacity_bytes = config.memory_cap_bytes;
  if (capacity.capacity_bytes == 0 && config.memory_cap_factor > 0) {
    std::int64_t unsharded_static_bytes = memory.static_bytes;
    if (setup.sharded_optimizer() != nullptr) {
      for (std::size_t r = 0; r < memory.optimizer_state_bytes_per_rank.size(); ++r) {
        if (static_cast<int>(r) != dist.rank()) unsharded_static_bytes += memory.optimizer_state_bytes_per_rank[r];
      }
    }
    capacity.capacity_bytes = static_cast<std::int64_t>(config.memory_cap_factor * static_cast<double>(unsharded_static_bytes));
  }
  capacity.capped = capacity.capacity_bytes > 0;
  if (!capacity.capped) capacity.capacity_bytes = device_bytes;
  capacity.same_layout_as_checkpoint =
      resume_from && resume_from->state.world_size == dist.world_size() &&
      resume_from->info.manifest.value("config", nlohmann::json::object()).value("sharding", "no_shard") ==
          to_string(config.sharding);
  if (capacity.same_layout_as_checkpoint) capacity.capacity_bytes = resume_from->state.capacity_bytes;
  return capacity;
}

// The config's hooks around the embedder's: freezer first, the extensions' hooks, the clipper
// last (it must see the gradients every other hook left).
HookList job_hooks(const TaggingJobConfig& config, const HookList& extension_hooks) {
  HookList hooks;
  if (!config.freeze.empty()) {
    LayerFreezerOptions options{config.freeze, std::nullopt};
    if (config.freeze_until_step > 0) options.until_step = config.freeze_until_step;
    hooks.add(std::make_shared<LayerFreezer>(options));
  }
  for (const auto& hook : extension_hooks.hooks()) hooks.add(hook);
  // Under shard_grad_op the ShardedAdamW clips by the global norm over the owned slices
  // (TaggingModelSetup passes clip_grad_norm on); the hook would see this rank's slices only.
  if (config.clip_grad_norm > 0 && config.sharding == ShardingStrategy::kNoShard) {
    hooks.add(std::make_shared<GradientClipper>(GradientClipperOptions{config.clip_grad_norm, 2.0}));
  }
  return hooks;
}

// The step engine of the fixed or power batcher (world size 1, checked by check_job_config);
// the predictive one the Learner builds over the job's PredictiveBatcher.
std::shared_ptr<FixedStepEngine> make_fixed_step_engine(const TaggingJobConfig& config,
                                                        torch::optim::Optimizer& optimizer, MemoryMeter& meter,
                                                        const DistributedContext& dist) {
  const std::int64_t size = config.microbatch_size > 0 ? config.microbatch_size : config.outer_batch_size;
  switch (config.batcher) {
    case BatcherKind::kFixed:
      return std::make_shared<FixedStepEngine>(optimizer, &meter, size);
    case BatcherKind::kPower:
      return std::make_shared<PowerAdaptiveStepEngine>(
          optimizer, &meter, PowerAdaptativeBatcherOptions{config.outer_batch_size, config.microbatch_size},
          dist.world_size());
    case BatcherKind::kPredictive:
      break;
  }
  throw std::logic_error("make_fixed_step_engine: the predictive batcher has no fixed step engine");
}

// What the summary reports besides the Learner's outcome.
struct JobFacts {
  double baseline_accuracy = 0;
  StaticMemory memory;
  JobCapacity capacity;
  std::int64_t usable_bytes = 0;
  MemoryModelOrigin origin;
  double initial_fit_max_rel_error = 0;
  std::string canonical_formula;
  std::int64_t microbatch_size = 0;
  int threads = 0;
  int restart_count = 0;
  double total_s = 0;
};

std::int64_t checkpoints_on_disk(const TaggingJobConfig& config) {
  return static_cast<std::int64_t>(
      CheckpointStore(config.run_dir + "/checkpoints", config.checkpoint_settings()).list().size());
}

double validation_metric(const LearnerOutcome& outcome, const std::string& name) {
  const auto it = outcome.last_validation.find(name);
  return it == outcome.last_validation.end() ? 0.0 : it->second;
}

nlohmann::json job_summary(const TaggingJobConfig& config, const DistributedContext& dist,
                           const LearnerOutcome& outcome, const JobFacts& facts) {
  const RunCounters& counters = outcome.counters;
  const ValidationSettings validation_settings = config.validation_settings();
  const bool predictive = config.batcher == BatcherKind::kPredictive;
  const std::int64_t step = outcome.steps;
  return {
      {"val_token_accuracy", validation_metric(outcome, "token_accuracy")},
      {"val_loss", validation_metric(outcome, "loss")},
      {"baseline_token_accuracy", facts.baseline_accuracy},
      {"validation_tokens", static_cast<std::int64_t>(validation_metric(outcome, "tokens"))},
      {"ooms", counters.ooms},
      {"validation_ooms", static_cast<std::int64_t>(validation_metric(outcome, "ooms"))},
      {"peak_allocated_bytes", counters.peak_allocated_bytes},
      {"capacity_bytes", facts.capacity.capacity_bytes},
      {"capacity_is_cap", facts.capacity.capped},
      {"usable_bytes", facts.usable_bytes},
      {"static_bytes", facts.memory.static_bytes},
      {"static_bytes_per_rank", facts.memory.static_bytes_per_rank},
      {"sharding", to_string(config.sharding)},
      {"optimizer_state_bytes_per_rank", facts.memory.optimizer_state_bytes_per_rank},
      {"tokens_per_s", counters.trained_size / std::max(1e-9, counters.train_s)},
      {"real_tokens", counters.trained_size},
      {"train_steps", step},
      {"total_steps", outcome.total_steps},
      {"microbatches", counters.microbatches},
      {"skipped_records", counters.skipped_records},
      {"final_loss", counters.last_loss},
      {"probes", facts.origin.probes_run},
      {"memory_model_from_cache", facts.origin.from_cache},
      {"memory_model_from_checkpoint", predictive && facts.capacity.same_layout_as_checkpoint},
      {"underpredictions", counters.underpredictions},
      {"online_corrections", counters.earlier_online_corrections},
      {"infeasible_probes", facts.origin.infeasible_probes},
      {"probe_s", facts.origin.probe_s},
      {"fit_max_rel_error", facts.initial_fit_max_rel_error},
      {"max_step_prediction_rel_error", counters.max_prediction_rel_error},
      {"train_s", counters.train_s},
      {"validation_s", outcome.last_validation_s},
      {"total_s", facts.total_s},
      {"validations", counters.validations},
      {"validation_metric", validation_settings.metric},
      {"validation_mode", to_string(validation_settings.mode)},
      {"best_step", outcome.best.best_step},
      {"best_value", outcome.best.best_value ? nlohmann::json(*outcome.best.best_value) : nlohmann::json()},
      {"early_stopped", outcome.early_stopped},
      {"finished", outcome.finished},
      {"interrupted", outcome.stopped_by_signal},
      {"stop_signal", !outcome.stopped_by_signal ? nlohmann::json()
                      : outcome.stop_signal != 0 ? nlohmann::json(signal_name(outcome.stop_signal))
                                                 : nlohmann::json("another rank's")},
      {"resumed_from_step", outcome.resumed_from_step},
      {"restarts", facts.restart_count},
      {"checkpoints_written", outcome.checkpoints_written},
      {"checkpoints_on_disk", checkpoints_on_disk(config)},
      {"canonical_formula", facts.canonical_formula},
      {"batcher", to_string(config.batcher)},
      {"microbatch_size", facts.microbatch_size},
      {"retried_steps", counters.retried_steps},
      {"oom_skipped_steps", counters.oom_skipped_steps},
      {"loss_scale_skipped_steps", outcome.loss_scale_skipped_steps},
      {"world_size", dist.world_size()},
      {"backend", dist.backend()},
      {"threads_per_rank", facts.threads},
      {"microbatches_per_rank", counters.microbatches_per_rank},
      {"max_rank_imbalance", counters.max_rank_imbalance},
      {"mean_rank_imbalance", step > 0 ? counters.sum_rank_imbalance / static_cast<double>(step) : 1.0}};
}

void log_static_memory(const TaggingJobConfig& config, const DistributedContext& dist, const StaticMemory& memory,
                       const JobCapacity& capacity, int threads, bool sharded,
                       const std::function<void(const std::string&)>& log) {
  log("xpm-train: static memory " + std::to_string(memory.static_bytes) + " bytes, capacity " +
      std::to_string(capacity.capacity_bytes) + " bytes" + (capacity.capped ? " (CPU cap)" : " (physical memory)") +
      (dist.distributed() ? " per rank; world size " + std::to_string(dist.world_size()) + ", backend " +
                                dist.backend() + ", " + std::to_string(threads) + " threads per rank"
                          : "") +
      "; sharding " + to_string(config.sharding) + ", AdamW state " + std::to_string(memory.optimizer_state_bytes) + " bytes");
  if (sharded && !dist.distributed()) {
    log("xpm-train: note: --sharding shard_grad_op at world size 1: this rank owns the whole AdamW "
        "state, so nothing is saved (run N ranks with --nproc N)");
  }
}

// The fitted model's facts for the summary, and its line in the log.
void note_memory_model(const PredictiveBatcher& batcher, const PredictiveBatcherOptions& options, JobFacts& facts,
                       const std::function<void(const std::string&)>& log) {
  facts.initial_fit_max_rel_error =
      batcher.model().metadata().value("fit", nlohmann::json::object()).value("max_rel_error", 0.0);
  facts.usable_bytes = options.budget.usable_bytes();
  facts.canonical_formula = batcher.model().formula().canonical();
  log("xpm-train: memory model " + facts.canonical_formula + ", floor " +
      std::to_string(static_cast<std::int64_t>(batcher.model().floor_bytes())) + " bytes");
}

// The finished run's validation line, against the most-frequent-tag baseline.
void log_final_validation(const LearnerOutcome& outcome, double baseline_accuracy,
                          const std::function<void(const std::string&)>& log) {
  char text[256];
  std::snprintf(text, sizeof text, "validation: token accuracy %.4f (most-frequent-tag baseline %.4f) on %lld tokens",
                validation_metric(outcome, "token_accuracy"), baseline_accuracy,
                static_cast<long long>(validation_metric(outcome, "tokens")));
  log(text);
}

}  // namespace

nlohmann::json run_tagging_job(const TaggingJobConfig& config) {
  DistributedContext single_process;
  return run_tagging_job(config, single_process);
}

nlohmann::json run_tagging_job(const TaggingJobConfig& config, DistributedContext& dist) {
  TaggingJobExtensions none;
  return run_tagging_job(config, dist, none);
}

nlohmann::json run_tagging_job(const TaggingJobConfig& config, DistributedContext& dist,
                               TaggingJobExtensions& extensions) {
  check_job_config(config, dist);
  HookList hooks = job_hooks(config, extensions.hooks);
  const bool predictive = config.batcher == BatcherKind::kPredictive;
  const auto job_start = Clock::now();
  const bool main_rank = dist.is_main();
  const std::function<void(const std::string&)> log = [&](const std::string& line) {
    if (!config.quiet && main_rank) std::cout << line << std::endl;
  };
  if (main_rank) std::filesystem::create_directories(config.run_dir);
  JobFacts facts;
  facts.threads = config.threads > 0 ? config.threads : default_worker_threads(dist.environment().local_world_size);
  torch::set_num_threads(facts.threads);
  torch::manual_seed(config.seed);

  const TaggingData data = load_job_data(config);
  facts.baseline_accuracy = most_frequent_tag_accuracy(data.train_sentences, data.validation_sentences);
  log("xpm-train: " + std::to_string(data.file_count) + " files, " + std::to_string(data.train.size()) +
      " train / " + std::to_string(data.validation.size()) + " validation sentences, vocabulary " +
      std::to_string(data.vocab.size()) + ", " + std::to_string(data.tags.size()) + " tags, longest sentence " +
      std::to_string(data.max_length) + " tokens");
  refuse_earlier_checkpoints(config);
  const std::optional<LearnerCheckpoint> resume_from =
      config.resume ? find_job_checkpoint(config, dist, log) : std::nullopt;

  // Model, optimizer, static memory: everything from here is counted by the meter. The
  // initialization hooks run on the built model, the checkpoint's parameters loaded between
  // them, before the optimizer exists (freezing and sharing act before it sees the parameters);
  // then the model goes to its device, before the optimizer and its state do.
  const torch::Device device = tagging_device(config.device, "--device", dist.local_rank());
  const std::shared_ptr<MemoryMeter> meter_of_device = make_device_meter(device, 0);  // capped once measured
  MemoryMeter& meter = *meter_of_device;
  TrainState state;
  TrainerContext context(state);
  if (resume_from) {  // initialization hooks see where the run stands (a freezer past until_step)
    state.epoch = resume_from->state.epoch;
    state.step = resume_from->state.step;
    state.epoch_position = resume_from->state.epoch_position;
  }
  TaggingModelSetup setup(config, data, [&](torch::nn::Module& module) {
    state.model = &module;
    hooks.before_initialization(context);
    if (resume_from) {
      with_error_context("resume", [&] { load_module_state(resume_from->info.path + "/model.pt", module); });
    }
    hooks.after_initialization(context);
    module.to(device);
  }, &dist);
  torch::optim::AdamW& optimizer = setup.optimizer();
  state.optimizer = &optimizer;
  facts.memory = measure_static_memory(setup, meter, dist);
  const std::int64_t device_bytes = device.is_cpu() ? physical_memory_bytes() : meter.capacity_bytes();  // uncapped
  facts.capacity = job_capacity(config, setup, facts.memory, dist, resume_from, device_bytes);
  set_device_capacity(meter, device, facts.capacity.capped ? facts.capacity.capacity_bytes : 0);
  log_static_memory(config, dist, facts.memory, facts.capacity, facts.threads, setup.sharded_optimizer() != nullptr,
                    log);

  // Memory model: the checkpoint's when resuming (no probing: the model training used at that
  // step, online corrections included), else rank 0's from the cache or probes.
  const PredictiveBatcherOptions batcher_options =
      tagging_batcher_options(config, data.max_length, facts.capacity.capacity_bytes);
  PredictiveBatcher batcher(batcher_options, make_packer(config.packer, packer_takes_sort_by(config.packer) ? config.sort_by : ""));
  if (predictive && facts.capacity.same_layout_as_checkpoint) {
    batcher.set_model(MemoryModel::from_json(resume_from->state.memory_model));
    log("xpm-train: memory model from the checkpoint, no probing");
  } else if (predictive) {
    facts.origin = obtain_memory_model(config, setup, meter, facts.capacity.capacity_bytes, batcher, dist, log);
  } else {
    log("xpm-train: batcher " + to_string(config.batcher) + ", microbatch size " +
        std::to_string(config.microbatch_size > 0 ? config.microbatch_size : config.outer_batch_size) +
        (config.batcher == BatcherKind::kPower ? " at first, shrunk on out-of-memory errors" : "") +
        "; no probing, no memory model");
  }
  // Per-rank dropout streams after the Learner broadcasts rank 0's parameters; world size 1
  // keeps the single-process seed. A resumed run restores its checkpoint's generator states.
  torch::manual_seed(config.seed + static_cast<std::uint64_t>(dist.rank()));  // same whether probed or cached
  if (predictive) note_memory_model(batcher, batcher_options, facts, log);
  if (main_rank) {
    if (predictive) batcher.model().save(config.run_dir + "/memory_model.json");
    write_file_atomically(config.run_dir + "/config.json", config.to_json().dump(2) + "\n");
  }
  const std::shared_ptr<FixedStepEngine> fixed_engine =
      predictive ? nullptr : make_fixed_step_engine(config, optimizer, meter, dist);

  TaggingTrainingTask task(setup, data.train, data.validation, dist);
  LearnerComponents parts;
  parts.dist = &dist;
  if (predictive) {
    parts.batcher = &batcher;  // the Learner builds the predictive engine over it
  } else {
    parts.engine = fixed_engine;
  }
  parts.meter = &meter;
  parts.sharded = setup.sharded_optimizer();
  parts.hooks = &hooks;
  parts.listeners = extensions.listeners;
  parts.capacity_bytes = facts.capacity.capacity_bytes;
  parts.state = &state;
  parts.context = &context;
  parts.resume_from = resume_from;
  LearnerOptions learner_options = tagging_learner_options(config, log);
  learner_options.device = device;
  Learner learner(task, optimizer, std::move(learner_options), std::move(parts));
  const LearnerOutcome outcome = learner.run();
  if (outcome.finished) log_final_validation(outcome, facts.baseline_accuracy, log);
  facts.microbatch_size = predictive ? 0 : fixed_engine->microbatch_size();
  facts.restart_count = extensions.restart_count;
  facts.total_s = seconds_since(job_start);
  const nlohmann::json summary = job_summary(config, dist, outcome, facts);
  if (main_rank) {
    if (outcome.finished) save_parameters_atomically(setup.module(), config.run_dir + "/final_parameters.pt");
    write_file_atomically(config.run_dir + "/summary.json", summary.dump(2) + "\n");
  }
  dist.barrier();  // rank 0's store outlives every rank's last use of it
  return summary;
}

}  // namespace xpm
