#include "xpm/tasks/bilstm_tagger.hpp"

#include <stdexcept>
#include <string>

namespace xpm {

void BiLstmTaggerOptions::validate() const {
  const auto positive = [](std::int64_t value, const char* field) {
    if (value <= 0) {
      throw std::invalid_argument(std::string("BiLstmTaggerOptions.") + field +
                                  " must be > 0, got " + std::to_string(value));
    }
  };
  positive(vocab_size, "vocab_size");
  positive(num_tags, "num_tags");
  positive(embedding_dim, "embedding_dim");
  positive(hidden_size, "hidden_size");
  positive(num_layers, "num_layers");
  if (!(dropout >= 0 && dropout < 1)) {
    throw std::invalid_argument("BiLstmTaggerOptions.dropout must be in [0, 1), got " +
                                std::to_string(dropout));
  }
}

BiLstmTaggerImpl::BiLstmTaggerImpl(const BiLstmTaggerOptions& options) : options_(options) {
  options_.validate();
  token_embedding_ = register_module(
      "token_embedding",
      torch::nn::Embedding(torch::nn::EmbeddingOptions(options_.vocab_size, options_.embedding_dim)));
  lstm_ = register_module(
      "lstm", torch::nn::LSTM(torch::nn::LSTMOptions(options_.embedding_dim, options_.hidden_size)
                                  .num_layers(options_.num_layers)
                                  .dropout(options_.num_layers > 1 ? options_.dropout : 0.0)
                                  .bidirectional(true)
                                  .batch_first(true)));
  dropout_ = register_module("dropout", torch::nn::Dropout(options_.dropout));
  classifier_ = register_module(
      "classifier", torch::nn::Linear(2 * options_.hidden_size, options_.num_tags));
}

torch::Tensor BiLstmTaggerImpl::forward(const torch::Tensor& token_ids,
                                        const torch::Tensor& padding_mask) {
  TORCH_CHECK(token_ids.dim() == 2 && padding_mask.sizes() == token_ids.sizes(),
              "BiLstmTagger: token_ids and padding_mask must both be [bs, l], got ",
              token_ids.sizes(), " and ", padding_mask.sizes());
  const std::int64_t length = token_ids.size(1);
  // Right padding: the real tokens of a row are exactly its first real_tokens[i] positions.
  const torch::Tensor real_tokens = padding_mask.logical_not().sum(1);  // [bs] int64
  TORCH_CHECK(padding_mask.equal(torch::arange(length, real_tokens.options())
                                     .unsqueeze(0)
                                     .ge(real_tokens.unsqueeze(1))),
              "BiLstmTagger: padding must be at the end of each row (right padding)");
  // On the CPU as pack_padded_sequence wants them; at least 1 so a row of padding only packs as
  // a one-token sentence (its logits are ignored like all padding).
  const torch::Tensor lengths = real_tokens.clamp_min(1).to(torch::kCPU);  // [bs] int64
  auto x = dropout_(token_embedding_(token_ids));  // [bs, l, embedding_dim]
  const auto packed = torch::nn::utils::rnn::pack_padded_sequence(
      x, lengths, /*batch_first=*/true, /*enforce_sorted=*/false);  // data [sum(lengths), e]
  const auto packed_output = std::get<0>(lstm_->forward_with_packed_input(packed));
  auto output = std::get<0>(torch::nn::utils::rnn::pad_packed_sequence(
      packed_output, /*batch_first=*/true, /*padding_value=*/0.0,
      /*total_length=*/length));  // [bs, l, 2 * hidden_size], zeros at padding
  return classifier_(dropout_(output));  // [bs, l, num_tags]
}

}  // namespace xpm
