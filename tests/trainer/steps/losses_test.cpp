// Ranking losses (losses.hpp) against values computed by hand: each expected value is written
// out as arithmetic in a comment (natural logs, e = 2.718281828). Tensors are double so the
// comparisons can be tight (1e-6).
#include "torch_doctest.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/steps/losses.hpp"

namespace {

using xpm::ScorerOutputType;
namespace pairwise = xpm::pairwise;
namespace batchwise = xpm::batchwise;

// A [rows, columns] double tensor from nested lists.
torch::Tensor matrix(const std::vector<std::vector<double>>& rows, bool requires_grad = false) {
  std::vector<double> flat;
  for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
  const auto columns = rows.empty() ? 0 : static_cast<std::int64_t>(rows[0].size());
  return torch::tensor(flat, torch::kDouble)
      .reshape({static_cast<std::int64_t>(rows.size()), columns})
      .set_requires_grad(requires_grad);
}

double value(const torch::Tensor& scalar) { return scalar.item<double>(); }
double entry(const torch::Tensor& tensor, std::int64_t i) { return tensor[i].item<double>(); }
double entry(const torch::Tensor& tensor, std::int64_t i, std::int64_t j) {
  return tensor[i][j].item<double>();
}

doctest::Approx near(double expected) { return doctest::Approx(expected).epsilon(1e-6); }

const double kInf = std::numeric_limits<double>::infinity();

}  // namespace

// ---------------------------------------------------------------- output types

TEST_CASE("scorer output types print and parse as real, probability and log-probability") {
  for (ScorerOutputType type : {ScorerOutputType::real, ScorerOutputType::probability,
                                ScorerOutputType::log_probability}) {
    CHECK(xpm::parse_scorer_output_type(xpm::to_string(type), "output type") == type);
  }
  CHECK(xpm::to_string(ScorerOutputType::log_probability) == "log-probability");
  CHECK_THROWS_WITH_AS(xpm::parse_scorer_output_type("logit", "--output-type"),
                       "--output-type must be 'real', 'probability' or 'log-probability', got 'logit'",
                       std::invalid_argument);
}

// ---------------------------------------------------------------- pairwise cross-entropy

TEST_CASE("pairwise cross-entropy on real scores is -log sigmoid(s+ - s-) per pair") {
  const pairwise::CrossEntropyLoss loss(ScorerOutputType::real);
  const torch::Tensor scores = matrix({{2, 0}, {0, 0}, {-1, 1}});
  const torch::Tensor per_pair = loss.per_record(scores);
  REQUIRE(per_pair.sizes() == torch::IntArrayRef{3});
  CHECK(entry(per_pair, 0) == near(0.126928));  // log(1 + e^-2) = log(1.135335)
  CHECK(entry(per_pair, 1) == near(0.693147));  // log(1 + e^0) = log 2
  CHECK(entry(per_pair, 2) == near(2.126928));  // log(1 + e^2) = log(8.389056)
  CHECK(value(loss.sum(scores)) == near(2.947003));   // 0.126928 + 0.693147 + 2.126928
  CHECK(value(loss.mean(scores)) == near(0.982334));  // 2.947003 / 3
  CHECK(loss.name() == "cross-entropy");
}

TEST_CASE("pairwise cross-entropy on real scores equals torch's cross_entropy(scores, target 0)") {
  const pairwise::CrossEntropyLoss loss(ScorerOutputType::real);
  const torch::Tensor scores = torch::randn({16, 2}, torch::kDouble) * 3;
  const torch::Tensor reference =
      torch::nn::functional::cross_entropy(scores, torch::zeros({16}, torch::kLong));
  CHECK(value(loss.mean(scores)) == near(value(reference)));
}

TEST_CASE("pairwise cross-entropy on log-probabilities is -log(p+ / (p+ + p-))") {
  const pairwise::CrossEntropyLoss loss(ScorerOutputType::log_probability);
  // p+ = 0.6, p- = 0.2: -log(0.6 / 0.8) = -log 0.75 = 0.287682
  CHECK(value(loss.mean(matrix({{std::log(0.6), std::log(0.2)}}))) == near(0.287682));
}

TEST_CASE("pairwise cross-entropy refuses probabilities") {
  CHECK_THROWS_WITH_AS(pairwise::CrossEntropyLoss(ScorerOutputType::probability),
                       doctest::Contains("output type probability is not supported"),
                       std::invalid_argument);
}

