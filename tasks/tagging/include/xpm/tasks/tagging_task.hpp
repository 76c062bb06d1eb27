// xpm/tasks/tagging_task.hpp — the bundled task's pieces shared by training (tagging_job),
// probing without training (tagging_probe) and the benchmarks: corpus data, the model of the
// config's architecture (transformer or bilstm) behind one interface, AdamW with its state
// allocated, and the probe steps.
//
//   TaggingData data = load_tagging_data(config);         // corpus, split, vocabulary, tags
//   TaggingModelSetup setup(config, data);                 // model + AdamW, state allocated
//   torch::Tensor logits = setup.forward(token_ids, padding_mask);  // [bs, l, num_tags]
//   TorchProbeExecutor executor(setup.probe_steps(), CpuMemoryMeter::instance());
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/tasks/bilstm_tagger.hpp"
#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"
#include "xpm/tasks/tagging_job.hpp"
#include "xpm/tasks/transformer_tagger.hpp"

namespace xpm {

struct TaggingData {
  std::size_t file_count = 0;
  std::vector<TaggedSentence> train_sentences;
  std::vector<TaggedSentence> validation_sentences;
  Vocabulary vocab;
  TagSet tags;
  std::vector<EncodedSentence> train;       // encoded train_sentences
  std::vector<EncodedSentence> validation;  // encoded validation_sentences
  std::size_t max_length = 0;               // longest sentence over both splits (tokens)
};

/// Reads the corpus in config.data_dir, splits it and encodes it (see brown_corpus.hpp).
/// Throws std::runtime_error naming the path for missing or malformed data.
TaggingData load_tagging_data(const TaggingJobConfig& config);

/// The Transformer options the config asks for (config.model), completed from the data
/// (vocabulary size, tags, max_length at least the longest sentence).
TransformerTaggerOptions model_options_for(const TaggingJobConfig& config, const TaggingData& data);

/// The BiLSTM options the config asks for (config.bilstm), completed from the data (vocabulary
/// size, tags).
BiLstmTaggerOptions bilstm_options_for(const TaggingJobConfig& config, const TaggingData& data);

/// Longest padded length (tokens) the config's model accepts: the Transformer's max_length (at
/// least the longest sentence), or std::numeric_limits<std::int64_t>::max() for the BiLSTM,
/// which has no position limit.
std::int64_t max_sequence_length(const TaggingJobConfig& config, const TaggingData& data);

/// The bundled cost formula (bytes, variables bs and l, coefficients a, b, c) of an
/// architecture: "a*bs*l^2 + b*bs*l + c" for the Transformer (attention scores are bs x heads x
/// l x l), "a*bs*(l-1) + b*bs + c" for the BiLSTM (bilstm_tagger.hpp says why). Throws
/// std::invalid_argument for an unknown architecture.
std::string default_cost_formula(TaggingArchitecture architecture);

/// The model of the config's architecture behind the forward signature both taggers share.
struct TaggingModel {
  TaggingArchitecture architecture = TaggingArchitecture::kTransformer;
  std::shared_ptr<torch::nn::Module> module;  // parameters, train()/eval(), to()
  /// token_ids [bs, l] int64, padding_mask [bs, l] bool (true at padding, right padding) ->
  /// logits [bs, l, num_tags] float32.
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> forward;
  std::int64_t vocab_size = 0;               // embedding rows
  std::int64_t num_tags = 0;                 // classifier outputs
  std::int64_t max_length = 0;               // longest padded length accepted (tokens)
};

/// Builds a freshly initialized model of config.architecture (from the torch RNG), options
/// completed from the data. With config.precision other than k32True, `forward` runs the
/// model under AutocastGuard (precision.hpp) and returns float32 logits [bs, l, num_tags], so
/// probes, training steps and validation all see the same precision. Throws
/// std::invalid_argument for a bad architecture, options or precision.
TaggingModel make_tagging_model(const TaggingJobConfig& config, const TaggingData& data);

/// Model and AdamW with the gradients and optimizer state allocated, as in steady-state
/// training, for either architecture. Construct after installing the CpuMemoryMeter so the
/// static memory is counted.
///
/// With config.sharding kShardGradOp the optimizer is a ShardedAdamW (sharded_optimizer.hpp)
/// over `dist`'s ranks: the parameters and their gradients become views of flat buffers and this
/// rank allocates the AdamW state of its 1/world_size slice only, so the static bytes measured
/// after construction are what this rank holds. optimizer() is then the AdamW over the owned
/// slice (learning rates, state); steps go through sharded_optimizer(). Probe steps never issue
/// collectives (ShardedAdamW::step_local), so rank 0 probes alone while the others wait.
class TaggingModelSetup {
 public:
  /// Throws std::invalid_argument for a bad architecture, model options or sharding.
  /// `before_optimizer`, when given, runs on the freshly built model before the optimizer is
  /// built and before gradients and optimizer state are allocated (initialization hooks,
  /// loading parameters, freezing); parameters it leaves with requires_grad false get no
  /// gradient and no AdamW state (AdamW skips a parameter without a gradient).
  /// `dist`: the job's context (its rank and world size place the shard), or null for a single
  /// process (world size 1). Construction is not collective.
  TaggingModelSetup(const TaggingJobConfig& config, const TaggingData& data,
                    const std::function<void(torch::nn::Module&)>& before_optimizer = {},
                    DistributedContext* dist = nullptr);

