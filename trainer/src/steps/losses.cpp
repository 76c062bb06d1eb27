// Ranking losses (losses.hpp). Formulas, output types and errors are in the header.
#include "xpm/trainer/steps/losses.hpp"

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include "xpm/planner/enum_names.hpp"

namespace xpm {

namespace {

std::string shape_of(const torch::Tensor& tensor) {
  std::ostringstream out;
  out << '[';
  for (int64_t d = 0; d < tensor.dim(); ++d) out << (d ? ", " : "") << tensor.size(d);
  out << ']';
  return out.str();
}

std::string format_number(double value) {
  std::ostringstream out;
  out.precision(9);
  out << value;
  return out.str();
}

// log(max(x, kProbabilityFloor)) whose gradient is 1 / max(x, floor) everywhere: the floor
// changes the value only, so a probability stuck at 0 still gets a (large) gradient, as with
// torch's BCELoss, instead of the zero gradient of a plain clamp.
torch::Tensor floored_log(const torch::Tensor& x) {
  const torch::Tensor raised = x + (x.clamp_min(kProbabilityFloor) - x).detach();
  return raised.log();
}

// log p and log(1 - p) of each score, p being what the output type says the score means.
struct LogProbabilities {
  torch::Tensor log_p;
  torch::Tensor log_one_minus_p;
};

LogProbabilities log_probabilities(const torch::Tensor& scores, ScorerOutputType type) {
  switch (type) {
    case ScorerOutputType::real:  // p = sigmoid(s), 1 - p = sigmoid(-s)
      return {torch::log_sigmoid(scores), torch::log_sigmoid(-scores)};
    case ScorerOutputType::probability:
      return {floored_log(scores), floored_log(1 - scores)};
    case ScorerOutputType::log_probability:  // 1 - p = -expm1(l), accurate near l = 0
      return {scores, floored_log(-torch::expm1(scores))};
  }
  throw std::logic_error("unknown ScorerOutputType");
}

// Throws std::invalid_argument when a score is outside the output type's domain, naming the
// first such entry. One host sync when every value is fine.
void check_scores(const torch::Tensor& scores, ScorerOutputType type, const std::string& who) {
  if (scores.numel() == 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor values = scores.detach();
  torch::Tensor bad;
  std::string domain;
  switch (type) {
    case ScorerOutputType::real:
      bad = values.isfinite().logical_not();
      domain = "a finite real score";
      break;
    case ScorerOutputType::probability:
      bad = values.isnan() | (values < 0) | (values > 1);
      domain = "a probability in [0, 1]";
      break;
    case ScorerOutputType::log_probability:
      bad = values.isnan() | (values > 0);
      domain = "a log-probability in [-inf, 0]";
      break;
  }
  if (!bad.any().item<bool>()) return;
  const int64_t flat = bad.flatten().nonzero()[0][0].item<int64_t>();
  const int64_t columns = values.size(1);
  throw std::invalid_argument(who + ": scores[" + std::to_string(flat / columns) + ", " +
                              std::to_string(flat % columns) + "] = " +
                              format_number(values.flatten()[flat].item<double>()) + " is not " +
                              domain + " (output type " + to_string(type) + ")");
}

void check_floating(const torch::Tensor& scores, const std::string& who) {
  if (!scores.defined()) throw std::invalid_argument(who + ": scores is an undefined tensor");
  if (!torch::isFloatingType(scores.scalar_type())) {
    throw std::invalid_argument(who + ": scores must have a floating dtype, got " +
                                std::string(c10::toString(scores.scalar_type())));
  }
}

torch::Tensor mean_of(const torch::Tensor& per_record, const std::string& who) {
  if (per_record.numel() == 0) {
    throw std::invalid_argument(who + ": the mean over an empty batch (0 records) is undefined");
  }
  return per_record.mean();
}

}  // namespace

namespace {
constexpr EnumNames<ScorerOutputType, 3> kScorerOutputNames{{{ScorerOutputType::real, "real"},
                                                             {ScorerOutputType::probability, "probability"},
                                                             {ScorerOutputType::log_probability, "log-probability"}}};
}  // namespace

std::string to_string(ScorerOutputType type) { return enum_name(kScorerOutputNames, type); }

ScorerOutputType parse_scorer_output_type(const std::string& text, const std::string& source) {
  return parse_enum(kScorerOutputNames, text, source);
}

namespace pairwise {

namespace {

std::string who(const PairwiseLoss& loss) { return "pairwise " + loss.name() + " loss"; }

}  // namespace

torch::Tensor PairwiseLoss::per_record(const torch::Tensor& scores) const {
  check_floating(scores, who(*this));
  if (scores.dim() != 2 || scores.size(1) != 2) {
    throw std::invalid_argument(who(*this) +
                                ": scores must have shape [batch, 2] (column 0: positive, "
                                "column 1: negative), got " + shape_of(scores));
  }
  check_scores(scores, output_type_, who(*this));
  return pair_losses(scores.select(1, 0), scores.select(1, 1));
}

torch::Tensor PairwiseLoss::sum(const torch::Tensor& scores) const {
  return per_record(scores).sum();
}

torch::Tensor PairwiseLoss::mean(const torch::Tensor& scores) const {
  return mean_of(per_record(scores), who(*this));
}

CrossEntropyLoss::CrossEntropyLoss(ScorerOutputType output_type) : PairwiseLoss(output_type) {
  if (output_type == ScorerOutputType::probability) {
    throw std::invalid_argument(
        "pairwise cross-entropy loss: output type probability is not supported (its logit is "
        "s+ - s-, which needs real scores or log-probabilities; output log-probabilities "
        "instead)");
  }
}

torch::Tensor CrossEntropyLoss::pair_losses(const torch::Tensor& positive,
                                            const torch::Tensor& negative) const {
  return -torch::log_sigmoid(positive - negative);
}

HingeLoss::HingeLoss(ScorerOutputType output_type, HingeLossOptions options)
    : PairwiseLoss(output_type), margin_(options.margin) {
  if (!std::isfinite(margin_) || margin_ < 0) {
    throw std::invalid_argument("pairwise hinge loss: margin must be finite and >= 0, got " +
                                format_number(margin_));
  }
  if (output_type == ScorerOutputType::probability && margin_ > 1) {
    throw std::invalid_argument("pairwise hinge loss: margin " + format_number(margin_) +
                                " > 1 with probabilities, whose difference s+ - s- is at most "
                                "1, so no pair could ever meet it");
  }
}

torch::Tensor HingeLoss::pair_losses(const torch::Tensor& positive,
                                     const torch::Tensor& negative) const {
  return torch::relu(margin_ - positive + negative);
}

PointwiseCrossEntropyLoss::PointwiseCrossEntropyLoss(ScorerOutputType output_type)
    : PairwiseLoss(output_type) {}

torch::Tensor PointwiseCrossEntropyLoss::pair_losses(const torch::Tensor& positive,
                                                     const torch::Tensor& negative) const {
  const torch::Tensor log_p_positive = log_probabilities(positive, output_type()).log_p;
  const torch::Tensor log_one_minus_p_negative =
      log_probabilities(negative, output_type()).log_one_minus_p;
  return -(log_p_positive + log_one_minus_p_negative) / 2;
}

std::unique_ptr<PairwiseLoss> make_pairwise_loss(const std::string& name,
                                                 ScorerOutputType output_type,
                                                 HingeLossOptions hinge_options) {
  if (name == "cross-entropy") return std::make_unique<CrossEntropyLoss>(output_type);
  if (name == "hinge") return std::make_unique<HingeLoss>(output_type, hinge_options);
  if (name == "pointwise-cross-entropy") {
    return std::make_unique<PointwiseCrossEntropyLoss>(output_type);
  }
  throw std::invalid_argument("unknown pairwise loss '" + name +
                              "' (expected cross-entropy, hinge or pointwise-cross-entropy)");
}

double pairwise_accuracy(const torch::Tensor& scores) {
  if (!scores.defined() || scores.dim() != 2 || scores.size(1) != 2 || scores.size(0) == 0) {
    throw std::invalid_argument(
        "pairwise_accuracy: scores must have shape [batch, 2] with batch >= 1, got " +
        (scores.defined() ? shape_of(scores) : std::string("an undefined tensor")));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor positive = scores.select(1, 0).to(torch::kDouble);
  const torch::Tensor negative = scores.select(1, 1).to(torch::kDouble);
  const torch::Tensor credit = (positive > negative).to(torch::kDouble) +
                               0.5 * (positive == negative).to(torch::kDouble);
  return credit.mean().item<double>();
}

}  // namespace pairwise

namespace batchwise {

namespace {

std::string who(const BatchwiseLoss& loss) { return "batchwise " + loss.name() + " loss"; }

// Throws naming the first entry of `bad` ([queries, documents] bool).
void throw_if_any(const torch::Tensor& bad, const torch::Tensor& relevances,
                  const std::string& message_prefix, const std::string& requirement) {
  if (!bad.any().item<bool>()) return;
  const int64_t flat = bad.flatten().nonzero()[0][0].item<int64_t>();
  const int64_t columns = relevances.size(1);
  throw std::invalid_argument(message_prefix + ": relevances[" + std::to_string(flat / columns) +
                              ", " + std::to_string(flat % columns) + "] = " +
                              format_number(relevances.flatten()[flat].item<double>()) +
                              " is not " + requirement);
}

}  // namespace

torch::Tensor BatchwiseLoss::per_record(const torch::Tensor& scores,
                                        const torch::Tensor& relevances) const {
  check_floating(scores, who(*this));
  if (scores.dim() != 2 || scores.size(1) < 1) {
    throw std::invalid_argument(who(*this) +
                                ": scores must have shape [queries, documents] with documents "
                                ">= 1, got " + shape_of(scores));
  }
  if (!relevances.defined() || relevances.sizes() != scores.sizes()) {
    throw std::invalid_argument(
        who(*this) + ": relevances must have the scores' shape " + shape_of(scores) + ", got " +
        (relevances.defined() ? shape_of(relevances) : std::string("an undefined tensor")));
  }
  if (relevances.device() != scores.device()) {
    throw std::invalid_argument(who(*this) + ": relevances are on " +
                                relevances.device().str() + " but scores on " +
                                scores.device().str());
  }
  check_scores(scores, output_type_, who(*this));
  const torch::Tensor targets = relevances.detach().to(scores.scalar_type());
  if (targets.numel() > 0) {
    torch::NoGradGuard no_grad;
    check_relevances(targets);
  }
  return query_losses(scores, targets);
}

torch::Tensor BatchwiseLoss::sum(const torch::Tensor& scores,
                                 const torch::Tensor& relevances) const {
  return per_record(scores, relevances).sum();
}

torch::Tensor BatchwiseLoss::mean(const torch::Tensor& scores,
                                  const torch::Tensor& relevances) const {
  return mean_of(per_record(scores, relevances), who(*this));
}

CrossEntropyLoss::CrossEntropyLoss(ScorerOutputType output_type) : BatchwiseLoss(output_type) {}

void CrossEntropyLoss::check_relevances(const torch::Tensor& relevances) const {
  throw_if_any(relevances.isnan() | (relevances < 0) | (relevances > 1), relevances, who(*this),
               "a relevance in [0, 1]");
}

torch::Tensor CrossEntropyLoss::query_losses(const torch::Tensor& scores,
                                             const torch::Tensor& relevances) const {
  const LogProbabilities logs = log_probabilities(scores, output_type());
  // A zero weight contributes exactly 0, even where its log is -inf (0 * -inf would be NaN).
  const torch::Tensor zero = torch::zeros({}, scores.options());
  const torch::Tensor relevant_term =
      torch::where(relevances > 0, relevances * logs.log_p, zero);
  const torch::Tensor non_relevant_term =
      torch::where(relevances < 1, (1 - relevances) * logs.log_one_minus_p, zero);
  return -(relevant_term + non_relevant_term).mean(1);
}

SoftmaxCrossEntropy::SoftmaxCrossEntropy(ScorerOutputType output_type)
    : BatchwiseLoss(output_type) {}

void SoftmaxCrossEntropy::check_relevances(const torch::Tensor& relevances) const {
  throw_if_any((relevances != 0) & (relevances != 1), relevances, who(*this),
               "0 or 1 (softmax cross-entropy needs binary relevances)");
  const torch::Tensor without_relevant = (relevances.sum(1) == 0);
  if (without_relevant.any().item<bool>()) {
    const int64_t query = without_relevant.nonzero()[0][0].item<int64_t>();
    throw std::invalid_argument(who(*this) + ": query " + std::to_string(query) +
                                " has no relevant document (relevances all 0); its loss "
                                "-log(0) would be infinite");
  }
}

torch::Tensor SoftmaxCrossEntropy::query_losses(const torch::Tensor& scores,
                                                const torch::Tensor& relevances) const {
  torch::Tensor logits;
  switch (output_type()) {
    case ScorerOutputType::real:
    case ScorerOutputType::log_probability:
      logits = scores;
      break;
    case ScorerOutputType::probability:
      logits = floored_log(scores);
      break;
  }
  const torch::Tensor log_distribution = torch::log_softmax(logits, 1);
  const torch::Tensor minus_infinity =
      torch::full({}, -std::numeric_limits<double>::infinity(), scores.options());
  const torch::Tensor relevant_only =
      torch::where(relevances > 0, log_distribution, minus_infinity);
  return -torch::logsumexp(relevant_only, {1});
}

}  // namespace batchwise

}  // namespace xpm
