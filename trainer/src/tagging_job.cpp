// run_tagging_job: data, model (initialization hooks, resumed parameters), static memory and
// cap, memory model (checkpoint, cache or probes), then the Learner loop (tagging_learner.cpp)
// and the summary.
#include "xpm/trainer/tagging_job.hpp"

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
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/brown_corpus.hpp"
#include "xpm/trainer/error_context.hpp"
#include "xpm/trainer/fixed_batchers.hpp"
#include "xpm/trainer/gradient_buckets.hpp"
#include "xpm/trainer/hook_library.hpp"
#include "xpm/trainer/tagging_checkpoint.hpp"
#include "xpm/trainer/tagging_learner.hpp"
#include "xpm/trainer/tagging_memory_plan.hpp"
#include "xpm/trainer/tagging_task.hpp"

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

// Settings a resumed run may change: where things go, what is printed, how often checkpoints
// are written, stopping, timeouts, and the sharding (the update is AdamW's either way; the
// checkpoint's optimizer files decide what can be loaded, TaggingLearner::restore). Every other one (model, data, schedule, batcher, memory
// budget, validation) must equal the checkpoint's, or the resumed run would not continue the
// stopped one.
const std::set<std::string>& settings_free_on_resume() {
  static const std::set<std::string> keys = {
      "run_dir",          "data_dir",           "threads",
      "log_every",        "quiet",              "memory_model_cache",
      "resume",           "stop_after_steps",   "checkpoint_every_steps",
      "checkpoint_every_epochs", "keep_checkpoints", "collective_timeout_s",
      "rendezvous_timeout_s", "backend", "sharding", "optimizer_checkpoint"};
  return keys;
}

// Throws std::invalid_argument naming every setting that differs from the checkpoint's.
void check_resume_config(const TaggingJobConfig& config, const TaggingCheckpoint& checkpoint) {
  const nlohmann::json now = config.to_json();
  const nlohmann::json then = checkpoint.info.manifest.value("config", nlohmann::json::object());
  std::string differences;
  for (const auto& [key, value] : now.items()) {
    if (settings_free_on_resume().count(key) != 0U) continue;
    const auto it = then.find(key);
    if (it == then.end() || *it != value) {
      differences += (differences.empty() ? "" : "; ") + key + " = " + value.dump() + " (checkpoint: " +
                     (it == then.end() ? std::string("absent") : it->dump()) + ")";
    }
  }
  if (!differences.empty()) {
    throw std::invalid_argument("--resume: checkpoint '" + checkpoint.info.path +
                                "' was written with other settings; resume with the same ones: " +
                                differences);
  }
}

