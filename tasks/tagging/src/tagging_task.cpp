#include "xpm/tasks/tagging_task.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/trainer/options/weight_decay_groups.hpp"

namespace xpm {
namespace {

// LibTorch 1.13's autograd engine keeps the gradients of a backward() that ran out of memory
// (those computed but not yet consumed) until the next backward() on the same thread: measured
// 39.8 MB after a BiLSTM probe (bs 12, l 180) that hit the cap in backward, enough to inflate
// the next probe's peak by as much or make it run out of memory too. A tiny backward, with the
// cap lifted for its few bytes, releases them.
void release_failed_backward_buffers() {
  CpuMemoryMeter& meter = CpuMemoryMeter::instance();
  const std::int64_t capacity_bytes = meter.capacity_bytes();
  meter.set_capacity_bytes(0);
  try {
    torch::zeros({1}, torch::requires_grad()).sum().backward();
  } catch (...) {
    meter.set_capacity_bytes(capacity_bytes);
    throw;
  }
  meter.set_capacity_bytes(capacity_bytes);
}

}  // namespace

TaggingData load_tagging_data(const TaggingJobConfig& config) {
  const BrownCorpus corpus = read_brown_corpus(config.data_dir);
  CorpusSplit split = split_by_file(corpus, config.validation_every_files);
  if (config.max_validation_sentences > 0 &&
      split.validation.size() > static_cast<std::size_t>(config.max_validation_sentences)) {
    split.validation.resize(static_cast<std::size_t>(config.max_validation_sentences));
  }
  TaggingData data;
  data.file_count = corpus.files.size();
  data.vocab = Vocabulary::build(split.train, config.vocab_size, config.min_word_count);
  data.tags = TagSet::build(split.train);
  data.train = encode(split.train, data.vocab, data.tags);
  data.validation = encode(split.validation, data.vocab, data.tags);
  data.train_sentences = std::move(split.train);
  data.validation_sentences = std::move(split.validation);
  for (const auto* set : {&data.train, &data.validation}) {
    for (const auto& s : *set) data.max_length = std::max(data.max_length, s.token_ids.size());
  }
  return data;
}

TransformerTaggerOptions model_options_for(const TaggingJobConfig& config, const TaggingData& data) {
  TransformerTaggerOptions options = config.model;
  options.vocab_size = static_cast<std::int64_t>(data.vocab.size());
  options.num_tags = static_cast<std::int64_t>(data.tags.size());
  options.max_length =
      std::max<std::int64_t>(options.max_length, static_cast<std::int64_t>(data.max_length));
  return options;
}

BiLstmTaggerOptions bilstm_options_for(const TaggingJobConfig& config, const TaggingData& data) {
  BiLstmTaggerOptions options = config.bilstm;
  options.vocab_size = static_cast<std::int64_t>(data.vocab.size());
  options.num_tags = static_cast<std::int64_t>(data.tags.size());
  return options;
}

std::int64_t max_sequence_length(const TaggingJobConfig& config, const TaggingData& data) {
  if (config.architecture == TaggingArchitecture::kBilstm) return std::numeric_limits<std::int64_t>::max();
  return model_options_for(config, data).max_length;
}

std::string default_cost_formula(TaggingArchitecture architecture) {
  return architecture == TaggingArchitecture::kBilstm ? "a*bs*(l-1) + b*bs + c" : "a*bs*l^2 + b*bs*l + c";
}

TaggingModel make_tagging_model(const TaggingJobConfig& config, const TaggingData& data) {
  TaggingModel model;
  model.architecture = config.architecture;
  if (config.architecture == TaggingArchitecture::kTransformer) {
    TransformerTagger transformer(model_options_for(config, data));
    model.module = transformer.ptr();
    model.forward = [transformer](const torch::Tensor& token_ids,
                                  const torch::Tensor& padding_mask) mutable {
      return transformer->forward(token_ids, padding_mask);
    };
    model.vocab_size = transformer->options().vocab_size;
    model.num_tags = transformer->options().num_tags;
    model.max_length = transformer->options().max_length;
  } else {
    BiLstmTagger bilstm(bilstm_options_for(config, data));
    model.module = bilstm.ptr();
    model.forward = [bilstm](const torch::Tensor& token_ids,
                             const torch::Tensor& padding_mask) mutable {
      return bilstm->forward(token_ids, padding_mask);
    };
    model.vocab_size = bilstm->options().vocab_size;
    model.num_tags = bilstm->options().num_tags;
    model.max_length = std::numeric_limits<std::int64_t>::max();
  }
  // Mixed precision: autocast around the forward only; the logits come back as float32, so the
  // loss, backward's start, the master weights and AdamW stay float32 (precision.hpp). Every
  // forward of the job goes through here: probes, training steps and validation.
  const Precision precision = config.precision;
  if (precision != Precision::k32True) {
    model.forward = [inner = std::move(model.forward), precision](const torch::Tensor& token_ids,
                                                                 const torch::Tensor& padding_mask) {
      torch::Tensor logits;
      {
        AutocastGuard autocast(precision, token_ids.device().type());
        logits = inner(token_ids, padding_mask);
      }
      return logits.to(torch::kFloat32);
    };
  }
  // Batches are built on the CPU; the forward takes them to the model's device (no copy there).
  model.forward = [inner = std::move(model.forward), module = model.module](const torch::Tensor& token_ids,
                                                                          const torch::Tensor& padding_mask) {
    const torch::Device device = module->parameters().front().device();
    return inner(token_ids.to(device), padding_mask.to(device));
  };
  return model;
}

TaggingModelSetup::TaggingModelSetup(const TaggingJobConfig& config, const TaggingData& data,
                                     const std::function<void(torch::nn::Module&)>& before_optimizer,
                                     DistributedContext* dist)
    : model_(make_tagging_model(config, data)) {
  model_.module->train();
  if (before_optimizer) before_optimizer(*model_.module);
  torch::optim::AdamWOptions adamw(config.learning_rate);
  adamw.weight_decay(config.weight_decay);
  if (config.sharding == ShardingStrategy::kShardGradOp) {
    ShardedAdamWOptions options;
    options.strategy = ShardingStrategy::kShardGradOp;
    options.rank = dist != nullptr ? dist->rank() : 0;
    options.world_size = dist != nullptr ? dist->world_size() : 1;
    options.max_grad_norm = config.clip_grad_norm;  // the global norm, over the owned slices
    const std::vector<torch::optim::OptimizerParamGroup> groups =
        config.weight_decay_groups
            ? adamw_param_groups(*model_.module, adamw)
            : std::vector<torch::optim::OptimizerParamGroup>{
                  torch::optim::OptimizerParamGroup(model_.module->parameters())};
    sharded_ = std::make_unique<ShardedAdamW>(groups, adamw, options, dist);
    sharded_->allocate_state();  // this rank's slice of the moments: the steady state
    set_learning_rate(0.0);
    return;
  }
  optimizer_ = config.weight_decay_groups
                   ? std::make_unique<torch::optim::AdamW>(adamw_param_groups(*model_.module, adamw), adamw)
                   : std::make_unique<torch::optim::AdamW>(model_.module->parameters(), adamw);
  for (auto& parameter : model_.module->parameters()) {
    if (!parameter.requires_grad()) continue;  // frozen: no gradient, no AdamW state
    parameter.mutable_grad() = torch::zeros_like(parameter);  // gradients stay allocated
  }
  set_learning_rate(0.0);
  optimizer_->step();  // allocates the AdamW state; lr 0 leaves the parameters unchanged
  reset_optimizer_state();
}

void TaggingModelSetup::set_learning_rate(double lr) {
  for (auto& group : optimizer().param_groups()) group.options().set_lr(lr);
}

std::int64_t TaggingModelSetup::optimizer_state_bytes() const {
  if (sharded_) return sharded_->state_bytes();
  std::int64_t bytes = 0;
  for (const auto& entry : optimizer_->state()) {
    const auto& state = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
    for (const torch::Tensor& t : {state.exp_avg(), state.exp_avg_sq(), state.max_exp_avg_sq()}) {
      if (t.defined()) bytes += static_cast<std::int64_t>(t.nbytes());
    }
  }
  return bytes;
}

void TaggingModelSetup::reset_optimizer_state() {
  if (sharded_) {
    sharded_->reset_state();
    return;
  }
  for (auto& entry : optimizer_->state()) {
    auto& state = static_cast<torch::optim::AdamWParamState&>(*entry.second);
    state.step(0);
    state.exp_avg().zero_();
    state.exp_avg_sq().zero_();
    if (state.max_exp_avg_sq().defined()) state.max_exp_avg_sq().zero_();
  }
}

TorchProbeSteps TaggingModelSetup::probe_steps() {
  TorchProbeSteps steps;
  steps.forward_backward = [this](const std::vector<double>& dims) {
    const TaggingBatch batch =
        synthetic_batch(static_cast<std::int64_t>(dims.at(0)), static_cast<std::int64_t>(dims.at(1)),
                        model_.vocab_size, model_.num_tags);
    try {
      torch::Tensor loss =
          token_cross_entropy_sum(model_.forward(batch.token_ids, batch.padding_mask),
                                  batch.tag_ids) /
          static_cast<double>(batch.real_tokens);
      loss.backward();
    } catch (const c10::OutOfMemoryError&) {
      release_failed_backward_buffers();  // the next probe measures only itself
      throw;
    }
  };
  // Under shard_grad_op: the same allocations as a training step, no collective (rank 0
  // probes alone while the other ranks wait).
  steps.optimizer_step = [this] {
    if (sharded_) {
      sharded_->step_local();
    } else {
      optimizer_->step();
    }
  };
  steps.zero_grad = [this] {
    if (sharded_) {
      sharded_->zero_grad();
    } else {
      zero_gradients_in_place(*optimizer_);
    }
  };
  return steps;
}

nlohmann::json TaggingModelSetup::signature() const {
  nlohmann::json parameters = nlohmann::json::array();
  for (const auto& item : model_.module->named_parameters()) {
    parameters.push_back({{"name", item.key()},
                          {"shape", item.value().sizes().vec()},
                          {"dtype", std::string(c10::toString(item.value().scalar_type()))}});
  }
  return parameters;
}

}  // namespace xpm
