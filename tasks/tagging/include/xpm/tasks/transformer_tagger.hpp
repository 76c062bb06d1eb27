// xpm/tasks/transformer_tagger.hpp — the bundled model: a small Transformer encoder that tags
// every token of a sentence (part-of-speech tagging on the Brown corpus).
//
//   TransformerTagger model(TransformerTaggerOptions{/*vocab_size=*/20000, /*num_tags=*/200});
//   torch::Tensor logits = model->forward(token_ids, padding_mask);  // [bs, l, num_tags]
//
// Architecture: token embedding + learned position embedding (d_model), num_layers post-norm
// encoder layers (Vaswani et al. 2017, "Attention Is All You Need": multi-head self-attention and
// a ReLU feed-forward block, as torch::nn::TransformerEncoderLayer), a linear tag classifier.
// Attention materializes bs * nhead * l * l scores per layer, so activation memory has an l^2
// term: the bundled cost formula is a*bs*l^2 + b*bs*l + c.
//
// With options.activation_checkpointing, training forwards (grad mode on, module in train())
// keep only each encoder layer's input and recompute the layer in backward
// (activation_checkpoint.hpp): same gradients (dropout masks included), lower peak, one more
// forward of every layer per step. The parameters and their names do not change.
//
// Under autocast (precision.hpp: bf16-mixed, 16-mixed) each encoder layer runs through
// encoder_layer_forward below instead of TransformerEncoderLayerImpl::forward: LibTorch 1.13's
// multi_head_attention_forward applies the key-padding mask through AT_DISPATCH_FLOATING_TYPES,
// which has no bfloat16 or float16 case, so a padded batch throws "attn_output_weights.masked_fill"
// not implemented for 'BFloat16'.
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace xpm {

struct TransformerTaggerOptions {
  std::int64_t vocab_size = 20000;      // embedding rows, including pad (0) and unknown (1)
  std::int64_t num_tags = 1;            // classifier outputs
  std::int64_t d_model = 128;           // model width
  std::int64_t nhead = 4;               // attention heads
  std::int64_t dim_feedforward = 512;   // feed-forward width
  std::int64_t num_layers = 2;          // encoder layers
  double dropout = 0.1;                 // dropout in the encoder layers
  std::int64_t max_length = 256;        // position embeddings; longer inputs are an error
  bool activation_checkpointing = false;  // recompute each encoder layer in backward (training)
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// One post-norm encoder layer (ReLU) with its own parameters, as
/// TransformerEncoderLayerImpl::forward with packed self-attention computes it (the same
/// operations in the same order, dropout included), except that the key-padding mask is applied
/// with masked_fill on any floating dtype and the head-averaged attention weights, which the
/// layer discards, are not computed. src: [l, bs, d_model]; padding_mask: [bs, l] bool (true at
/// padding) or undefined. Returns [l, bs, d_model]. Throws std::invalid_argument for a layer
/// with another activation than ReLU, separate q/k/v weights, or key/value biases.
torch::Tensor encoder_layer_forward(torch::nn::TransformerEncoderLayerImpl& layer, const torch::Tensor& src,
                                    const torch::Tensor& padding_mask);

class TransformerTaggerImpl : public torch::nn::Module {
 public:
  explicit TransformerTaggerImpl(const TransformerTaggerOptions& options);
  /// token_ids: [bs, l] int64; padding_mask: [bs, l] bool, true at padding.
  /// Returns logits [bs, l, num_tags] float32. Throws c10::Error if l > max_length.
  torch::Tensor forward(const torch::Tensor& token_ids, const torch::Tensor& padding_mask);
  const TransformerTaggerOptions& options() const { return options_; }

 private:
  TransformerTaggerOptions options_;
  torch::nn::Embedding token_embedding_{nullptr};
  torch::nn::Embedding position_embedding_{nullptr};
  torch::nn::TransformerEncoder encoder_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};
TORCH_MODULE(TransformerTagger);

}  // namespace xpm
