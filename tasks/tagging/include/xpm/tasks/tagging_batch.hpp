// xpm/tasks/tagging_batch.hpp — collation of encoded sentences into padded tensors, synthetic
// batches for probes, and the token-level loss of the tagging task.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "xpm/tasks/brown_corpus.hpp"

namespace xpm {

/// Padded microbatch. Shapes: token_ids, tag_ids, padding_mask [bs, l] with l the longest
/// sentence; tag_ids is -1 at padding and for unseen tags (ignored by the loss).
struct TaggingBatch {
  torch::Tensor token_ids;     // int64
  torch::Tensor tag_ids;       // int64, -1 = ignore
  torch::Tensor padding_mask;  // bool, true at padding
  std::int64_t real_tokens = 0;  // tokens that are not padding
};

/// Collates sentences[indices] (in that order). Throws std::invalid_argument for an empty
/// index list or an out-of-range index.
TaggingBatch collate(const std::vector<EncodedSentence>& sentences,
                     const std::vector<std::size_t>& indices);

/// A batch of bs sentences of exactly l tokens with random token and tag ids (probes).
TaggingBatch synthetic_batch(std::int64_t bs, std::int64_t l, std::int64_t vocab_size,
                             std::int64_t num_tags);

/// Sum over real tokens of the cross-entropy of logits [bs, l, T] against tag_ids [bs, l]
/// (entries -1 ignored). Returns a scalar; divide by the outer batch's real tokens to weight a
/// microbatch by its share (exact gradient accumulation).
torch::Tensor token_cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& tag_ids);

}  // namespace xpm