// Rank 0 finds the newest valid checkpoint (warning about each skipped one) and shares its
// folder; every rank reads it. nullopt when there is none (the run starts at step 0).
std::optional<TaggingCheckpoint> find_resume_checkpoint(const TaggingJobConfig& config,
                                                        DistributedContext& dist,
                                                        const std::function<void(const std::string&)>& log) {
  std::string path;
  if (dist.is_main()) {
    std::vector<std::string> warnings;
    const CheckpointStore store(config.run_dir + "/checkpoints", config.checkpoint_settings());
    const std::optional<TaggingCheckpoint> found = load_latest_tagging_checkpoint(store, &warnings);
    for (const std::string& warning : warnings) std::cerr << "xpm-train: warning: " << warning << std::endl;
    if (found) path = found->info.path;
  }
  path = dist.share_from(0, path, config.rendezvous_timeout());
  if (path.empty()) {
    log("xpm-train: --resume: no valid checkpoint in " + config.run_dir + "/checkpoints; starting at step 0");
    return std::nullopt;
  }
  // Every rank reads the folder rank 0 chose (verified there; verified again here).
  std::optional<TaggingCheckpoint> checkpoint;
  try {
    checkpoint = read_tagging_checkpoint(path);
  } catch (const std::runtime_error& error) {
    throw std::runtime_error("--resume: checkpoint '" + path + "': " + error.what());
  }
  check_resume_config(config, *checkpoint);
  check_optimizer_loadable(*checkpoint, dist.world_size(), config.sharding);  // before anything is written
  log("xpm-train: resuming from " + path + " (step " + std::to_string(checkpoint->state.step) + ")");
  return checkpoint;
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
  if (config.clip_grad_norm > 0 && config.sharding == "no_shard") {
    hooks.add(std::make_shared<GradientClipper>(GradientClipperOptions{config.clip_grad_norm, 2.0}));
  }
  return hooks;
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
  config.validate();
  const ValidationSettings validation_settings = config.validation_settings();
  // The batchers without a memory model run in a single process: every rank refuses, now.
  if (config.batcher == "power") PowerAdaptativeBatcher::check_single_process(dist.world_size());
  if (config.batcher == "fixed" && dist.world_size() > 1) {
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
  TaggingJobExtensions job_extensions{job_hooks(config, extensions.hooks), extensions.listeners};
  const bool predictive = config.batcher == "predictive";
  const auto job_start = Clock::now();
  const bool main_rank = dist.is_main();
  const std::function<void(const std::string&)> log = [&](const std::string& line) {
    if (!config.quiet && main_rank) std::cout << line << std::endl;
  };
  if (main_rank) std::filesystem::create_directories(config.run_dir);
  const int threads = config.threads > 0 ? config.threads
                                         : default_worker_threads(dist.environment().local_world_size);
  torch::set_num_threads(threads);
  torch::manual_seed(config.seed);

  // Data.
  const TaggingData data = [&] {
    try {
      return load_tagging_data(config);
    } catch (const std::runtime_error& error) {  // missing or malformed corpus: bad input
      throw std::invalid_argument(std::string("--data-dir: ") + error.what());
    }
  }();
  const auto outer = static_cast<std::size_t>(config.outer_batch_size);
  const auto steps_per_epoch = static_cast<std::int64_t>((data.train.size() + outer - 1) / outer);
  const std::int64_t total_steps = config.max_steps > 0
                                       ? std::min(steps_per_epoch * config.epochs, config.max_steps)
                                       : steps_per_epoch * config.epochs;
  if (config.stop_after_steps > total_steps) {
    throw std::invalid_argument("--stop-after-steps " + std::to_string(config.stop_after_steps) +
                                " is beyond the run's " + std::to_string(total_steps) +
                                " steps (--epochs, --max-steps): it would never stop the run");
  }
  for (const ProbePoint& point : config.probe_points) {
    const double l = point.values.at("l");
    const std::int64_t max_length = max_sequence_length(config, data);
    if (l > static_cast<double>(max_length)) {
      throw std::invalid_argument("--probe-points: l = " + std::to_string(static_cast<long long>(l)) +
                                  " is longer than the model's max length " + std::to_string(max_length));
    }
  }
  const double baseline_accuracy =
      most_frequent_tag_accuracy(data.train_sentences, data.validation_sentences);
  log("xpm-train: " + std::to_string(data.file_count) + " files, " +
      std::to_string(data.train.size()) + " train / " + std::to_string(data.validation.size()) +
      " validation sentences, vocabulary " + std::to_string(data.vocab.size()) + ", " +
      std::to_string(data.tags.size()) + " tags, longest sentence " +
      std::to_string(data.max_length) + " tokens");

  // A fresh run must not mix its checkpoints with an earlier run's (a later --resume would
  // pick the newest, maybe the earlier run's). Every rank sees the same folder, so every rank
  // refuses alike.
  if (!config.resume && (config.checkpointing() || config.stop_after_steps > 0)) {
    const std::string folder = config.run_dir + "/checkpoints";
    std::error_code error;
    if (std::filesystem::is_directory(folder, error) &&
        !CheckpointStore(folder, config.checkpoint_settings()).list().empty()) {
      throw std::invalid_argument("--run-dir '" + config.run_dir +
                                  "' holds checkpoints of an earlier run: pass --resume to continue "
                                  "it, or remove '" + folder + "' to start again");
    }
  }
  const std::optional<TaggingCheckpoint> resume_from =
      config.resume ? find_resume_checkpoint(config, dist, log) : std::nullopt;

  // Model, optimizer, static memory: everything from here is counted by the meter. The
  // initialization hooks run on the built model, the checkpoint's parameters loaded between
  // them, before the optimizer exists (freezing and sharing act before it sees the parameters).
  CpuMemoryMeter& meter = CpuMemoryMeter::install();
  meter.set_capacity_bytes(0);
  TrainState state;
  TrainerContext context(state);
  if (resume_from) {  // initialization hooks see where the run stands (a freezer past until_step)
    state.epoch = resume_from->state.epoch;
    state.step = resume_from->state.step;
    state.epoch_position = resume_from->state.epoch_position;
  }
  TaggingModelSetup setup(config, data, [&](torch::nn::Module& module) {
    state.model = &module;
    job_extensions.hooks.before_initialization(context);
    if (resume_from) {
      with_error_context("resume", [&] { load_module_state(resume_from->info.path + "/model.pt", module); });
    }
    job_extensions.hooks.after_initialization(context);
  }, &dist);
  torch::optim::AdamW& optimizer = setup.optimizer();
  state.optimizer = &optimizer;
  const std::int64_t static_bytes = meter.current_allocated_bytes();
  const std::int64_t optimizer_state_bytes = setup.optimizer_state_bytes();
  // Every rank's static and AdamW-state bytes (one all-reduce of a slot per rank), for the summary.
  std::vector<std::int64_t> static_bytes_per_rank, optimizer_state_bytes_per_rank;
  {
    const auto world = static_cast<std::size_t>(dist.world_size());
    std::vector<double> slots(2 * world, 0.0);
    slots[static_cast<std::size_t>(dist.rank())] = static_cast<double>(static_bytes);
    slots[world + static_cast<std::size_t>(dist.rank())] = static_cast<double>(optimizer_state_bytes);
    slots = dist.all_reduce(slots, ReduceOp::kSum);
    for (std::size_t r = 0; r < world; ++r) {
      static_bytes_per_rank.push_back(static_cast<std::int64_t>(slots[r]));
      optimizer_state_bytes_per_rank.push_back(static_cast<std::int64_t>(slots[world + r]));
    }
  }

  std::int64_t capacity_bytes = config.memory_cap_bytes;
  if (capacity_bytes == 0 && config.memory_cap_factor > 0) {
    // Of the unsharded static bytes (this rank's plus the AdamW state the other ranks hold for
    // it), so sharding frees room inside the same capacity rather than shrinking the capacity.
    std::int64_t unsharded_static_bytes = static_bytes;
    if (setup.sharded_optimizer() != nullptr) {
      for (std::size_t r = 0; r < optimizer_state_bytes_per_rank.size(); ++r) {
        if (static_cast<int>(r) != dist.rank()) unsharded_static_bytes += optimizer_state_bytes_per_rank[r];
      }
    }
    capacity_bytes = static_cast<std::int64_t>(config.memory_cap_factor * static_cast<double>(unsharded_static_bytes));
  }
  const bool capped = capacity_bytes > 0;
  if (!capped) capacity_bytes = physical_memory_bytes();
  // A resumed run budgets with the stopped run's capacity (its static bytes may differ, e.g.
  // parameters frozen then and unfrozen now), so it plans the same microbatches.
  // Another world size or sharding changes what a rank holds: that resume budgets, and plans
  // with a memory model, of its own.
  const bool same_layout_as_checkpoint =
      resume_from && resume_from->state.world_size == dist.world_size() &&
      resume_from->info.manifest.value("config", nlohmann::json::object()).value("sharding", "no_shard") ==
          config.sharding;
  if (same_layout_as_checkpoint) capacity_bytes = resume_from->state.capacity_bytes;
  meter.set_capacity_bytes(capped ? capacity_bytes : 0);
  log("xpm-train: static memory " + std::to_string(static_bytes) + " bytes, capacity " +
      std::to_string(capacity_bytes) + " bytes" + (capped ? " (CPU cap)" : " (physical memory)") +
      (dist.distributed() ? " per rank; world size " + std::to_string(dist.world_size()) + ", backend " +
                                dist.backend() + ", " + std::to_string(threads) + " threads per rank"
                          : "") +
      "; sharding " + config.sharding + ", AdamW state " + std::to_string(optimizer_state_bytes) + " bytes");
  if (setup.sharded_optimizer() != nullptr && !dist.distributed()) {
    log("xpm-train: note: --sharding shard_grad_op at world size 1: this rank owns the whole AdamW "
        "state, so nothing is saved (run N ranks with --nproc N)");
  }

  // Memory model: the checkpoint's when resuming (no probing: the model training used at that
  // step, online corrections included), else rank 0's from the cache or probes.
  const PredictiveBatcherOptions batcher_options =
      tagging_batcher_options(config, data.max_length, capacity_bytes);
  PredictiveBatcher batcher(batcher_options, tagging_packer(config));
  MemoryModelOrigin origin;
  if (predictive && same_layout_as_checkpoint) {
    batcher.set_model(MemoryModel::from_json(resume_from->state.memory_model));
    log("xpm-train: memory model from the checkpoint, no probing");
  } else if (predictive) {
    origin = obtain_memory_model(config, setup, meter, capacity_bytes, batcher, dist, log);
  } else {
    log("xpm-train: batcher " + config.batcher + ", microbatch size " +
        std::to_string(config.microbatch_size > 0 ? config.microbatch_size : config.outer_batch_size) +
        (config.batcher == "power" ? " at first, shrunk on out-of-memory errors" : "") +
        "; no probing, no memory model");
  }
  // Same parameters everywhere (rank 0's), gradients in all-reduce buckets, then per-rank
  // dropout streams; world size 1 keeps the single-process seed. A resumed run restores the
  // generator state of its checkpoint afterwards (TaggingLearner::run).
  std::vector<torch::Tensor> parameters = setup.module().parameters();
  {
    torch::NoGradGuard no_grad;
    dist.broadcast_(parameters, 0);
  }
  std::optional<GradientBuckets> buckets;  // ShardedAdamW reduces its own flat gradient
  if (dist.distributed() && setup.sharded_optimizer() == nullptr) buckets.emplace(parameters, config.bucket_cap_bytes);
  torch::manual_seed(config.seed + static_cast<std::uint64_t>(dist.rank()));  // same whether probed or cached
  const double initial_fit_max_rel_error =
      predictive
          ? batcher.model().metadata().value("fit", nlohmann::json::object()).value("max_rel_error", 0.0)
          : 0.0;
  if (predictive) {
    log("xpm-train: memory model " + batcher.model().formula().canonical() + ", floor " +
        std::to_string(static_cast<std::int64_t>(batcher.model().floor_bytes())) + " bytes");
  }
  if (main_rank) {
    if (predictive) batcher.model().save(config.run_dir + "/memory_model.json");
    write_file_atomically(config.run_dir + "/config.json", config.to_json().dump(2) + "\n");
  }

  // Or a batcher without a memory model (world size 1, checked above).
  std::unique_ptr<FixedBatcher> fixed_batcher;
  PowerAdaptativeBatcher* power_batcher = nullptr;
  if (config.batcher == "fixed") {
    fixed_batcher = std::make_unique<FixedBatcher>(
        optimizer, &meter, config.microbatch_size > 0 ? config.microbatch_size : config.outer_batch_size);
  } else if (config.batcher == "power") {
    auto power = std::make_unique<PowerAdaptativeBatcher>(
        optimizer, &meter, PowerAdaptativeBatcherOptions{config.outer_batch_size, config.microbatch_size},
        dist.world_size());
    power_batcher = power.get();
    fixed_batcher = std::move(power);
  }

  state.total_steps = total_steps;

  TaggingLearnerParts parts;
  parts.config = &config;
  parts.dist = &dist;
  parts.extensions = &job_extensions;
  parts.train = &data.train;
  parts.validation = &data.validation;
  parts.setup = &setup;
  parts.batcher = &batcher;
  parts.fixed_batcher = fixed_batcher.get();
  parts.power_batcher = power_batcher;
  parts.meter = &meter;
  parts.buckets = buckets ? &*buckets : nullptr;
  parts.capacity_bytes = capacity_bytes;
  parts.log = log;
  TaggingLearner learner(parts, state, context, resume_from);
  const TaggingLearnerOutcome outcome = learner.run();
  const TaggingRunCounters& counters = outcome.counters;
  const ValidationMetrics& accuracy = outcome.last_validation;
  if (outcome.finished) {
    char text[256];
    std::snprintf(text, sizeof text,
                  "validation: token accuracy %.4f (most-frequent-tag baseline %.4f) on %lld tokens",
                  accuracy.token_accuracy, baseline_accuracy, static_cast<long long>(accuracy.tokens));
    log(text);
  }
  std::int64_t checkpoints_on_disk = 0;
  if (config.checkpointing() || config.stop_after_steps > 0) {
    checkpoints_on_disk = static_cast<std::int64_t>(
        CheckpointStore(config.run_dir + "/checkpoints", config.checkpoint_settings()).list().size());
  }
  const std::int64_t step = state.step;
  nlohmann::json summary = {
      {"val_token_accuracy", accuracy.token_accuracy},
      {"val_loss", accuracy.loss},
      {"baseline_token_accuracy", baseline_accuracy},
      {"validation_tokens", accuracy.tokens},
      {"ooms", counters.ooms},
      {"validation_ooms", accuracy.ooms},
      {"peak_allocated_bytes", counters.peak_allocated_bytes},
      {"capacity_bytes", capacity_bytes},
      {"capacity_is_cap", capped},
      {"usable_bytes", predictive ? batcher_options.budget.usable_bytes() : 0},
      {"static_bytes", static_bytes},
      {"static_bytes_per_rank", static_bytes_per_rank},
      {"sharding", config.sharding},
      {"optimizer_state_bytes_per_rank", optimizer_state_bytes_per_rank},
      {"tokens_per_s", counters.real_tokens / std::max(1e-9, counters.train_s)},
      {"real_tokens", counters.real_tokens},
      {"train_steps", step},
      {"total_steps", state.total_steps},
      {"microbatches", counters.microbatches},
      {"skipped_records", counters.skipped_records},
      {"final_loss", counters.last_loss},
      {"probes", origin.probes_run},
      {"memory_model_from_cache", origin.from_cache},
      {"memory_model_from_checkpoint", predictive && same_layout_as_checkpoint},
      {"underpredictions", counters.underpredictions},
      {"online_corrections", counters.earlier_online_corrections},
      {"infeasible_probes", origin.infeasible_probes},
      {"probe_s", origin.probe_s},
      {"fit_max_rel_error", initial_fit_max_rel_error},
      {"max_step_prediction_rel_error", counters.max_prediction_rel_error},
      {"train_s", counters.train_s},
      {"validation_s", outcome.last_validation_s},
      {"total_s", seconds_since(job_start)},
      {"validations", counters.validations},
      {"validation_metric", validation_settings.metric},
      {"validation_mode", to_string(validation_settings.mode)},
      {"best_step", outcome.best.best_step},
      {"best_value", outcome.best.best_value ? nlohmann::json(*outcome.best.best_value) : nlohmann::json()},
      {"early_stopped", outcome.early_stopped},
      {"finished", outcome.finished},
      {"resumed_from_step", outcome.resumed_from_step},
      {"checkpoints_written", outcome.checkpoints_written},
      {"checkpoints_on_disk", checkpoints_on_disk},
      {"canonical_formula", predictive ? batcher.model().formula().canonical() : std::string()},
      {"batcher", config.batcher},
      {"microbatch_size", fixed_batcher ? fixed_batcher->microbatch_size() : 0},
      {"retried_steps", counters.retried_steps},
      {"oom_skipped_steps", counters.oom_skipped_steps},
      {"loss_scale_skipped_steps", outcome.loss_scale_skipped_steps},
      {"world_size", dist.world_size()},
      {"backend", dist.backend()},
      {"threads_per_rank", threads},
      {"microbatches_per_rank", counters.microbatches_per_rank},
      {"max_rank_imbalance", counters.max_rank_imbalance},
      {"mean_rank_imbalance", step > 0 ? counters.sum_rank_imbalance / static_cast<double>(step) : 1.0}};
  if (main_rank) {
    if (outcome.finished) save_parameters_atomically(setup.module(), config.run_dir + "/final_parameters.pt");
    write_file_atomically(config.run_dir + "/summary.json", summary.dump(2) + "\n");
  }
  dist.barrier();  // rank 0's store outlives every rank's last use of it
  return summary;
}

}  // namespace xpm
