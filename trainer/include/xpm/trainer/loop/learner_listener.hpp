// xpm/trainer/loop/learner_listener.hpp — listeners that vote on stopping after each validation.
// Early stopping (validation.hpp) is one.
//
// The rule for combining votes (combine_votes): any kContinue wins (a listener may insist on
// training on, e.g. a minimum number of steps); otherwise any kStop stops; otherwise (all
// kNoDecision, or no listener) training continues: kContinue > kStop > kNoDecision.
#pragma once

#include <string>
#include <vector>

#include "xpm/trainer/loop/train_context.hpp"

namespace xpm {

enum class LearnerVote { kNoDecision, kStop, kContinue };

class LearnerListener {
 public:
  virtual ~LearnerListener() = default;
  virtual std::string name() const = 0;
  /// Called on every rank after each validation with the validation metrics in
  /// context.metrics(); must return the same vote on every rank.
  virtual LearnerVote on_validation(const TrainerContext& context) = 0;
};

/// kContinue if any vote is kContinue, else kStop if any is kStop, else kNoDecision.
inline LearnerVote combine_votes(const std::vector<LearnerVote>& votes) {
  bool stop = false;
  for (LearnerVote v : votes) {
    if (v == LearnerVote::kContinue) return LearnerVote::kContinue;
    stop = stop || v == LearnerVote::kStop;
  }
  return stop ? LearnerVote::kStop : LearnerVote::kNoDecision;
}

/// True when the combined vote says stop.
inline bool should_stop(const std::vector<LearnerVote>& votes) {
  return combine_votes(votes) == LearnerVote::kStop;
}

}  // namespace xpm
