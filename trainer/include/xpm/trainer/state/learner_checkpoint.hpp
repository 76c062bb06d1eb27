// xpm/trainer/state/learner_checkpoint.hpp — what a checkpoint of a Learner's run holds so that a
// resumed run continues bit for bit where the stopped one was (CPU, same thread count), and
// how it is written to and read from a CheckpointStore.
//
//   LearnerResumeState state;             // step, epoch, sampler, batcher, counters, listeners
//   save_learner_checkpoint(store, module, optimizer, generator_states, state, config_json,
//                           "my-job", best);
//   std::vector<std::string> warnings;
//   std::optional<LearnerCheckpoint> latest = load_latest_learner_checkpoint(store, &warnings);
//   load_module_state(latest->info.path + "/model.pt", module);        // parameters, buffers
//   load_optimizer_state(latest->info.path + "/optimizer.pt", optimizer);
//
// Files of one checkpoint folder (CheckpointStore writes them atomically with a manifest of
// sizes and CRC-32s; the manifest also holds the job's config):
//   model.pt       parameters and buffers by name (torch::serialize archive)
//   optimizer.pt   torch::save of the AdamW (moments, step counts, param-group options); under
//                  --sharding shard_grad_op the consolidated state (--optimizer-checkpoint full)
//                  or instead one optimizer-rank<r>.pt per rank (ShardedAdamW::save_shard, the
//                  default), which only the same world size and sharding can load
//   rng.pt         each rank's torch CPU generator state ("rank0", "rank1", ...: dropout masks)
//   state.json     LearnerResumeState (and the task's extra state): TrainState (epoch, step, epoch_position), the capacity
//                  the run budgets with (a cap factor times static bytes measured at its start), the sampler's
//                  std::mt19937_64 state and the epoch's order, the memory model the batcher
//                  plans with (online corrections change plans, plans change summation order),
//                  the fixed/power batcher's microbatch size, the summary's running counters,
//                  the early-stopping state.
#pragma once

#include <cstdint>
#include <map>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/trainer/state/checkpoint_store.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"

namespace xpm {

/// state.json of a Learner checkpoint.
struct LearnerResumeState {
  std::int64_t epoch = 0;           // TrainState::epoch
  std::int64_t step = 0;            // TrainState::step (steps done)
  std::int64_t epoch_position = 0;  // outer batches taken from `epoch_order`
  std::int64_t total_steps = 0;     // of the run (checked on resume: the schedule must not change)
  int world_size = 1;               // ranks of the run that wrote it
  std::int64_t capacity_bytes = 0;  // the run's memory capacity (a resumed run budgets with it)
  std::string sampler_state;        // std::mt19937_64 after the epoch's shuffle (operator<<)
  std::vector<std::int64_t> epoch_order;  // the current epoch's order of train records
  nlohmann::json memory_model;      // MemoryModel::to_json of the predictive batcher; null otherwise
  std::int64_t microbatch_size = 0;  // fixed/power batcher's current size (0: predictive)
  std::int64_t power_divisor = 1;   // power batcher's n (microbatch = outer // n)
  nlohmann::json counters;          // RunCounters::to_json
  nlohmann::json early_stopping;    // EarlyStopping::to_json
  bool early_stopped = false;       // the listeners had voted stop (a resume finishes at once)
  std::vector<double> loss_scaler;  // DynamicLossScaler::state() under 16-mixed; empty otherwise (optional)
  nlohmann::json task_state;        // TrainingTask::extra_state() (optional; null: none)
  nlohmann::json learner_settings;  // LearnerOptions::resume_settings() (optional; checked on resume)
  nlohmann::json calibration;  // the Learner's Calibration state (optional; null: none)

