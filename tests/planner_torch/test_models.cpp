// test_models.cpp — the planner's test models (see test_models.hpp).
#include "test_models.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/options/activation_checkpoint.hpp"

namespace xpm::test {
namespace {

constexpr std::int64_t kVocab = 3000;
constexpr std::int64_t kTags = 48;
constexpr std::int64_t kClasses = 10;
constexpr std::int64_t kMaxLength = 512;
constexpr std::uint64_t kSeed = 20261201;

using Dims = std::vector<std::int64_t>;  // variable_names() order, bs first

Dims to_dims(const std::vector<double>& dims) {
  Dims out;
  for (double d : dims) out.push_back(static_cast<std::int64_t>(d));
  return out;
}

// The shared step: summed loss of a synthetic batch, backward, optimizer step at lr 0 (after
// clipping the gradients' norm when clip_norm_ > 0). A model that keeps tensors alive through
// the optimizer step (as user code often does) puts them in alive_, cleared after the step.
class StepModel : public TestModel {
 public:
  TorchProbeSteps probe_steps() override {
    TorchProbeSteps steps;
    steps.forward_backward = [this](const std::vector<double>& dims) {
      torch::Tensor loss = summed_loss(to_dims(dims));
      loss.backward();
      if (keep_alive_) alive_.push_back(loss);
    };
    steps.optimizer_step = [this] {
      if (clip_norm_ > 0) {
        for (auto& group : optimizer_->param_groups()) {
          torch::nn::utils::clip_grad_norm_(group.params(), clip_norm_);
        }
      }
      optimizer_->step();
      alive_.clear();
    };
    steps.zero_grad = [this] {
      alive_.clear();
      optimizer_->zero_grad();
    };
    steps.forward_backward_records = [this](const std::vector<std::vector<double>>& records) {
      summed_loss_of_records(records).backward();
    };
    return steps;
  }

 protected:
  /// Summed loss of a synthetic batch at `dims`.
  virtual torch::Tensor summed_loss(const Dims& dims) = 0;
  /// Summed loss of a synthetic batch of these records (each its own dims); by default the
  /// model builds batches from aggregated dims only.
  virtual torch::Tensor summed_loss_of_records(const std::vector<std::vector<double>>& records) {
    throw std::logic_error(name() + ": builds batches from dims only, not from " + std::to_string(records.size()) +
                           " records");
  }