  /// The model as a module: parameters, train()/eval(), state dicts.
  torch::nn::Module& module() { return *model_.module; }
  /// token_ids [bs, l] int64, padding_mask [bs, l] bool (true at padding, at the end of a row)
  /// -> logits [bs, l, num_tags] float32. Throws c10::Error for l above max_length() and
  /// c10::OutOfMemoryError past the CPU cap.
  torch::Tensor forward(const torch::Tensor& token_ids, const torch::Tensor& padding_mask) {
    return model_.forward(token_ids, padding_mask);
  }
  /// The parameters AdamW updates, in registration order.
  std::vector<torch::Tensor> parameters() const { return model_.module->parameters(); }
  /// The AdamW that steps this rank's parameters: over every trainable parameter, or over the
  /// owned flat slices under shard_grad_op (its param groups then hold views of the flat buffer).
  torch::optim::AdamW& optimizer() { return sharded_ ? sharded_->adamw() : *optimizer_; }
  /// The sharded optimizer under shard_grad_op; null otherwise.
  ShardedAdamW* sharded_optimizer() { return sharded_.get(); }
  TaggingArchitecture architecture() const { return model_.architecture; }
  /// Embedding rows and classifier outputs of the model.
  std::int64_t vocab_size() const { return model_.vocab_size; }
  std::int64_t num_tags() const { return model_.num_tags; }
  /// Longest padded length the model accepts (tokens); see max_sequence_length().
  std::int64_t max_length() const { return model_.max_length; }

  /// Bytes of AdamW state this rank holds (moments of every trainable parameter, or of the
  /// owned slice under shard_grad_op), from the state tensors' sizes.
  std::int64_t optimizer_state_bytes() const;
  /// Sets every param group's learning rate.
  void set_learning_rate(double lr);
  /// Back to a fresh AdamW (step 0, zero moments) without freeing the state, so memory stays
  /// at its steady state (ShardedAdamW::reset_state under shard_grad_op).
  void reset_optimizer_state();
  /// Probe steps on synthetic batches of dims {bs, l} (no padding), for either architecture;
  /// the learning rate must be 0 while probing if the model is trained afterwards.
  TorchProbeSteps probe_steps();
  /// Parameter names, shapes and dtypes, in registration order: the model's signature (differs
  /// between architectures, since the parameter names do).
  nlohmann::json signature() const;

 private:
  TaggingModel model_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;  // no_shard
  std::unique_ptr<ShardedAdamW> sharded_;           // shard_grad_op
};

}  // namespace xpm
