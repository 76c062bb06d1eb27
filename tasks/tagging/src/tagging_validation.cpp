#include "xpm/tasks/tagging_validation.hpp"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "xpm/tasks/tagging_batch.hpp"

namespace xpm {

TrainerValidationLoss::TrainerValidationLoss(const std::vector<EncodedSentence>& sentences,
                                             DistributedContext& dist)
    : sentences_(sentences), dist_(dist) {}

ValidationMetrics TrainerValidationLoss::run(TaggingModelSetup& setup,
                                             const ValidationPlanFn& plan_of) const {
  torch::NoGradGuard no_grad;
  setup.module().eval();
  std::vector<std::size_t> mine;  // this rank's sentences
  for (std::size_t i = static_cast<std::size_t>(dist_.rank()); i < sentences_.size();
       i += static_cast<std::size_t>(dist_.world_size())) {
    mine.push_back(i);
  }
  std::vector<std::vector<double>> dims(mine.size(), std::vector<double>(2, 1.0));  // {bs, l}
  for (std::size_t i = 0; i < mine.size(); ++i) {
    dims[i][1] = static_cast<double>(sentences_[mine[i]].token_ids.size());
  }
  double correct = 0, tokens = 0, scored_tokens = 0, loss_sum = 0, ooms = 0;
  const MicrobatchPlan plan = mine.empty() ? MicrobatchPlan{} : plan_of(dims);
  for (const Microbatch& microbatch : plan.microbatches) {
    std::vector<std::size_t> ids;
    for (std::size_t j : microbatch.record_indices) ids.push_back(mine[j]);
    const TaggingBatch batch = collate(sentences_, ids);
    try {
      const torch::Tensor logits = setup.forward(batch.token_ids, batch.padding_mask);
      const torch::Tensor real = batch.padding_mask.logical_not();
      correct += static_cast<double>(
          logits.argmax(-1).eq(batch.tag_ids).logical_and(real).sum().item<std::int64_t>());
      loss_sum += token_cross_entropy_sum(logits, batch.tag_ids).item<double>();
      scored_tokens += static_cast<double>(batch.tag_ids.ge(0).sum().item<std::int64_t>());
    } catch (const c10::OutOfMemoryError&) {
      ooms += 1;  // its tokens count as errors: the accuracy never looks better for an OOM
    }
    tokens += static_cast<double>(batch.real_tokens);
  }
  setup.module().train();
  const std::vector<double> totals =
      dist_.all_reduce({correct, tokens, scored_tokens, loss_sum, ooms}, ReduceOp::kSum);
  ValidationMetrics metrics;
  metrics.correct = static_cast<std::int64_t>(totals[0]);
  metrics.tokens = static_cast<std::int64_t>(totals[1]);
  metrics.scored_tokens = static_cast<std::int64_t>(totals[2]);
  metrics.ooms = static_cast<std::int64_t>(totals[4]);
  metrics.token_accuracy = metrics.tokens == 0 ? 0.0 : totals[0] / totals[1];
  metrics.loss = metrics.scored_tokens == 0 ? 0.0 : totals[3] / totals[2];
  return metrics;
}

}  // namespace xpm
