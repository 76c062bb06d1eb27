// The Learner's set-up and state: data-parallel set-up, probing when the batcher has no model,
// checkpoints (every rank's generator, sharded optimizer files) and exact resume.
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "learner_impl.hpp"
#include "xpm/trainer/steps/predictive_step_engine.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/loop/error_context.hpp"

namespace xpm {
namespace {

void check_components(const LearnerComponents& parts, const DistributedContext& dist) {
  if (parts.engine != nullptr && parts.batcher != nullptr) {
    throw std::invalid_argument("LearnerComponents: give an engine or a batcher (the predictive engine's), not both");
  }
  if (parts.engine == nullptr && parts.batcher == nullptr) {
    throw std::invalid_argument("LearnerComponents: no step engine: give an engine, a batcher (predictive) or "
                                "LearnerOptions.memory_plan");
  }
  if (parts.engine != nullptr) parts.engine->check_world_size(dist.world_size());
  if ((parts.state == nullptr) != (parts.context == nullptr)) {
    throw std::invalid_argument("LearnerComponents: give both state and context, or neither");
  }
}

}  // namespace

Learner::Impl::Impl(TrainingTask& task_, torch::optim::Optimizer& optimizer_, LearnerOptions options_,
                    LearnerComponents components)
    : task(task_),
      optimizer(optimizer_),
      options((options_.validate(), std::move(options_))),
      parts(std::move(components)),
      dist(parts.dist != nullptr ? *parts.dist : single_process),
      state(parts.state != nullptr ? *parts.state : own_state),
      own_context(parts.context == nullptr ? std::optional<TrainerContext>(std::in_place, own_state) : std::nullopt),
      context(parts.context != nullptr ? *parts.context : *own_context),
      hooks(parts.hooks != nullptr ? *parts.hooks : no_hooks),
      early_stopping(options.validation),
      sampler(options.sampler_seed),
      order(task.train_record_count()) {
  build_memory_plan();
  check_components(parts, dist);
  check_model_device();
  if (order.empty()) throw std::invalid_argument("Learner: the task has no training record");
  state.model = &task.module();
  state.optimizer = &optimizer;
  state.total_steps = options.total_steps(order.size());
  if (options.stop_after_steps > state.total_steps) {
    throw std::invalid_argument("LearnerOptions.stop_after_steps " + std::to_string(options.stop_after_steps) +
                                " is beyond the run's " + std::to_string(state.total_steps) + " steps");
  }
  if (options.checkpointing() || options.stop_after_steps > 0 || !options.stop_signals.empty()) {
    store.emplace(options.run_dir + "/checkpoints", options.checkpoints);
  }
  outcome.counters = RunCounters(dist.world_size());
  const auto outer = static_cast<std::size_t>(options.outer_batch_size);
  steps_per_epoch = static_cast<std::int64_t>((order.size() + outer - 1) / outer);
  if (dist.is_main()) std::filesystem::create_directories(options.run_dir);
  set_up_data_parallel();
  build_step_engine();
}

void Learner::Impl::build_memory_plan() {
  if (!options.memory_plan) return;
  if (parts.batcher != nullptr || parts.engine != nullptr) {
    throw std::invalid_argument("LearnerOptions.memory_plan builds the Learner's batcher: give no engine nor batcher in "
                                "LearnerComponents with it");
  }
  if (parts.meter == nullptr) {
    throw std::invalid_argument("LearnerOptions.memory_plan needs LearnerComponents.meter (make_device_meter, before the model is built)");
  }
  const MemoryPlanOptions& plan = *options.memory_plan;
  own_batcher.emplace(plan.batcher_options(*parts.meter), make_packer(plan.packer, plan.sort_by));
  parts.batcher = &*own_batcher;
}

void Learner::Impl::build_step_engine() {
  GradientBuckets* buckets = parts.buckets != nullptr ? parts.buckets : own_buckets ? &*own_buckets : nullptr;
  engine = parts.engine != nullptr ? parts.engine
                                   : std::make_shared<PredictiveStepEngine>(optimizer, *parts.batcher, parts.meter,
                                                                            dist, buckets, parts.sharded);
  if (options.loss_scaling && engine->supports_loss_scaling()) {
    loss_scaler.emplace();
    engine->set_loss_scaler(&*loss_scaler);
  }
}

void Learner::Impl::check_model_device() const {
  for (const auto& item : task.module().named_parameters()) {
    const std::string& name = item.key();
    const torch::Device where = item.value().device();
    const bool same = where.type() == options.device.type() &&
                      (!options.device.has_index() || where.index() == options.device.index());
    if (!same) {
      throw std::invalid_argument("LearnerOptions.device is " + options.device.str() + " but the model's parameter '" +
                                  name + "' is on " + where.str() + ": build the model on the device (module.to(device))");
    }
  }
}

void Learner::Impl::set_up_data_parallel() {
  if (!dist.distributed()) return;
  // Same parameters everywhere (rank 0's), gradients in all-reduce buckets (ShardedAdamW
  // reduces its own flat gradient).
  std::vector<torch::Tensor> parameters = task.module().parameters();
  {
    torch::NoGradGuard no_grad;
    dist.broadcast_(parameters, 0);
  }
  if (parts.buckets == nullptr && parts.sharded == nullptr) own_buckets.emplace(parameters, options.bucket_cap_bytes);
}

std::int64_t Learner::Impl::capacity_bytes() const {
  return parts.capacity_bytes > 0 ? parts.capacity_bytes : engine->planned_capacity_bytes();
}

void Learner::Impl::find_checkpoint_to_resume() {
  std::optional<LearnerCheckpoint> found = find_resume_checkpoint(
      options.run_dir + "/checkpoints", options.checkpoints, dist, options.config, options.resume_free_keys,
      [&](const std::string& warning) { std::cerr << options.log_prefix << ": warning: " << warning << std::endl; });
  if (!found) {
    log(options.log_prefix + ": resume: no valid checkpoint in " + options.run_dir + "/checkpoints; starting at step 0");
    return;
  }
  with_error_context("resume", [&] { load_module_state(found->info.path + "/model.pt", task.module()); });
  log(options.log_prefix + ": resuming from " + found->info.path + " (step " + std::to_string(found->state.step) + ")");
  parts.resume_from = std::move(found);
}

void Learner::Impl::obtain_memory_model() {
  const EngineModelOrigin origin = engine->ensure_memory_model(
      task.module(), optimizer, [this](const std::vector<double>& dims) { return task.probe_loss_sum(dims); },
      options.probing, engine_log());
  outcome.probes += origin.probes;
  outcome.memory_model_from_cache = outcome.memory_model_from_cache || origin.from_cache;
  outcome.probe_s += origin.probe_s;
}

std::vector<torch::Tensor> Learner::Impl::gather_generator_states() {
  torch::Tensor mine;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    mine = generator.get_state();
  }
  if (!dist.distributed()) return {mine};
  // Every rank's bytes in its slot, summed: rank 0 gets all (one all-reduce, same on every rank).
  const auto size = static_cast<std::size_t>(mine.numel());
  std::vector<double> slots(size * static_cast<std::size_t>(dist.world_size()), 0.0);
  const std::uint8_t* bytes = mine.data_ptr<std::uint8_t>();
  for (std::size_t i = 0; i < size; ++i) slots[static_cast<std::size_t>(dist.rank()) * size + i] = bytes[i];
  slots = dist.all_reduce(slots, ReduceOp::kSum);
  std::vector<torch::Tensor> states;
  for (int r = 0; r < dist.world_size(); ++r) {
    torch::Tensor generator_state = torch::empty_like(mine);
    std::uint8_t* out = generator_state.data_ptr<std::uint8_t>();
    for (std::size_t i = 0; i < size; ++i) {
      out[i] = static_cast<std::uint8_t>(slots[static_cast<std::size_t>(r) * size + i]);
    }
    states.push_back(generator_state);
  }
  return states;
}