TEST_CASE("pairwise cross-entropy's gradient raises the positive and lowers the negative") {
  const pairwise::CrossEntropyLoss loss(ScorerOutputType::real);
  const torch::Tensor scores = matrix({{2, 0}}, true);
  loss.sum(scores).backward();
  // d/ds+ -log sigmoid(s+ - s-) = -(1 - sigmoid(2)) = -sigmoid(-2) = -1 / (1 + e^2) = -0.119203
  CHECK(entry(scores.grad(), 0, 0) == near(-0.119203));
  CHECK(entry(scores.grad(), 0, 1) == near(0.119203));
}

TEST_CASE("pairwise cross-entropy stays finite for scores far apart") {
  const pairwise::CrossEntropyLoss loss(ScorerOutputType::real);
  const torch::Tensor scores =
      torch::tensor({-500.0f, 500.0f, 500.0f, -500.0f}, torch::kFloat).reshape({2, 2});
  const torch::Tensor per_pair = loss.per_record(scores);
  CHECK(entry(per_pair, 0) == doctest::Approx(1000));  // log(1 + e^1000) = 1000 + log(1 + e^-1000)
  CHECK(entry(per_pair, 1) == doctest::Approx(0));     // log(1 + e^-1000) = 0 in float
}

// ---------------------------------------------------------------- hinge

TEST_CASE("hinge loss is max(0, m - (s+ - s-)) per pair") {
  const pairwise::HingeLoss loss(ScorerOutputType::real);  // m = 1
  const torch::Tensor scores = matrix({{0.3, 0.1}, {2, 0}, {0, 0.5}}, true);
  const torch::Tensor per_pair = loss.per_record(scores);
  CHECK(entry(per_pair, 0) == near(0.8));  // 1 - (0.3 - 0.1)
  CHECK(entry(per_pair, 1) == near(0.0));  // 1 - 2 < 0
  CHECK(entry(per_pair, 2) == near(1.5));  // 1 - (0 - 0.5)
  CHECK(value(loss.mean(scores)) == near(0.766667));  // (0.8 + 0 + 1.5) / 3
  loss.sum(scores).backward();
  // Active pairs: d/ds+ = -1, d/ds- = +1; a pair past the margin gets no gradient.
  CHECK(entry(scores.grad(), 0, 0) == near(-1));
  CHECK(entry(scores.grad(), 0, 1) == near(1));
  CHECK(entry(scores.grad(), 1, 0) == near(0));
  CHECK(entry(scores.grad(), 1, 1) == near(0));
  CHECK(loss.name() == "hinge");
}

TEST_CASE("hinge loss takes its margin from the options and the scores as given") {
  const pairwise::HingeLoss half(ScorerOutputType::real, {0.5});
  CHECK(half.margin() == 0.5);
  CHECK(value(half.mean(matrix({{0.3, 0.1}}))) == near(0.3));  // 0.5 - 0.2
  const pairwise::HingeLoss probabilities(ScorerOutputType::probability);
  CHECK(value(probabilities.mean(matrix({{0.9, 0.2}}))) == near(0.3));  // 1 - (0.9 - 0.2)
  const pairwise::HingeLoss log_probabilities(ScorerOutputType::log_probability);
  // 1 - (log 0.5 - log 0.25) = 1 - log 2 = 0.306853
  CHECK(value(log_probabilities.mean(matrix({{std::log(0.5), std::log(0.25)}}))) ==
        near(0.306853));
}

TEST_CASE("hinge loss rejects a negative, non-finite, or unreachable margin") {
  CHECK_THROWS_WITH_AS(pairwise::HingeLoss(ScorerOutputType::real, {-0.5}),
                       "pairwise hinge loss: margin must be finite and >= 0, got -0.5",
                       std::invalid_argument);
  CHECK_THROWS_AS(pairwise::HingeLoss(ScorerOutputType::real, {std::nan("")}),
                  std::invalid_argument);
  CHECK_THROWS_WITH_AS(pairwise::HingeLoss(ScorerOutputType::probability, {1.5}),
                       doctest::Contains("margin 1.5 > 1 with probabilities"),
                       std::invalid_argument);
  CHECK_NOTHROW(pairwise::HingeLoss(ScorerOutputType::probability, {1.0}));
  CHECK_NOTHROW(pairwise::HingeLoss(ScorerOutputType::log_probability, {2.0}));
  CHECK_NOTHROW(pairwise::HingeLoss(ScorerOutputType::real, {0.0}));
}

// ---------------------------------------------------------------- pointwise cross-entropy

