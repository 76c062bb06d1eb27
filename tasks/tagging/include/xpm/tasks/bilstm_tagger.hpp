// xpm/tasks/bilstm_tagger.hpp — the second bundled model: a bidirectional LSTM that tags every
// token of a sentence (part-of-speech tagging on the Brown corpus), same interface as
// TransformerTagger so the task, the probes and the trainer work with either.
//
//   BiLstmTagger model(BiLstmTaggerOptions{/*vocab_size=*/20000, /*num_tags=*/200});
//   torch::Tensor logits = model->forward(token_ids, padding_mask);  // [bs, l, num_tags]
//
// Architecture: token embedding (embedding_dim), dropout, num_layers bidirectional LSTM layers
// (hidden_size per direction, dropout between layers, as torch::nn::LSTM), dropout, a linear tag
// classifier on the concatenated directions (Graves & Schmidhuber 2005; Huang et al. 2015,
// "Bidirectional LSTM-CRF Models for Sequence Tagging", without the CRF).
//
// Padding: sequences are packed (torch::nn::utils::rnn::pack_padded_sequence) before the LSTM,
// so the backward direction of each sentence starts at its last real token, never at padding:
// a sentence's logits are the same whatever padding its microbatch adds. Padding must be at the
// end of each row (right padding, as collate() makes it).
//
// Memory: the LSTM keeps, per time step, layer and direction, the gates and states of every
// sentence for the backward pass, so activation memory grows as bs * l (no l^2 term, unlike
// attention); the first time step of each layer and direction starts from the zero initial
// state and keeps less, so the bundled cost formula is a*bs*(l-1) + b*bs + c (bytes). Measured
// with the defaults below (LibTorch 1.13 CPU, AdamW, 42 shapes bs 1..64 x l 30..180): the
// forward/backward peak is 24,593 bytes per token after a sentence's first, 18,435 bytes per
// sentence for the first, plus 52.7 MB (the 52.4 MB of weights, gradients and AdamW state and
// shape-independent buffers), to within 0.0005 % (docs/benchmarks.md).
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace xpm {

struct BiLstmTaggerOptions {
  std::int64_t vocab_size = 20000;   // embedding rows, including pad (0) and unknown (1)
  std::int64_t num_tags = 1;         // classifier outputs
  std::int64_t embedding_dim = 128;  // token embedding width
  std::int64_t hidden_size = 128;    // LSTM hidden and cell width per direction
  std::int64_t num_layers = 2;       // stacked bidirectional LSTM layers
  double dropout = 0.1;              // on the embeddings, between LSTM layers, before the classifier
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

class BiLstmTaggerImpl : public torch::nn::Module {
 public:
  explicit BiLstmTaggerImpl(const BiLstmTaggerOptions& options);
  /// token_ids: [bs, l] int64; padding_mask: [bs, l] bool, true at padding, padding only at the
  /// end of a row (a row of padding only is tagged as a one-token sentence). Returns logits
  /// [bs, l, num_tags] float32 (the model's dtype); logits at padding are the classifier applied
  /// to zeros. Throws c10::Error for mismatched shapes or padding before a real token.
  torch::Tensor forward(const torch::Tensor& token_ids, const torch::Tensor& padding_mask);
  const BiLstmTaggerOptions& options() const { return options_; }

 private:
  BiLstmTaggerOptions options_;
  torch::nn::Embedding token_embedding_{nullptr};
  torch::nn::LSTM lstm_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};
TORCH_MODULE(BiLstmTagger);

}  // namespace xpm
