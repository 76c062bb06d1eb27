// xpm/trainer/steps/losses.hpp — ranking losses: batchwise CrossEntropyLoss and
// SoftmaxCrossEntropy, pairwise CrossEntropyLoss, HingeLoss and PointwiseCrossEntropyLoss, each
// aware of what the model outputs (real scores, probabilities or log-probabilities).
//
//   // A ranker returns one real score per (query, document); a batch of 64 pairs:
//   torch::Tensor scores = ranker(...);                          // [64, 2]: positive, negative
//   xpm::pairwise::CrossEntropyLoss loss(xpm::ScorerOutputType::real);
//   torch::Tensor loss_sum = loss.sum(scores);                   // what LossTrainer wants
//   torch::Tensor loss_mean = loss.mean(scores);                 // sum / pairs
//   torch::Tensor per_pair = loss.per_record(scores);            // [64]
//
// Records and reductions. Every loss first computes one value per record (a pair for the
// pairwise losses, a query — one row — for the batchwise ones), then reduces:
//   per_record(...)  [records]
//   sum(...)         scalar, sum over records; 0 for an empty batch. LossTrainer divides the sum
//                    of each microbatch by the outer (or global) batch's record count, so the
//                    gradient is exact under microbatching (loss_trainer.hpp).
//   mean(...)        scalar, sum / records. An empty batch is an error (the mean of nothing is
//                    undefined).
//
// Output types (ScorerOutputType: real, probability, log_probability). Let s be a real score (a
// logit), p a probability in [0, 1], l = log p <= 0.
// Losses never take log(sigmoid(s)) or log(softmax(s)) in two steps: they use log_sigmoid and
// log_softmax. Probabilities are floored at kProbabilityFloor before a log, with the gradient of
// the unfloored log kept (1 / max(p, floor)), as torch's BCELoss does; log(1 - p) for a
// log-probability is computed as log(-expm1(l)), floored the same way.
//
// Which loss accepts which output type, and why:
//                                real  probability  log-probability
//   pairwise CrossEntropyLoss     yes   no (a)       yes (b)
//   pairwise HingeLoss            yes   yes (c)      yes
//   pairwise PointwiseCE          yes   yes          yes
//   batchwise CrossEntropyLoss    yes   yes          yes (d)
//   batchwise SoftmaxCE           yes   yes (e)      yes (e)
// (a) Its logit is s+ - s-, which needs scores that are logits; probabilities are refused.
//     Output log-probabilities instead: (b) then s+ - s- = log(p+/p-), and the loss is
//     -log(p+ / (p+ + p-)).
// (c) The margin is in the scores' units: with probabilities s+ - s- <= 1, so a margin > 1
//     could never be met and is refused.
// (d) Each type gets its own p: sigmoid(s) for real scores (via log_sigmoid), p as given, exp(l);
//     real scores are outside the [0, 1] domain of a plain binary_cross_entropy.
// (e) The row is renormalized (log_softmax of log p, or of l): the loss is unchanged for a row
//     that sums to 1, and a proper softmax cross-entropy for one that does not.
//
// Errors: std::invalid_argument, with the loss's name and the offending shape or value, for a
// scores tensor of the wrong shape or a non-floating dtype, relevances of another shape or
// device, an unsupported output type, a bad margin, and values outside the output type's
// domain: a real score that is not finite, a probability outside [0, 1] or NaN, a
// log-probability > 0 or NaN (-inf, p = 0, is allowed). Checking values costs one host sync per
// call (one `.item()`). Nothing here is collective: each rank calls the losses on its own
// microbatches.
#pragma once

#include <memory>
#include <string>

#include <torch/torch.h>

namespace xpm {

/// What a scorer's output means.
enum class ScorerOutputType {
  real,             // any real number; a logit where a probability is needed (sigmoid/softmax)
  probability,      // p in [0, 1]
  log_probability,  // log p in [-inf, 0]
};

/// "real", "probability", "log-probability".
std::string to_string(ScorerOutputType type);

/// Parses the names to_string() writes. Throws std::invalid_argument naming the text and the
/// accepted names.
ScorerOutputType parse_scorer_output_type(const std::string& text, const std::string& source);

/// Probabilities (and 1 - p) below this are raised to it before a log: -log(1e-12) = 27.63 is
/// the largest per-term loss a probability can give (torch's BCELoss clamps the log at -100).
inline constexpr double kProbabilityFloor = 1e-12;

namespace pairwise {

/// Base of the pairwise losses: scores [batch, 2], column 0 the positive's score s+ and
/// column 1 the negative's s-, one row per pair (record). Floating dtype, any device.
class PairwiseLoss {
 public:
  virtual ~PairwiseLoss() = default;

