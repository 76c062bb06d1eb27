#include "xpm/tasks/transformer_tagger.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <variant>

#include <ATen/autocast_mode.h>

#include "xpm/trainer/options/activation_checkpoint.hpp"

namespace xpm {

void TransformerTaggerOptions::validate() const {
  const auto positive = [](std::int64_t value, const char* field) {
    if (value <= 0) {
      throw std::invalid_argument(std::string("TransformerTaggerOptions.") + field +
                                  " must be > 0, got " + std::to_string(value));
    }
  };
  positive(vocab_size, "vocab_size");
  positive(num_tags, "num_tags");
  positive(d_model, "d_model");
  positive(nhead, "nhead");
  positive(dim_feedforward, "dim_feedforward");
  positive(num_layers, "num_layers");
  positive(max_length, "max_length");
  if (d_model % nhead != 0) {
    throw std::invalid_argument("TransformerTaggerOptions.d_model (" + std::to_string(d_model) +
                                ") must be divisible by nhead (" + std::to_string(nhead) + ")");
  }
  if (!(dropout >= 0 && dropout < 1)) {
    throw std::invalid_argument("TransformerTaggerOptions.dropout must be in [0, 1), got " +
                                std::to_string(dropout));
  }
}

torch::Tensor encoder_layer_forward(torch::nn::TransformerEncoderLayerImpl& layer, const torch::Tensor& src,
                                    const torch::Tensor& padding_mask) {
  namespace F = torch::nn::functional;
  torch::nn::MultiheadAttentionImpl& attention = *layer.self_attn;
  if (!std::get_if<torch::enumtype::kReLU>(&layer.options.activation()) || !attention._qkv_same_embed_dim ||
      attention.bias_k.defined() || attention.options.add_zero_attn()) {
    throw std::invalid_argument("encoder_layer_forward: only ReLU layers with packed self-attention weights and "
                                "no key/value biases are supported");
  }
  const std::int64_t length = src.size(0);
  const std::int64_t batch = src.size(1);
  const std::int64_t width = src.size(2);
  const std::int64_t heads = attention.options.num_heads();
  const std::int64_t head_dim = width / heads;
  // Self-attention (torch/nn/functional/activation.h, multi_head_attention_forward).
  const auto qkv = F::linear(src, attention.in_proj_weight, attention.in_proj_bias).chunk(3, /*dim=*/-1);
  const double scaling = 1 / std::sqrt(head_dim);
  torch::Tensor q = (qkv[0] * scaling).contiguous().view({length, batch * heads, head_dim}).transpose(0, 1);
  torch::Tensor k = qkv[1].contiguous().view({-1, batch * heads, head_dim}).transpose(0, 1);
  torch::Tensor v = qkv[2].contiguous().view({-1, batch * heads, head_dim}).transpose(0, 1);
  torch::Tensor weights = torch::bmm(q, k.transpose(1, 2));  // [bs * heads, l, l]
  if (padding_mask.defined()) {
    weights = weights.view({batch, heads, length, length})
                  .masked_fill(padding_mask.unsqueeze(1).unsqueeze(2), -std::numeric_limits<double>::infinity())
                  .view({batch * heads, length, length});
  }
  weights = F::softmax(weights, /*dim=*/-1);
  weights = F::dropout(weights, F::DropoutFuncOptions().p(attention.options.dropout()).training(attention.is_training()));
  torch::Tensor attended = torch::bmm(weights, v).transpose(0, 1).contiguous().view({length, batch, width});
  attended = F::linear(attended, attention.out_proj->weight, attention.out_proj->bias);
  // Add & norm, feed-forward, add & norm (TransformerEncoderLayerImpl::forward).
  const torch::Tensor x = layer.norm1(src + layer.dropout1(attended));
  return layer.norm2(x + layer.dropout2(layer.linear2(layer.dropout(F::relu(layer.linear1(x))))));
}

namespace {

// LibTorch's layer forward, or encoder_layer_forward when autocast is on for the input's device.
torch::Tensor run_encoder_layer(torch::nn::TransformerEncoderLayerImpl& layer, const torch::Tensor& src,
                                const torch::Tensor& padding_mask) {
  const bool autocast = at::autocast::is_autocast_enabled(src.device().type());
  return autocast ? encoder_layer_forward(layer, src, padding_mask)
                  : layer.forward(src, /*src_mask=*/torch::Tensor(), padding_mask);
}

}  // namespace

TransformerTaggerImpl::TransformerTaggerImpl(const TransformerTaggerOptions& options)
    : options_(options) {
  options_.validate();
  token_embedding_ = register_module(
      "token_embedding",
      torch::nn::Embedding(torch::nn::EmbeddingOptions(options_.vocab_size, options_.d_model)));
  position_embedding_ = register_module(
      "position_embedding",
      torch::nn::Embedding(torch::nn::EmbeddingOptions(options_.max_length, options_.d_model)));
  auto layer = torch::nn::TransformerEncoderLayer(
      torch::nn::TransformerEncoderLayerOptions(options_.d_model, options_.nhead)
          .dim_feedforward(options_.dim_feedforward)
          .dropout(options_.dropout));
  encoder_ = register_module(
      "encoder", torch::nn::TransformerEncoder(
                     torch::nn::TransformerEncoderOptions(layer, options_.num_layers)));
  classifier_ = register_module("classifier",
                                torch::nn::Linear(options_.d_model, options_.num_tags));
}

torch::Tensor TransformerTaggerImpl::forward(const torch::Tensor& token_ids,
                                             const torch::Tensor& padding_mask) {
  const std::int64_t length = token_ids.size(1);
  TORCH_CHECK(length <= options_.max_length, "TransformerTagger: sequence length ", length,
              " exceeds max_length ", options_.max_length);
  auto positions = torch::arange(length, token_ids.options());
  auto x = token_embedding_(token_ids) + position_embedding_(positions).unsqueeze(0);  // [bs,l,d]
  x = x.transpose(0, 1);                                                          // [l, bs, d]
  const bool checkpointing = options_.activation_checkpointing && is_training() && torch::GradMode::is_enabled();
  const bool autocast = at::autocast::is_autocast_enabled(x.device().type());
  if (checkpointing || autocast) {
    // TransformerEncoderImpl::forward's loop over the layers, then its optional norm.
    for (std::size_t i = 0; i < encoder_->layers->size(); ++i) {
      auto layer = encoder_->layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i);
      if (checkpointing) {
        x = checkpoint([layer, padding_mask](const torch::Tensor& input) {
                         return run_encoder_layer(*layer, input, padding_mask);
                       },
                       x, layer->parameters());
      } else {
        x = run_encoder_layer(*layer, x, padding_mask);
      }
    }
    if (!encoder_->norm.is_empty()) x = encoder_->norm.forward<torch::Tensor>(x);
  } else {
    x = encoder_(x, /*src_mask=*/torch::Tensor(), padding_mask);
  }
  return classifier_(x.transpose(0, 1));                            // [bs, l, num_tags]
}

}  // namespace xpm