LearnerResumeState Learner::Impl::resume_state() const {
  LearnerResumeState saved;
  saved.epoch = state.epoch;
  saved.step = state.step;
  saved.epoch_position = state.epoch_position;
  saved.total_steps = state.total_steps;
  saved.world_size = dist.world_size();
  saved.capacity_bytes = capacity_bytes();
  std::ostringstream sampler_text;
  sampler_text << sampler;
  saved.sampler_state = sampler_text.str();
  saved.epoch_order.assign(order.begin(), order.end());
  const EngineMemoryState memory = engine->memory_state();
  saved.memory_model = memory.memory_model;
  saved.calibration = memory.calibration;
  const StepEngineState engine_state = engine->state();
  saved.microbatch_size = engine_state.microbatch_size;
  saved.power_divisor = engine_state.divisor;
  if (loss_scaler) saved.loss_scaler = loss_scaler->state();
  RunCounters counters = outcome.counters;
  counters.earlier_online_corrections += engine->memory_summary().corrections;
  saved.counters = counters.to_json();
  saved.early_stopping = early_stopping.to_json();
  saved.early_stopped = outcome.early_stopped;
  saved.task_state = task.extra_state();
  saved.learner_settings = options.resume_settings();
  return saved;
}

void Learner::Impl::checkpoint(bool is_best) {
  with_error_context("checkpoint write of step " + std::to_string(state.step), [&] { write_checkpoint(is_best); });
}