  nlohmann::json to_json() const;
  /// Throws std::invalid_argument naming the missing or malformed field.
  static LearnerResumeState from_json(const nlohmann::json& json);
};

/// A checkpoint found for resuming: its folder and manifest, and its state.json.
struct LearnerCheckpoint {
  CheckpointInfo info;
  LearnerResumeState state;
};

/// Writes checkpoint `state.step` through `store` (rank 0 only): model.pt, optimizer.pt,
/// rng.pt (generator_states[r] = rank r's torch CPU generator state), state.json; the
/// manifest gets {"config": config, "kind": kind, "torch_version"}. Marks it best
/// when `is_best`. Returns the folder. Throws std::runtime_error naming the path on failure
/// (earlier checkpoints stay as they were).
std::string save_learner_checkpoint(CheckpointStore& store, const torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer,
                                    const std::vector<torch::Tensor>& generator_states,
                                    const LearnerResumeState& state, const nlohmann::json& config,
                                    const std::string& kind, bool is_best);

/// The same with the optimizer's files given by the caller (name -> writer), e.g. one
/// optimizer-rank<r>.pt per rank under sharding (the Learner's checkpoints), instead of
/// optimizer.pt.
std::string save_learner_checkpoint(CheckpointStore& store, const torch::nn::Module& module,
                                    const std::map<std::string, CheckpointFileWriter>& optimizer_files,
                                    const std::vector<torch::Tensor>& generator_states,
                                    const LearnerResumeState& state, const nlohmann::json& config,
                                    const std::string& kind, bool is_best);

/// Verifies checkpoint folder `path` (CheckpointStore::verify) and reads its manifest and
/// state.json. Throws std::runtime_error with the reason when it is invalid.
LearnerCheckpoint read_learner_checkpoint(const std::string& path);

/// Whether a run of `world_size` ranks under `sharding` can load the checkpoint's optimizer: a
/// consolidated optimizer.pt loads anywhere; per-rank optimizer-rank<r>.pt files only at the
/// world size that wrote them, under shard_grad_op. Throws std::invalid_argument naming the
/// folder, both layouts and what to do otherwise.
void check_optimizer_loadable(const LearnerCheckpoint& checkpoint, int world_size, ShardingStrategy sharding);

/// The newest checkpoint of `store` that verifies (sizes and checksums) and whose state.json
/// parses; every newer one is skipped with its folder and reason appended to `warnings`.
/// nullopt when there is none.
std::optional<LearnerCheckpoint> load_latest_learner_checkpoint(const CheckpointStore& store,
                                                                std::vector<std::string>* warnings);

/// Rank 0 finds the newest checkpoint of `folder` that verifies (load_latest_learner_checkpoint;
/// each skipped one is passed to `warn`) and shares its path; every rank reads it. Throws
/// std::invalid_argument naming every key of `config` outside `free_keys` whose value differs
/// from the checkpoint's manifest ("--resume: checkpoint '...' was written with other settings:
/// ..."), std::runtime_error when the chosen folder cannot be read. nullopt when there is none.
/// Collective over `dist`.
std::optional<LearnerCheckpoint> find_resume_checkpoint(const std::string& folder,
                                                        const CheckpointSettings& settings,
                                                        DistributedContext& dist,
                                                        const nlohmann::json& config,
                                                        const std::set<std::string>& free_keys,
                                                        const std::function<void(const std::string&)>& warn);

/// Parameters and buffers of model.pt copied into `module` by name. Throws std::runtime_error
/// naming the path and the entry when one is missing or its shape differs; LibTorch's error
/// (a file it cannot read) as it is, after "reading '<path>': " (error_context.hpp).
void load_module_state(const std::string& path, torch::nn::Module& module);
/// Parameters and buffers of `module` by name into `path` (a torch::serialize archive).
void save_module_state(const torch::nn::Module& module, const std::string& path);
/// The parameters of `module` by name (final_parameters.pt, best_parameters.pt: the format
/// torch::load into a module of the same architecture reads), written atomically (temporary
/// file, fsync, rename). Throws std::runtime_error naming the path.
void save_parameters_atomically(const torch::nn::Module& module, const std::string& path);
/// The optimizer's state from optimizer.pt (torch::load). LibTorch's errors as they are, after
/// "restoring the optimizer from '<path>': ".
void load_optimizer_state(const std::string& path, torch::optim::Optimizer& optimizer);
/// Rank `rank`'s generator state from rng.pt. Throws std::runtime_error naming the path and
/// rank when it is missing; LibTorch's errors as they are, after "reading '<path>': ".
torch::Tensor load_generator_state(const std::string& path, int rank);

}  // namespace xpm