  /// The loss name, e.g. "cross-entropy" (the name make_pairwise_loss takes).
  virtual std::string name() const = 0;
  ScorerOutputType output_type() const { return output_type_; }

  /// One loss value per pair: [batch], differentiable. Throws std::invalid_argument for a
  /// shape other than [batch, 2], a non-floating dtype, or values outside the output type's
  /// domain.
  torch::Tensor per_record(const torch::Tensor& scores) const;
  /// Sum over pairs: a scalar (0 for an empty batch).
  torch::Tensor sum(const torch::Tensor& scores) const;
  /// Mean over pairs: a scalar, sum / pairs. Also throws for an empty batch.
  torch::Tensor mean(const torch::Tensor& scores) const;

 protected:
  explicit PairwiseLoss(ScorerOutputType output_type) : output_type_(output_type) {}
  /// positive, negative: [batch] each, already checked. Returns [batch].
  virtual torch::Tensor pair_losses(const torch::Tensor& positive,
                                    const torch::Tensor& negative) const = 0;

 private:
  ScorerOutputType output_type_;
};

/// RankNet's cross-entropy (Burges et al., 2005): the pair is a two-way classification whose
/// logit is s+ - s-:
///   loss(pair) = -log( exp(s+) / (exp(s+) + exp(s-)) ) = -log_sigmoid(s+ - s-)
/// e.g. s+ = 2, s- = 0: -log(sigmoid(2)) = log(1 + e^-2) = 0.126928.
/// Output types: real, log_probability (then the loss is -log(p+ / (p+ + p-))); probability is
/// refused (std::invalid_argument at construction).
class CrossEntropyLoss : public PairwiseLoss {
 public:
  explicit CrossEntropyLoss(ScorerOutputType output_type);
  std::string name() const override { return "cross-entropy"; }

 protected:
  torch::Tensor pair_losses(const torch::Tensor& positive,
                            const torch::Tensor& negative) const override;
};

struct HingeLossOptions {
  double margin = 1.0;  // m, in the scores' units; finite, >= 0, and <= 1 for probabilities
};

/// Hinge (max-margin) loss:
///   loss(pair) = max(0, m - (s+ - s-))
/// e.g. m = 1, s+ = 0.3, s- = 0.1: max(0, 1 - 0.2) = 0.8. Zero gradient once s+ - s- >= m.
/// Output types: all three, on the scores as given (no transformation). Throws
/// std::invalid_argument at construction for a margin that is negative or not finite, or > 1
/// with probabilities (s+ - s- <= 1 could never reach it).
class HingeLoss : public PairwiseLoss {
 public:
  explicit HingeLoss(ScorerOutputType output_type, HingeLossOptions options = {});
  std::string name() const override { return "hinge"; }
  double margin() const { return margin_; }

 protected:
  torch::Tensor pair_losses(const torch::Tensor& positive,
                            const torch::Tensor& negative) const override;

 private:
  double margin_;
};

/// Point-wise binary cross-entropy applied to both documents of the pair, the positive with
/// target 1 and the negative with target 0, averaged over the two:
///   loss(pair) = ( -log p(s+) - log(1 - p(s-)) ) / 2
/// where p(s) = sigmoid(s) for real scores (-log p = -log_sigmoid(s), -log(1 - p) =
/// -log_sigmoid(-s)), p for probabilities, exp(l) for log-probabilities. The mean over pairs
/// equals the mean over the 2 * batch documents (torch's BCE with logits on real scores).
/// e.g. real s+ = 2, s- = -1: (log(1 + e^-2) + log(1 + e^-1)) / 2 = (0.126928 + 0.313262) / 2
/// = 0.220095.
class PointwiseCrossEntropyLoss : public PairwiseLoss {
 public:
  explicit PointwiseCrossEntropyLoss(ScorerOutputType output_type);
  std::string name() const override { return "pointwise-cross-entropy"; }