void Learner::Impl::write_checkpoint(bool is_best) {
  const std::vector<torch::Tensor> generators = gather_generator_states();  // collective
  // The optimizer's files. Under ShardedAdamW every rank first writes its part into a staging
  // folder next to the checkpoints (its own shard, or its share of the consolidated state); once
  // all are there (barrier), rank 0's store moves them into the checkpoint it writes, so the
  // manifest checksums every rank's file and a checkpoint is complete or absent.
  std::map<std::string, CheckpointFileWriter> optimizer_files;
  ShardedAdamW* sharded = parts.sharded;
  std::string staging;
  if (sharded == nullptr) {
    optimizer_files["optimizer.pt"] = [this](const std::string& path) { torch::save(optimizer, path); };
  } else {
    char name[48];
    std::snprintf(name, sizeof name, ".staging-step-%08lld", static_cast<long long>(state.step));
    staging = options.run_dir + "/checkpoints/" + name;
    std::filesystem::create_directories(staging);
    std::vector<std::string> names;
    if (options.optimizer_checkpoint == OptimizerCheckpointLayout::kConsolidated) {
      // The gather holds the whole state for a moment (2-3 x the parameters' bytes), between
      // steps: outside the plan's budget, so outside the CPU cap too.
      ScopedMemoryCap uncapped(0);
      sharded->save_full_state(staging + "/optimizer.pt");  // collective; rank 0 writes
      names.push_back("optimizer.pt");
    } else {
      sharded->save_shard(staging + "/optimizer-rank" + std::to_string(dist.rank()) + ".pt");
      for (int r = 0; r < dist.world_size(); ++r) names.push_back("optimizer-rank" + std::to_string(r) + ".pt");
    }
    dist.barrier();
    for (const std::string& file : names) {
      optimizer_files[file] = [source = staging + "/" + file](const std::string& path) {
        std::filesystem::rename(source, path);
      };
    }
  }
  if (dist.is_main()) {
    const std::string folder = save_learner_checkpoint(*store, task.module(), optimizer_files, generators,
                                                       resume_state(), options.config, options.checkpoint_kind,
                                                       is_best);
    if (!staging.empty()) std::filesystem::remove_all(staging);
    log(options.log_prefix + ": checkpoint " + folder + (is_best ? " (best)" : ""));
  }
  ++outcome.checkpoints_written;
  last_checkpoint_step = state.step;
}

