#include "xpm/trainer/transformer_tagger.hpp"

#include <stdexcept>
#include <string>

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
  x = encoder_(x.transpose(0, 1), /*src_mask=*/torch::Tensor(), padding_mask);  // [l, bs, d]
  return classifier_(x.transpose(0, 1));                            // [bs, l, num_tags]
}

}  // namespace xpm