TEST_CASE("pointwise cross-entropy on real scores: BCE with logits, positive 1, negative 0") {
  const pairwise::PointwiseCrossEntropyLoss loss(ScorerOutputType::real);
  // (-log sigmoid(2) - log(1 - sigmoid(-1))) / 2 = (log(1 + e^-2) + log(1 + e^-1)) / 2
  // = (0.126928 + 0.313262) / 2 = 0.220095
  CHECK(value(loss.mean(matrix({{2, -1}}))) == near(0.220095));
  CHECK(value(loss.mean(matrix({{0, 0}}))) == near(0.693147));  // (log 2 + log 2) / 2
  // Equal to torch's BCE with logits over the 2N documents (positives first), mean.
  const torch::Tensor scores = torch::randn({8, 2}, torch::kDouble) * 2;
  const torch::Tensor targets = torch::cat({torch::ones({8}), torch::zeros({8})}).to(torch::kDouble);
  const torch::Tensor reference = torch::nn::functional::binary_cross_entropy_with_logits(
      scores.t().flatten(), targets);
  CHECK(value(loss.mean(scores)) == near(value(reference)));
  CHECK(loss.name() == "pointwise-cross-entropy");
}

TEST_CASE("pointwise cross-entropy on probabilities and log-probabilities") {
  // p+ = 0.8, p- = 0.4: (-log 0.8 - log(1 - 0.4)) / 2 = (0.223144 + 0.510826) / 2 = 0.366985
  const pairwise::PointwiseCrossEntropyLoss on_probabilities(ScorerOutputType::probability);
  CHECK(value(on_probabilities.mean(matrix({{0.8, 0.4}}))) == near(0.366985));
  const pairwise::PointwiseCrossEntropyLoss on_log_probabilities(
      ScorerOutputType::log_probability);
  CHECK(value(on_log_probabilities.mean(matrix({{std::log(0.8), std::log(0.4)}}))) ==
        near(0.366985));
}

TEST_CASE("pointwise cross-entropy floors probabilities at 1e-12 and keeps a gradient there") {
  const pairwise::PointwiseCrossEntropyLoss loss(ScorerOutputType::probability);
  const torch::Tensor scores = matrix({{0, 1}}, true);  // both completely wrong
  const torch::Tensor mean = loss.mean(scores);
  // (-log 1e-12 - log 1e-12) / 2 = 27.631021
  CHECK(value(mean) == near(27.631021));
  mean.backward();
  // d/dp+ (-log max(p+, 1e-12)) / 2 = -1 / (2e-12): large, finite, and it raises p+.
  CHECK(std::isfinite(entry(scores.grad(), 0, 0)));
  CHECK(entry(scores.grad(), 0, 0) == doctest::Approx(-5e11));
  CHECK(entry(scores.grad(), 0, 1) == doctest::Approx(5e11));  // lowers p-
}

TEST_CASE("pointwise cross-entropy on a log-probability of 0 for the negative is floored") {
  const pairwise::PointwiseCrossEntropyLoss loss(ScorerOutputType::log_probability);
  const torch::Tensor scores = matrix({{0, 0}}, true);  // p+ = 1 (right), p- = 1 (wrong)
  const torch::Tensor mean = loss.mean(scores);
  CHECK(value(mean) == near(13.815511));  // (0 - log 1e-12) / 2 = 27.631021 / 2
  mean.backward();
  CHECK(std::isfinite(entry(scores.grad(), 0, 1)));
  CHECK(entry(scores.grad(), 0, 1) > 0);  // lowers log p-
}

// ---------------------------------------------------------------- pairwise: shapes, values