void Learner::Impl::restore_optimizer_and_generator(const LearnerCheckpoint& checkpoint) {
  const std::string full_optimizer = checkpoint.info.path + "/optimizer.pt";
  ShardedAdamW* sharded = parts.sharded;
  if (!std::filesystem::exists(full_optimizer)) {
    sharded->load_shard(checkpoint.info.path + "/optimizer-rank" + std::to_string(dist.rank()) + ".pt");
  } else if (sharded != nullptr) {
    sharded->load_full_state(full_optimizer);
  } else {
    load_optimizer_state(full_optimizer, optimizer);
  }
  // A rank the checkpoint did not have (a larger world) keeps its fresh seed.
  if (dist.rank() < checkpoint.state.world_size) {
    const torch::Tensor generator_state = load_generator_state(checkpoint.info.path + "/rng.pt", dist.rank());
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(generator_state);
  }
}

void Learner::Impl::restore(const LearnerCheckpoint& checkpoint) {
  const LearnerResumeState& saved = checkpoint.state;
  // A consolidated optimizer.pt loads at any world size and sharding; per-rank shards only where
  // they were written.
  check_optimizer_loadable(checkpoint, dist.world_size(), parts.sharded != nullptr ? ShardingStrategy::kShardGradOp : ShardingStrategy::kNoShard);
  if (saved.total_steps != state.total_steps || saved.epoch_order.size() != order.size()) {
    throw std::invalid_argument("--resume: checkpoint '" + checkpoint.info.path + "' belongs to a run of " +
                                std::to_string(saved.total_steps) + " steps over " +
                                std::to_string(saved.epoch_order.size()) + " train records; this run has " +
                                std::to_string(state.total_steps) + " steps over " + std::to_string(order.size()));
  }
  if (!saved.learner_settings.is_null() && saved.learner_settings != options.resume_settings()) {
    throw std::invalid_argument("resume: checkpoint '" + checkpoint.info.path + "' was written with other Learner " +
                                "options: " + saved.learner_settings.dump() + "; this run has " +
                                options.resume_settings().dump());
  }
  state.epoch = saved.epoch;
  state.step = saved.step;
  state.epoch_position = saved.epoch_position;
  std::istringstream sampler_text(saved.sampler_state);
  sampler_text >> sampler;
  if (!sampler_text) throw std::runtime_error("checkpoint '" + checkpoint.info.path + "': unreadable sampler state");
  std::copy(saved.epoch_order.begin(), saved.epoch_order.end(), order.begin());
  with_error_context("resume", [&] { restore_optimizer_and_generator(checkpoint); });
  engine->restore_state({saved.microbatch_size, saved.power_divisor});
  if (loss_scaler && !saved.loss_scaler.empty()) loss_scaler->load_state(saved.loss_scaler);
  // The memory model training used at that step (online corrections included), unless another
  // world size changes what a rank holds.
  memory_model_from_checkpoint =
      engine->restore_memory_state({saved.memory_model, saved.calibration}, saved.world_size == dist.world_size());
  task.restore_extra_state(saved.task_state);
  outcome.counters = RunCounters::from_json(saved.counters);
  outcome.counters.microbatches_per_rank.resize(static_cast<std::size_t>(dist.world_size()), 0);
  early_stopping.restore(saved.early_stopping);
  outcome.early_stopped = saved.early_stopped;
  outcome.resumed_from_step = saved.step;
  last_checkpoint_step = saved.step;
  if (!outcome.counters.validations.empty()) {
    const nlohmann::json& last = outcome.counters.validations.back();
    last_validation_step = last.at("step").get<std::int64_t>();
    for (const auto& [key, value] : last.items()) {
      if (key.rfind("val_", 0) == 0 && value.is_number()) outcome.last_validation[key.substr(4)] = value.get<double>();
    }
  }
}

}  // namespace xpm
