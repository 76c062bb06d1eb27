#include "xpm/tasks/tagging_batch.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace xpm {

TaggingBatch collate(const std::vector<EncodedSentence>& sentences,
                     const std::vector<std::size_t>& indices) {
  if (indices.empty()) throw std::invalid_argument("collate: empty microbatch");
  std::size_t length = 0;
  for (std::size_t index : indices) {
    if (index >= sentences.size()) {
      throw std::invalid_argument("collate: record index " + std::to_string(index) +
                                  " out of range (" + std::to_string(sentences.size()) +
                                  " records)");
    }
    length = std::max(length, sentences[index].token_ids.size());
  }
  const auto bs = static_cast<std::int64_t>(indices.size());
  const auto l = static_cast<std::int64_t>(length);
  TaggingBatch batch;
  batch.token_ids = torch::full({bs, l}, Vocabulary::kPadId, torch::kInt64);
  batch.tag_ids = torch::full({bs, l}, -1, torch::kInt64);
  batch.padding_mask = torch::ones({bs, l}, torch::kBool);
  auto tokens = batch.token_ids.accessor<std::int64_t, 2>();
  auto tags = batch.tag_ids.accessor<std::int64_t, 2>();
  auto pad = batch.padding_mask.accessor<bool, 2>();
  for (std::int64_t row = 0; row < bs; ++row) {
    const EncodedSentence& sentence = sentences[indices[static_cast<std::size_t>(row)]];
    for (std::size_t col = 0; col < sentence.token_ids.size(); ++col) {
      const auto c = static_cast<std::int64_t>(col);
      tokens[row][c] = sentence.token_ids[col];
      tags[row][c] = sentence.tag_ids[col];
      pad[row][c] = false;
    }
    batch.real_tokens += static_cast<std::int64_t>(sentence.token_ids.size());
  }
  return batch;
}

TaggingBatch synthetic_batch(std::int64_t bs, std::int64_t l, std::int64_t vocab_size,
                             std::int64_t num_tags) {
  TaggingBatch batch;
  batch.token_ids = torch::randint(2, std::max<std::int64_t>(3, vocab_size), {bs, l}, torch::kInt64);
  batch.tag_ids = torch::randint(0, num_tags, {bs, l}, torch::kInt64);
  batch.padding_mask = torch::zeros({bs, l}, torch::kBool);
  batch.real_tokens = bs * l;
  return batch;
}

torch::Tensor token_cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& tag_ids) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), tag_ids.to(logits.device()).reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1).reduction(torch::kSum));
}

}  // namespace xpm
