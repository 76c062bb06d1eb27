// xpm/tasks/tagging_validation.hpp — the tagging job's validation (TrainerValidationLoss): token
// accuracy and token cross-entropy of the model on the validation sentences, forward only, under
// its own memory plan.
//
//   TrainerValidationLoss validation(data.validation, dist);
//   ValidationMetrics m = validation.run(setup, plan_of);   // eval mode, no gradients
//   m.token_accuracy;  m.loss;                              // loss: mean per scored token
//
// Its own memory plan: `plan_of` cuts the validation sentences into microbatches (the job
// passes a snapshot of the training memory model, or the fixed/power batcher's current size).
// A forward pass without gradients needs less memory than the training step the model
// predicts, so the training prediction is a safe bound. Nothing measured during validation
// flows back: no online correction, no floor raised, the power batcher's size unchanged, so a
// validation never changes the training plan (and a resumed run plans as the uninterrupted one).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "xpm/planner/packer.hpp"
#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/trainer/distributed/distributed.hpp"
#include "xpm/tasks/tagging_task.hpp"
#include "xpm/trainer/loop/training_task.hpp"

namespace xpm {

struct ValidationMetrics {
  double token_accuracy = 0;    // correct / tokens (every real token; OOM microbatches count as wrong)
  double loss = 0;              // token cross-entropy summed over scored tokens / scored tokens (nats)
  std::int64_t tokens = 0;      // real tokens of the validation sentences (all ranks)
  std::int64_t correct = 0;     // tokens whose argmax tag is right
  std::int64_t scored_tokens = 0;  // tokens in the loss: tag known and microbatch not out of memory
  std::int64_t ooms = 0;        // microbatches that ran out of memory (their tokens: wrong, no loss)
};

class TrainerValidationLoss {
 public:
  /// `sentences` (not owned) must outlive this object. Under data parallelism each rank
  /// evaluates every world_size-th sentence and the counts are summed.
  TrainerValidationLoss(const std::vector<EncodedSentence>& sentences, DistributedContext& dist);

  /// Evaluates the model in eval mode without gradients (back to train mode afterwards).
  /// Collective: every rank calls it (one all-reduce of the counts). Throws what the model
  /// throws, except c10::OutOfMemoryError, which is counted in ooms.
  ValidationMetrics run(TaggingModelSetup& setup, const ValidationPlanFn& plan_of) const;

 private:
  const std::vector<EncodedSentence>& sentences_;
  DistributedContext& dist_;
};

}  // namespace xpm