TEST_CASE("pairwise losses reject scores that are not [batch, 2]") {
  const pairwise::HingeLoss loss(ScorerOutputType::real);
  CHECK_THROWS_WITH_AS(loss.per_record(torch::zeros({3}, torch::kDouble)),
                       "pairwise hinge loss: scores must have shape [batch, 2] (column 0: "
                       "positive, column 1: negative), got [3]",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.sum(torch::zeros({3, 3})), doctest::Contains("got [3, 3]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.mean(torch::zeros({2, 2, 1})), doctest::Contains("got [2, 2, 1]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.sum(torch::zeros({3, 2}, torch::kLong)),
                       "pairwise hinge loss: scores must have a floating dtype, got Long",
                       std::invalid_argument);
}

TEST_CASE("pairwise losses reject values outside the output type's domain, naming the entry") {
  const pairwise::PointwiseCrossEntropyLoss on_probabilities(ScorerOutputType::probability);
  CHECK_THROWS_WITH_AS(on_probabilities.sum(matrix({{0.5, 0.5}, {0.2, 1.5}})),
                       "pairwise pointwise-cross-entropy loss: scores[1, 1] = 1.5 is not a "
                       "probability in [0, 1] (output type probability)",
                       std::invalid_argument);
  const pairwise::CrossEntropyLoss on_real(ScorerOutputType::real);
  CHECK_THROWS_WITH_AS(on_real.sum(matrix({{std::nan(""), 0}})),
                       doctest::Contains("scores[0, 0] = nan is not a finite real score"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(on_real.sum(matrix({{0, kInf}})),
                       doctest::Contains("scores[0, 1] = inf"), std::invalid_argument);
  const pairwise::CrossEntropyLoss on_log_probabilities(ScorerOutputType::log_probability);
  CHECK_THROWS_WITH_AS(on_log_probabilities.sum(matrix({{0.1, -1}})),
                       doctest::Contains("scores[0, 0] = 0.1 is not a log-probability"),
                       std::invalid_argument);
  // log p = -inf (p = 0) is a log-probability.
  CHECK_NOTHROW(on_log_probabilities.sum(matrix({{-1, -kInf}})));
}

TEST_CASE("pairwise losses sum an empty batch to 0 and refuse its mean") {
  const pairwise::CrossEntropyLoss loss(ScorerOutputType::real);
  const torch::Tensor empty = torch::zeros({0, 2}, torch::kDouble);
  CHECK(value(loss.sum(empty)) == 0);
  CHECK_THROWS_WITH_AS(loss.mean(empty), doctest::Contains("empty batch"), std::invalid_argument);
}

TEST_CASE("the sum is the mean times the number of pairs, for every loss and output type") {
  const torch::Tensor logits = torch::randn({5, 2}, torch::kDouble);
  for (ScorerOutputType type : {ScorerOutputType::real, ScorerOutputType::probability,
                                ScorerOutputType::log_probability}) {
    const torch::Tensor scores = type == ScorerOutputType::real          ? logits
                                 : type == ScorerOutputType::probability ? torch::sigmoid(logits)
                                                                         : torch::log_sigmoid(logits);
    for (const char* name : {"cross-entropy", "hinge", "pointwise-cross-entropy"}) {
      if (type == ScorerOutputType::probability && std::string(name) == "cross-entropy") continue;
      const auto loss = pairwise::make_pairwise_loss(name, type);
      CAPTURE(name);
      CHECK(value(loss->sum(scores)) == near(5 * value(loss->mean(scores))));
    }
  }
}

TEST_CASE("make_pairwise_loss builds a loss by its name and rejects other names") {
  CHECK(pairwise::make_pairwise_loss("hinge", ScorerOutputType::real, {0.25})->name() == "hinge");
  CHECK(dynamic_cast<pairwise::HingeLoss&>(
            *pairwise::make_pairwise_loss("hinge", ScorerOutputType::real, {0.25}))
            .margin() == 0.25);
  CHECK_THROWS_WITH_AS(pairwise::make_pairwise_loss("ranknet", ScorerOutputType::real),
                       "unknown pairwise loss 'ranknet' (expected cross-entropy, hinge or "
                       "pointwise-cross-entropy)",
                       std::invalid_argument);
  CHECK_THROWS_AS(pairwise::make_pairwise_loss("cross-entropy", ScorerOutputType::probability),
                  std::invalid_argument);
}

TEST_CASE("pairwise accuracy counts a right pair 1, a tie 1/2, a wrong pair 0") {
  CHECK(pairwise::pairwise_accuracy(matrix({{1, 0}, {0, 1}, {0.5, 0.5}})) == near(0.5));
  CHECK(pairwise::pairwise_accuracy(matrix({{1, 0}, {2, 1}})) == near(1.0));
  CHECK_THROWS_AS(pairwise::pairwise_accuracy(torch::zeros({0, 2})), std::invalid_argument);
  CHECK_THROWS_AS(pairwise::pairwise_accuracy(torch::zeros({3})), std::invalid_argument);
}

// ---------------------------------------------------------------- batchwise cross-entropy

TEST_CASE("batchwise cross-entropy on probabilities is the mean BCE over each query's documents") {
  const batchwise::CrossEntropyLoss loss(ScorerOutputType::probability);
  const torch::Tensor scores = matrix({{0.8, 0.4}, {0.5, 0.5}});
  const torch::Tensor relevances = matrix({{1, 0}, {1, 1}});
  const torch::Tensor per_query = loss.per_record(scores, relevances);
  CHECK(entry(per_query, 0) == near(0.366985));  // (-log 0.8 - log(1 - 0.4)) / 2
  CHECK(entry(per_query, 1) == near(0.693147));  // (-log 0.5 - log 0.5) / 2 = log 2
  CHECK(value(loss.sum(scores, relevances)) == near(1.060132));   // 0.366985 + 0.693147
  CHECK(value(loss.mean(scores, relevances)) == near(0.530066));  // 1.060132 / 2
  // Equal to torch's binary_cross_entropy(scores, relevances): the mean over all Q * D entries.
  CHECK(value(loss.mean(scores, relevances)) ==
        near(value(torch::nn::functional::binary_cross_entropy(scores, relevances))));
  CHECK(loss.name() == "bce");
}

TEST_CASE("batchwise cross-entropy on real scores and log-probabilities") {
  const batchwise::CrossEntropyLoss on_real(ScorerOutputType::real);
  // (log(1 + e^-2) + log(1 + e^-1)) / 2 = (0.126928 + 0.313262) / 2
  CHECK(value(on_real.mean(matrix({{2, -1}}), matrix({{1, 0}}))) == near(0.220095));
  // Soft target 0.5 on s = 0: -(0.5 log 0.5 + 0.5 log 0.5) = log 2
  CHECK(value(on_real.mean(matrix({{0}}), matrix({{0.5}}))) == near(0.693147));
  const batchwise::CrossEntropyLoss on_log(ScorerOutputType::log_probability);
  CHECK(value(on_log.mean(matrix({{std::log(0.8), std::log(0.4)}}), matrix({{1, 0}}))) ==
        near(0.366985));
}

TEST_CASE("batchwise cross-entropy: a zero-weight term with log p = -inf adds 0, not NaN") {
  const batchwise::CrossEntropyLoss loss(ScorerOutputType::log_probability);
  const torch::Tensor scores = matrix({{std::log(0.8), -kInf}}, true);  // p- = 0 exactly
  const torch::Tensor mean = loss.mean(scores, matrix({{1, 0}}));
  CHECK(value(mean) == near(0.111572));  // (-log 0.8 - log(1 - 0)) / 2 = 0.223144 / 2
  mean.backward();
  CHECK(entry(scores.grad(), 0, 0) == near(-0.5));  // d/dl (-l / 2)
  CHECK(std::isfinite(entry(scores.grad(), 0, 1)));
}

TEST_CASE("batchwise cross-entropy rejects bad shapes and relevances outside [0, 1]") {
  const batchwise::CrossEntropyLoss loss(ScorerOutputType::probability);
  CHECK_THROWS_WITH_AS(loss.sum(matrix({{0.5, 0.5}}), matrix({{1, 0, 0}})),
                       "batchwise bce loss: relevances must have the scores' shape [1, 2], got "
                       "[1, 3]",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.sum(torch::full({4}, 0.5), torch::ones({4})),
                       "batchwise bce loss: scores must have shape [queries, documents] with "
                       "documents >= 1, got [4]",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.sum(torch::zeros({2, 0}), torch::zeros({2, 0})),
                       doctest::Contains("got [2, 0]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.sum(matrix({{0.5, 0.5}}), matrix({{1, 2}})),
                       "batchwise bce loss: relevances[0, 1] = 2 is not a relevance in [0, 1]",
                       std::invalid_argument);
}

// ---------------------------------------------------------------- softmax cross-entropy

TEST_CASE("softmax cross-entropy on real scores is -log of the relevant documents' softmax mass") {
  const batchwise::SoftmaxCrossEntropy loss(ScorerOutputType::real);
  const torch::Tensor scores = matrix({{2, 1, 0}}, true);
  // -log(e^2 / (e^2 + e + 1)) = log(1 + e^-1 + e^-2) = log 1.503214 = 0.407606
  const torch::Tensor mean = loss.mean(scores, matrix({{1, 0, 0}}));
  CHECK(value(mean) == near(0.407606));
  // Two relevant: -log((e^2 + e) / (e^2 + e + 1)) = log(1 + 1 / (e^2 + e)) = 0.094344
  CHECK(value(loss.mean(matrix({{2, 1, 0}}), matrix({{1, 1, 0}}))) == near(0.094344));
  mean.backward();
  // softmax - one-hot: softmax([2, 1, 0]) = [0.665241, 0.244728, 0.090031]
  CHECK(entry(scores.grad(), 0, 0) == near(-0.334759));
  CHECK(entry(scores.grad(), 0, 1) == near(0.244728));
  CHECK(entry(scores.grad(), 0, 2) == near(0.090031));
  CHECK(loss.name() == "ce");
}

TEST_CASE("softmax cross-entropy with one relevant document equals torch's cross_entropy") {
  const batchwise::SoftmaxCrossEntropy loss(ScorerOutputType::real);
  const torch::Tensor scores = torch::randn({6, 4}, torch::kDouble);
  const torch::Tensor targets = torch::tensor({0, 3, 1, 2, 2, 0}, torch::kLong);
  const torch::Tensor relevances = torch::one_hot(targets, 4);  // int64: converted
  CHECK(value(loss.mean(scores, relevances)) ==
        near(value(torch::nn::functional::cross_entropy(scores, targets))));
}

TEST_CASE("softmax cross-entropy on probabilities and log-probabilities of a distribution") {
  // p = [0.5, 0.3, 0.2], relevant: the second: -log 0.3 = 1.203973
  const batchwise::SoftmaxCrossEntropy on_probabilities(ScorerOutputType::probability);
  CHECK(value(on_probabilities.mean(matrix({{0.5, 0.3, 0.2}}), matrix({{0, 1, 0}}))) ==
        near(1.203973));
  const batchwise::SoftmaxCrossEntropy on_log(ScorerOutputType::log_probability);
  CHECK(value(on_log.mean(matrix({{std::log(0.5), std::log(0.3), std::log(0.2)}}),
                          matrix({{0, 1, 0}}))) == near(1.203973));
  // A row that does not sum to 1 is renormalized: [0.2, 0.2] -> [0.5, 0.5]: -log 0.5 = log 2
  // (not -log 0.2 = 1.609438, the value without renormalizing).
  CHECK(value(on_probabilities.mean(matrix({{0.2, 0.2}}), matrix({{1, 0}}))) == near(0.693147));
}

TEST_CASE("softmax cross-entropy needs binary relevances and a relevant document per query") {
  const batchwise::SoftmaxCrossEntropy loss(ScorerOutputType::real);
  CHECK_THROWS_WITH_AS(loss.sum(matrix({{1, 2}, {3, 4}}), matrix({{1, 0}, {0, 0}})),
                       "batchwise ce loss: query 1 has no relevant document (relevances all "
                       "0); its loss -log(0) would be infinite",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.sum(matrix({{1, 2}}), matrix({{0.5, 1}})),
                       doctest::Contains("relevances[0, 0] = 0.5 is not 0 or 1"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(loss.sum(matrix({{1, 2}}), matrix({{1, 0}}).to(torch::kFloat).unsqueeze(0)),
                       doctest::Contains("relevances must have the scores' shape [1, 2], got [1, 1, 2]"),
                       std::invalid_argument);
}

TEST_CASE("batchwise losses sum zero queries to 0 and refuse their mean") {
  const batchwise::SoftmaxCrossEntropy loss(ScorerOutputType::real);
  const torch::Tensor none = torch::zeros({0, 3}, torch::kDouble);
  CHECK(value(loss.sum(none, none)) == 0);
  CHECK_THROWS_WITH_AS(loss.mean(none, none), doctest::Contains("empty batch"),
                       std::invalid_argument);
}

TEST_CASE("gradient descent on each pairwise loss ranks the positive first") {
  // Free scores as parameters, 50 plain SGD steps from a wrong order.
  for (ScorerOutputType type : {ScorerOutputType::real, ScorerOutputType::log_probability}) {
    for (const char* name : {"cross-entropy", "hinge", "pointwise-cross-entropy"}) {
      const auto loss = pairwise::make_pairwise_loss(name, type);
      torch::Tensor logits = matrix({{-1, 1}, {0, 0.5}}, true);
      for (int step = 0; step < 50; ++step) {
        const torch::Tensor scores =
            type == ScorerOutputType::real ? logits : torch::log_sigmoid(logits);
        const torch::Tensor total = loss->sum(scores);
        total.backward();
        torch::NoGradGuard no_grad;
        logits -= 0.5 * logits.grad();
        logits.grad().zero_();
      }
      const torch::Tensor final_scores =
          type == ScorerOutputType::real ? logits : torch::log_sigmoid(logits);
      CAPTURE(name);
      CAPTURE(xpm::to_string(type));
      CHECK(pairwise::pairwise_accuracy(final_scores) == 1.0);
    }
  }
}