 protected:
  torch::Tensor pair_losses(const torch::Tensor& positive,
                            const torch::Tensor& negative) const override;
};

/// Builds a pairwise loss from its name(): "cross-entropy", "hinge" (with `margin`),
/// "pointwise-cross-entropy". Throws std::invalid_argument for another name, and whatever the
/// loss's constructor throws.
std::unique_ptr<PairwiseLoss> make_pairwise_loss(const std::string& name,
                                                 ScorerOutputType output_type,
                                                 HingeLossOptions hinge_options = {});

/// Fraction of pairs ranked right: s+ > s- counts 1, a tie 1/2, s+ < s- 0 (so a constant scorer
/// gets 0.5). Scores [batch, 2]; no gradient. Throws std::invalid_argument for another shape or
/// an empty batch.
double pairwise_accuracy(const torch::Tensor& scores);

}  // namespace pairwise

namespace batchwise {

/// Base of the batchwise losses: scores [queries, documents] (one row per query: the record),
/// relevances of the same shape and device (any numeric dtype; converted to the scores' dtype),
/// documents >= 1.
class BatchwiseLoss {
 public:
  virtual ~BatchwiseLoss() = default;

  /// The loss name: "bce", "ce".
  virtual std::string name() const = 0;
  ScorerOutputType output_type() const { return output_type_; }

  /// One loss value per query: [queries]. Throws std::invalid_argument for shapes, dtypes,
  /// devices or values as the class comment says.
  torch::Tensor per_record(const torch::Tensor& scores, const torch::Tensor& relevances) const;
  /// Sum over queries (0 for no query).
  torch::Tensor sum(const torch::Tensor& scores, const torch::Tensor& relevances) const;
  /// Mean over queries: a scalar, sum / queries. Also throws for zero queries.
  torch::Tensor mean(const torch::Tensor& scores, const torch::Tensor& relevances) const;

 protected:
  explicit BatchwiseLoss(ScorerOutputType output_type) : output_type_(output_type) {}
  /// Throws std::invalid_argument when a relevance is outside this loss's domain.
  virtual void check_relevances(const torch::Tensor& relevances) const = 0;
  /// scores, relevances: [queries, documents], checked, same dtype. Returns [queries].
  virtual torch::Tensor query_losses(const torch::Tensor& scores,
                                     const torch::Tensor& relevances) const = 0;

 private:
  ScorerOutputType output_type_;
};

/// Binary cross-entropy of every (query, document) against its relevance r in [0, 1]
/// (soft targets allowed), averaged over the query's documents:
///   loss(query) = (1/D) sum_d -( r_d log p_d + (1 - r_d) log(1 - p_d) )
/// with p_d = sigmoid(s_d) (real; via log_sigmoid), p_d (probability), exp(l_d)
/// (log-probability). A term whose weight r_d or 1 - r_d is 0 contributes 0 even where its log
/// is -inf. The mean over queries equals the mean over all Q * D entries (for probabilities,
/// torch's binary_cross_entropy with its mean reduction).
/// e.g. probabilities [0.8, 0.4], relevances [1, 0]: (-log 0.8 - log 0.6) / 2
/// = (0.223144 + 0.510826) / 2 = 0.366985.
/// Throws std::invalid_argument (in per_record) for a relevance outside [0, 1] or NaN.
class CrossEntropyLoss : public BatchwiseLoss {
 public:
  explicit CrossEntropyLoss(ScorerOutputType output_type);
  std::string name() const override { return "bce"; }

 protected:
  void check_relevances(const torch::Tensor& relevances) const override;
  torch::Tensor query_losses(const torch::Tensor& scores,
                             const torch::Tensor& relevances) const override;
};

/// Softmax cross-entropy over each query's documents: minus the log of the probability mass
/// the softmax puts on the relevant ones (relevance 1; relevance 0 documents only normalize):
///   loss(query) = -log( sum_{d: r_d = 1} softmax(z)_d ) = -logsumexp_{d: r_d = 1} log_softmax(z)_d
/// with z = s (real), log p (probability, floored), l (log-probability). For one relevant
/// document this is the usual cross-entropy -log_softmax(z)_{relevant}.
/// e.g. real [2, 1, 0], relevances [1, 0, 0]: -log(e^2 / (e^2 + e + 1)) = 0.407606.
/// Throws std::invalid_argument (in per_record) for a relevance other than 0 or 1, or a query
/// without a relevant document (its loss would be +inf).
class SoftmaxCrossEntropy : public BatchwiseLoss {
 public:
  explicit SoftmaxCrossEntropy(ScorerOutputType output_type);
  std::string name() const override { return "ce"; }

 protected:
  void check_relevances(const torch::Tensor& relevances) const override;
  torch::Tensor query_losses(const torch::Tensor& scores,
                             const torch::Tensor& relevances) const override;
};

}  // namespace batchwise

}  // namespace xpm