  /// Sets the optimizer to learning rate 0 and runs one step (bs 2, every other dim 8) so
  /// gradients and optimizer state are allocated (the steady state).
  void start(std::unique_ptr<torch::optim::Optimizer> optimizer) {
    optimizer_ = std::move(optimizer);
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(0.0);
    std::vector<double> warm_up(variable_names().size(), 8.0);
    warm_up[0] = 2;
    TorchProbeSteps steps = probe_steps();
    steps.zero_grad();
    steps.forward_backward(warm_up);
    steps.optimizer_step();
    steps.zero_grad();
  }

  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<torch::Tensor> alive_;
  bool keep_alive_ = false;
  double clip_norm_ = 0;  // > 0: clip_grad_norm_ to it before every optimizer step
};

struct Seeded {
  Seeded() { torch::manual_seed(kSeed); }
};

torch::Tensor tokens(std::int64_t bs, std::int64_t l, std::int64_t vocab) {
  return torch::randint(vocab, {bs, l}, torch::kLong);
}

// Summed cross-entropy of `logits` [n, classes] against random labels.
torch::Tensor summed_cross_entropy(const torch::Tensor& logits) {
  const std::int64_t n = logits.size(0), classes = logits.size(1);
  return torch::nn::functional::cross_entropy(
      logits, torch::randint(classes, {n}, torch::kLong),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

class TransformerTagger final : public StepModel {
 public:
  TransformerTagger() {
    net_->register_module("embedding", embedding_);
    net_->register_module("position", position_);
    net_->register_module("encoder", encoder_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::Adam>(net_->parameters(), torch::optim::AdamOptions(1e-3)));
  }
  std::string name() const override { return "transformer tagger (torch::nn::TransformerEncoder, Adam)"; }
  std::vector<std::string> variable_names() const override { return {"bs", "l"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), l = dims.at(1);
    const torch::Tensor x = tokens(bs, l, kVocab);
    const torch::Tensor positions = torch::arange(l, torch::kLong);
    torch::Tensor h = embedding_(x) + position_(positions).unsqueeze(0);  // [bs, l, 64]
    h = encoder_(h.transpose(0, 1)).transpose(0, 1);                      // [bs, l, 64]
    const torch::Tensor logits = out_(h).reshape({bs * l, kTags});
    return summed_cross_entropy(logits);
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding embedding_{kVocab, 64};
  torch::nn::Embedding position_{kMaxLength, 64};
  torch::nn::TransformerEncoder encoder_{torch::nn::TransformerEncoderOptions(
      torch::nn::TransformerEncoderLayerOptions(64, 4).dim_feedforward(128).dropout(0.1), 2)};
  torch::nn::Linear out_{64, kTags};
};

class GruTagger final : public StepModel {
 public:
  GruTagger() {
    net_->register_module("embedding", embedding_);
    net_->register_module("gru", gru_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::SGD>(net_->parameters(),
                                              torch::optim::SGDOptions(1e-2).momentum(0.9)));
  }
  std::string name() const override { return "bidirectional GRU tagger (SGD with momentum)"; }
  std::vector<std::string> variable_names() const override { return {"bs", "l"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), l = dims.at(1);
    const torch::Tensor h = std::get<0>(gru_(embedding_(tokens(bs, l, kVocab))));  // [bs, l, 128]
    const torch::Tensor logits = out_(h).reshape({bs * l, kTags});
    return summed_cross_entropy(logits);
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding embedding_{kVocab, 64};
  torch::nn::GRU gru_{torch::nn::GRUOptions(64, 64).batch_first(true).bidirectional(true)};
  torch::nn::Linear out_{128, kTags};
};

class ConvClassifier final : public StepModel {
 public:
  ConvClassifier() {
    net_->register_module("embedding", embedding_);
    net_->register_module("conv1", conv1_);
    net_->register_module("conv2", conv2_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::RMSprop>(net_->parameters(),
                                                  torch::optim::RMSpropOptions(1e-3)));
  }
  std::string name() const override { return "convolution text classifier (Conv1d x2, RMSprop)"; }
  std::vector<std::string> variable_names() const override { return {"bs", "l"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), l = dims.at(1);
    torch::Tensor h = embedding_(tokens(bs, l, kVocab)).transpose(1, 2);  // [bs, 48, l]
    h = torch::relu(conv1_(h));                                          // [bs, 96, l]
    h = torch::relu(conv2_(h));                                          // [bs, 96, l]
    const torch::Tensor pooled = std::get<0>(h.max(2));                  // [bs, 96]
    return summed_cross_entropy(out_(pooled));
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding embedding_{kVocab, 48};
  torch::nn::Conv1d conv1_{torch::nn::Conv1dOptions(48, 96, 5).padding(2)};
  torch::nn::Conv1d conv2_{torch::nn::Conv1dOptions(96, 96, 3).padding(1)};
  torch::nn::Linear out_{96, kClasses};
};

// One pre-norm block: x + attention(norm(x)), then x + ffn(norm(x)); causal: each position
// attends to itself and the positions before it.
struct PreNormBlockImpl : torch::nn::Module {
  explicit PreNormBlockImpl(bool causal = false)
      : causal(causal),
        norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})))),
        norm2(register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})))),
        qkv(register_module("qkv", torch::nn::Linear(64, 3 * 64))),
        proj(register_module("proj", torch::nn::Linear(64, 64))),
        up(register_module("up", torch::nn::Linear(64, 256))),
        down(register_module("down", torch::nn::Linear(256, 64))) {}

  torch::Tensor forward(const torch::Tensor& x) {  // [bs, l, 64]
    const std::int64_t bs = x.size(0), l = x.size(1), heads = 4, head_dim = 16;
    const std::vector<torch::Tensor> parts =
        qkv(norm1(x)).view({bs, l, 3, heads, head_dim}).permute({2, 0, 3, 1, 4}).unbind(0);
    torch::Tensor scores =
        torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    if (causal) scores = scores.masked_fill(torch::ones({l, l}, torch::kBool).triu(1), -INFINITY);
    const torch::Tensor attention = torch::softmax(scores, -1);  // [bs, heads, l, l]
    const torch::Tensor mixed =
        torch::matmul(attention, parts[2]).transpose(1, 2).reshape({bs, l, 64});
    const torch::Tensor h = x + proj(mixed);
    return h + down(torch::gelu(up(norm2(h))));
  }

  bool causal;
  torch::nn::LayerNorm norm1, norm2;
  torch::nn::Linear qkv, proj, up, down;
};
TORCH_MODULE(PreNormBlock);

class PreNormTransformer final : public StepModel {
 public:
  PreNormTransformer() {
    keep_alive_ = true;
    net_->register_module("embedding", embedding_);
    net_->register_module("position", position_);
    net_->register_module("block1", block1_);
    net_->register_module("block2", block2_);
    net_->register_module("norm", norm_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::AdamW>(net_->parameters(),
                                                torch::optim::AdamWOptions(1e-3).weight_decay(0.01)));
  }
  std::string name() const override {
    return "hand-written pre-norm Transformer (AdamW, logits alive during the optimizer step)";
  }
  std::vector<std::string> variable_names() const override { return {"bs", "l"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), l = dims.at(1);
    const torch::Tensor x = tokens(bs, l, kVocab);
    torch::Tensor h = embedding_(x) + position_(torch::arange(l, torch::kLong)).unsqueeze(0);
    h = block2_(block1_(h));
    const torch::Tensor logits = out_(norm_(h)).reshape({bs * l, kTags});  // [bs*l, 48]
    alive_.push_back(logits);  // user code: logits still in scope at optimizer.step()
    return summed_cross_entropy(logits);
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding embedding_{kVocab, 64};
  torch::nn::Embedding position_{kMaxLength, 64};
  PreNormBlock block1_, block2_;
  torch::nn::LayerNorm norm_{torch::nn::LayerNormOptions({64})};
  torch::nn::Linear out_{64, kTags};
};

class ImageCnn final : public StepModel {
 public:
  ImageCnn() {
    net_->register_module("conv1", conv1_);
    net_->register_module("conv2", conv2_);
    net_->register_module("conv3", conv3_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::Adagrad>(net_->parameters(),
                                                  torch::optim::AdagradOptions(1e-2)));
  }
  std::string name() const override { return "image CNN (Conv2d x3 over hw x hw RGB, Adagrad)"; }
  std::vector<std::string> variable_names() const override { return {"bs", "hw"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), hw = dims.at(1);
    torch::Tensor h = torch::relu(conv1_(torch::randn({bs, 3, hw, hw})));  // [bs, 32, hw, hw]
    h = torch::max_pool2d(h, 2);                                            // [bs, 32, hw/2, hw/2]
    h = torch::relu(conv2_(h));                                             // [bs, 64, hw/2, hw/2]
    h = torch::max_pool2d(h, 2);                                            // [bs, 64, hw/4, hw/4]
    h = torch::relu(conv3_(h));                                             // [bs, 64, hw/4, hw/4]
    const torch::Tensor pooled = h.mean({2, 3});                            // [bs, 64]
    return summed_cross_entropy(out_(pooled));
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Conv2d conv1_{torch::nn::Conv2dOptions(3, 32, 3).padding(1)};
  torch::nn::Conv2d conv2_{torch::nn::Conv2dOptions(32, 64, 3).padding(1)};
  torch::nn::Conv2d conv3_{torch::nn::Conv2dOptions(64, 64, 3).padding(1)};
  torch::nn::Linear out_{64, kClasses};
};

constexpr std::int64_t kTargetVocab = 512;
constexpr std::int64_t kChars = 96;

class EncoderDecoder final : public StepModel {
 public:
  EncoderDecoder() {
    net_->register_module("source_embedding", source_embedding_);
    net_->register_module("target_embedding", target_embedding_);
    net_->register_module("position", position_);
    net_->register_module("transformer", transformer_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::Adam>(net_->parameters(), torch::optim::AdamOptions(1e-3)));
  }
  std::string name() const override {
    return "encoder-decoder Transformer (torch::nn::Transformer, source and target lengths, Adam)";
  }
  std::vector<std::string> variable_names() const override { return {"bs", "ls", "lt"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), ls = dims.at(1), lt = dims.at(2);
    const torch::Tensor source = source_embedding_(tokens(bs, ls, kVocab)) +
                                 position_(torch::arange(ls, torch::kLong)).unsqueeze(0);  // [bs, ls, 64]
    const torch::Tensor target = target_embedding_(tokens(bs, lt, kTargetVocab)) +
                                 position_(torch::arange(lt, torch::kLong)).unsqueeze(0);  // [bs, lt, 64]
    const torch::Tensor causal = torch::nn::TransformerImpl::generate_square_subsequent_mask(lt);
    const torch::Tensor h =  // [bs, lt, 64]
        transformer_->forward(source.transpose(0, 1), target.transpose(0, 1), {}, causal).transpose(0, 1);
    return summed_cross_entropy(out_(h).reshape({bs * lt, kTargetVocab}));  // [bs*lt, 512]
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding source_embedding_{kVocab, 64};
  torch::nn::Embedding target_embedding_{kTargetVocab, 64};
  torch::nn::Embedding position_{kMaxLength, 64};
  torch::nn::Transformer transformer_{
      torch::nn::TransformerOptions(64, 4, 1, 1).dim_feedforward(128).dropout(0.1)};
  torch::nn::Linear out_{64, kTargetVocab};
};

class VariableImageCnn final : public StepModel {
 public:
  VariableImageCnn() {
    net_->register_module("conv1", conv1_);
    net_->register_module("norm1", norm1_);
    net_->register_module("conv2", conv2_);
    net_->register_module("norm2", norm2_);
    net_->register_module("conv3", conv3_);
    net_->register_module("norm3", norm3_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::SGD>(
        net_->parameters(),
        torch::optim::SGDOptions(1e-2).momentum(0.9).nesterov(true).weight_decay(5e-4)));
  }
  std::string name() const override {
    return "variable-size image CNN (Conv2d + BatchNorm2d x3 over h x w RGB, SGD Nesterov)";
  }
  std::vector<std::string> variable_names() const override { return {"bs", "h", "w"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), h = dims.at(1), w = dims.at(2);
    torch::Tensor x = torch::relu(norm1_(conv1_(torch::randn({bs, 3, h, w}))));  // [bs, 16, h, w]
    x = torch::max_pool2d(x, 2);                                                 // [bs, 16, h/2, w/2]
    x = torch::relu(norm2_(conv2_(x)));                                          // [bs, 32, h/2, w/2]
    x = torch::max_pool2d(x, 2);                                                 // [bs, 32, h/4, w/4]
    x = torch::relu(norm3_(conv3_(x)));                                          // [bs, 64, h/4, w/4]
    return summed_cross_entropy(out_(x.mean({2, 3})));                           // [bs, 10]
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Conv2d conv1_{torch::nn::Conv2dOptions(3, 16, 3).padding(1)};
  torch::nn::BatchNorm2d norm1_{16};
  torch::nn::Conv2d conv2_{torch::nn::Conv2dOptions(16, 32, 3).padding(1)};
  torch::nn::BatchNorm2d norm2_{32};
  torch::nn::Conv2d conv3_{torch::nn::Conv2dOptions(32, 64, 3).padding(1)};
  torch::nn::BatchNorm2d norm3_{64};
  torch::nn::Linear out_{64, kClasses};
};

class CheckpointedCharLm final : public StepModel {
 public:
  CheckpointedCharLm() {
    clip_norm_ = 1.0;
    net_->register_module("embedding", embedding_);
    net_->register_module("position", position_);
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      net_->register_module("block" + std::to_string(i), blocks_[i]);
    }
    net_->register_module("norm", norm_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::SGD>(net_->parameters(),
                                              torch::optim::SGDOptions(1e-2).momentum(0.9)));
  }
  std::string name() const override {
    return "character LM, activation checkpointing (label smoothing, clipping, SGD momentum)";
  }
  std::vector<std::string> variable_names() const override { return {"bs", "l"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    const std::int64_t bs = dims.at(0), l = dims.at(1);
    torch::Tensor h = embedding_(tokens(bs, l, kChars)) +
                      position_(torch::arange(l, torch::kLong)).unsqueeze(0);  // [bs, l, 64]
    for (PreNormBlock& block : blocks_) {
      h = xpm::checkpoint([block](const torch::Tensor& in) mutable { return block->forward(in); }, h,
                          block->parameters());  // [bs, l, 64], only the block's input kept
    }
    const torch::Tensor logits = out_(norm_(h)).reshape({bs * l, kChars});  // [bs*l, 96]
    return torch::nn::functional::cross_entropy(
        logits, torch::randint(kChars, {bs * l}, torch::kLong),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).label_smoothing(0.1));
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding embedding_{kChars, 64};
  torch::nn::Embedding position_{kMaxLength, 64};
  std::vector<PreNormBlock> blocks_{PreNormBlock(true), PreNormBlock(true), PreNormBlock(true)};
  torch::nn::LayerNorm norm_{torch::nn::LayerNormOptions({64})};
  torch::nn::Linear out_{64, kChars};
};

// Lengths of a packed batch: from l down to about l/2, evenly spread, longest first (what
// pack_padded_sequence wants); the same for the same {bs, l}, so a shape has one peak.
torch::Tensor spread_lengths(std::int64_t bs, std::int64_t l) {
  std::vector<std::int64_t> lengths;
  for (std::int64_t i = 0; i < bs; ++i) lengths.push_back(l - i * l / (2 * bs));
  return torch::tensor(lengths, torch::kLong);  // [bs]
}

class PackedLstm final : public StepModel {
 public:
  PackedLstm() {
    net_->register_module("embedding", embedding_);
    net_->register_module("lstm", lstm_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::Adam>(net_->parameters(), torch::optim::AdamOptions(1e-3)));
  }
  std::string name() const override { return "LSTM tagger over packed sequences (2 layers, Adam)"; }
  std::vector<std::string> variable_names() const override { return {"bs", "l"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {
    return loss_of_lengths(spread_lengths(dims.at(0), dims.at(1)));
  }
  // Records {1, l, ...}: each its own length l (a mix of lengths, as real data has).
  torch::Tensor summed_loss_of_records(const std::vector<std::vector<double>>& records) override {
    std::vector<std::int64_t> lengths;
    for (const std::vector<double>& record : records) lengths.push_back(static_cast<std::int64_t>(record.at(1)));
    std::sort(lengths.rbegin(), lengths.rend());  // pack_padded_sequence wants them longest first
    return loss_of_lengths(torch::tensor(lengths, torch::kLong));
  }
  torch::Tensor loss_of_lengths(const torch::Tensor& lengths) {
    const std::int64_t bs = lengths.size(0), l = lengths.max().item<std::int64_t>();
    const torch::nn::utils::rnn::PackedSequence packed = torch::nn::utils::rnn::pack_padded_sequence(
        embedding_(tokens(bs, l, kVocab)), lengths, /*batch_first=*/true);
    const torch::Tensor h =
        std::get<0>(lstm_->forward_with_packed_input(packed)).data();  // [tokens in the batch, 96]
    return summed_cross_entropy(out_(h));
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding embedding_{kVocab, 64};
  torch::nn::LSTM lstm_{torch::nn::LSTMOptions(64, 96).num_layers(2)};
  torch::nn::Linear out_{96, kTags};
};

// Records {1, l, t, ...} of their own lengths l: a padded token batch [bs, longest l], the real
// tokens first in each row.
torch::Tensor padding_mask(const std::vector<std::vector<double>>& records) {
  std::vector<std::int64_t> lengths;
  for (const std::vector<double>& record : records) lengths.push_back(static_cast<std::int64_t>(record.at(1)));
  const torch::Tensor l = torch::tensor(lengths, torch::kLong);
  return torch::arange(l.max().item<std::int64_t>(), torch::kLong).unsqueeze(0) < l.unsqueeze(1);  // [bs, l]
}

class PackedTokenTagger final : public StepModel {
 public:
  PackedTokenTagger() {
    net_->register_module("embedding", embedding_);
    net_->register_module("up", up_);
    net_->register_module("down", down_);
    net_->register_module("out", out_);
    start(std::make_unique<torch::optim::RMSprop>(net_->parameters(), torch::optim::RMSpropOptions(1e-3)));
  }
  std::string name() const override { return "token tagger over packed real tokens (MLP 48-384-48, RMSprop)"; }
  std::vector<std::string> variable_names() const override { return {"bs", "l", "t"}; }

 private:
  torch::Tensor summed_loss(const Dims& dims) override {  // equal records: t = bs * l
    const auto bs = static_cast<std::size_t>(dims.at(0));
    const auto l = static_cast<double>(dims.at(1));
    return summed_loss_of_records(std::vector<std::vector<double>>(bs, {1.0, l, l}));
  }
  torch::Tensor summed_loss_of_records(const std::vector<std::vector<double>>& records) override {
    const torch::Tensor real = padding_mask(records);
    const torch::Tensor packed = embedding_(tokens(real.size(0), real.size(1), kVocab)).index({real});  // [t, 48]
    const torch::Tensor hidden = down_(torch::gelu(up_(packed)));                                      // [t, 48]
    return summed_cross_entropy(out_(hidden));
  }

  Seeded seeded_;  // first: the layers below are initialized from the seeded generator
  std::shared_ptr<torch::nn::Module> net_ = std::make_shared<torch::nn::Module>();
  torch::nn::Embedding embedding_{kVocab, 48};
  torch::nn::Linear up_{48, 384};
  torch::nn::Linear down_{384, 48};
  torch::nn::Linear out_{48, kTags};
};

}  // namespace

std::unique_ptr<TestModel> make_test_model(TestModelKind kind) {
  switch (kind) {
    case TestModelKind::kTransformerTagger: return std::make_unique<TransformerTagger>();
    case TestModelKind::kGruTagger: return std::make_unique<GruTagger>();
    case TestModelKind::kConvClassifier: return std::make_unique<ConvClassifier>();
    case TestModelKind::kPreNormTransformer: return std::make_unique<PreNormTransformer>();
    case TestModelKind::kImageCnn: return std::make_unique<ImageCnn>();
    case TestModelKind::kEncoderDecoder: return std::make_unique<EncoderDecoder>();
    case TestModelKind::kVariableImageCnn: return std::make_unique<VariableImageCnn>();
    case TestModelKind::kCheckpointedCharLm: return std::make_unique<CheckpointedCharLm>();
    case TestModelKind::kPackedLstm: return std::make_unique<PackedLstm>();
    case TestModelKind::kPackedTokenTagger: return std::make_unique<PackedTokenTagger>();
  }
  throw std::invalid_argument("make_test_model: unknown kind");
}

std::vector<TestModelKind> all_test_model_kinds() {
  return {TestModelKind::kTransformerTagger, TestModelKind::kGruTagger,
          TestModelKind::kConvClassifier, TestModelKind::kPreNormTransformer,
          TestModelKind::kImageCnn, TestModelKind::kEncoderDecoder,
          TestModelKind::kVariableImageCnn, TestModelKind::kCheckpointedCharLm,
          TestModelKind::kPackedLstm, TestModelKind::kPackedTokenTagger};
}

}  // namespace xpm::test
