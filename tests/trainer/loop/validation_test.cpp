// ValidationSettings and EarlyStopping on scripted metric sequences, independent of any job:
// the votes and best validations are derived by hand from the sequences below.
#include "torch_doctest.hpp"

#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "xpm/trainer/loop/learner_listener.hpp"
#include "xpm/trainer/loop/train_context.hpp"
#include "xpm/trainer/loop/validation.hpp"

namespace xpm {
// For doctest's messages (found by argument-dependent lookup).
std::ostream& operator<<(std::ostream& out, LearnerVote vote) {
  return out << (vote == LearnerVote::kStop ? "stop" : vote == LearnerVote::kContinue ? "continue" : "no_decision");
}
}  // namespace xpm

namespace {

// Feeds `values` as "validation/<metric>" at steps 100, 200, ... and returns the votes; `best`
// gets, per validation, whether it was a new best.
std::vector<xpm::LearnerVote> feed(xpm::EarlyStopping& early_stopping, const std::string& metric,
                                   const std::vector<double>& values, std::vector<bool>* best,
                                   std::int64_t first_step = 100) {
  xpm::TrainState state;
  xpm::TrainerContext context(state);
  std::vector<xpm::LearnerVote> votes;
  for (std::size_t i = 0; i < values.size(); ++i) {
    state.step = first_step + 100 * static_cast<std::int64_t>(i);
    context.clear_metrics();
    {
      auto scope = context.scope("validation");
      context.add_metric(metric, values[i]);
    }
    votes.push_back(early_stopping.on_validation(context));
    if (best != nullptr) best->push_back(early_stopping.last_was_best());
  }
  return votes;
}

constexpr auto kNo = xpm::LearnerVote::kNoDecision;
constexpr auto kStop = xpm::LearnerVote::kStop;

}  // namespace

TEST_CASE("early stopping in max mode stops after `patience` validations without a higher accuracy") {
  xpm::ValidationSettings settings;
  settings.metric = "token_accuracy";
  settings.mode = xpm::MetricMode::kMax;
  settings.patience = 3;
  xpm::EarlyStopping early_stopping(settings);
  std::vector<bool> best;
  // best: 0.50 (new), 0.60 (new), 0.55 (1 without), 0.60 (equal is no gain: 2), 0.58 (3: stop)
  const auto votes = feed(early_stopping, "token_accuracy", {0.50, 0.60, 0.55, 0.60, 0.58}, &best);
  CHECK(votes == std::vector<xpm::LearnerVote>{kNo, kNo, kNo, kNo, kStop});
  CHECK(best == std::vector<bool>{true, true, false, false, false});
  CHECK(early_stopping.state().best_value == doctest::Approx(0.60));
  CHECK(early_stopping.state().best_step == 200);
  CHECK(early_stopping.state().validations_since_best == 3);
}

TEST_CASE("early stopping in min mode treats a LOWER loss as better and stops when losses rise") {
  xpm::ValidationSettings settings;
  settings.metric = "loss";
  settings.mode = xpm::MetricMode::kMin;
  settings.patience = 2;
  xpm::EarlyStopping early_stopping(settings);
  std::vector<bool> best;
  // 1.0 best; 0.8 best; 0.9 (1); 0.7 best (reset); 0.75 (1); 0.9 (2: stop)
  const auto votes = feed(early_stopping, "loss", {1.0, 0.8, 0.9, 0.7, 0.75, 0.9}, &best);
  CHECK(votes == std::vector<xpm::LearnerVote>{kNo, kNo, kNo, kNo, kNo, kStop});
  CHECK(best == std::vector<bool>{true, true, false, true, false, false});
  CHECK(early_stopping.state().best_value == doctest::Approx(0.7));
  CHECK(early_stopping.state().best_step == 400);

  // The same rising losses in max mode would keep "improving" and never stop (a higher loss
  // taken as better); min mode stops on them.
  xpm::ValidationSettings wrong = settings;
  wrong.mode = xpm::MetricMode::kMax;
  xpm::EarlyStopping higher_is_better(wrong);
  const auto wrong_votes = feed(higher_is_better, "loss", {1.0, 1.1, 1.2, 1.3}, nullptr);
  CHECK(wrong_votes == std::vector<xpm::LearnerVote>{kNo, kNo, kNo, kNo});
  xpm::EarlyStopping lower_is_better(settings);
  CHECK(feed(lower_is_better, "loss", {1.0, 1.1, 1.2, 1.3}, nullptr) ==
        std::vector<xpm::LearnerVote>{kNo, kNo, kStop, kStop});
}

TEST_CASE("warmup validations are neither best candidates nor counted for patience") {
  xpm::ValidationSettings settings;
  settings.metric = "token_accuracy";
  settings.mode = xpm::MetricMode::kMax;
  settings.warmup_validations = 2;
  settings.patience = 1;
  xpm::EarlyStopping early_stopping(settings);
  std::vector<bool> best;
  // 0.9 and 0.95 in warmup (ignored); 0.5 is the first best; 0.4 -> 1 without gain: stop.
  const auto votes = feed(early_stopping, "token_accuracy", {0.9, 0.95, 0.5, 0.4}, &best);
  CHECK(votes == std::vector<xpm::LearnerVote>{kNo, kNo, kNo, kStop});
  CHECK(best == std::vector<bool>{false, false, true, false});
  CHECK(early_stopping.state().best_value == doctest::Approx(0.5));
  CHECK(early_stopping.state().validations == 4);
}

TEST_CASE("patience 0 never votes stop but still tracks the best validation") {
  xpm::ValidationSettings settings;
  settings.metric = "loss";
  settings.mode = xpm::MetricMode::kMin;
  xpm::EarlyStopping early_stopping(settings);
  std::vector<bool> best;
  const auto votes = feed(early_stopping, "loss", {2.0, 3.0, 4.0, 1.5, 5.0}, &best);
  CHECK(votes == std::vector<xpm::LearnerVote>(5, kNo));
  CHECK(best == std::vector<bool>{true, false, false, true, false});
  CHECK(early_stopping.state().best_step == 400);
}

TEST_CASE("a restored early-stopping state votes as the uninterrupted one") {
  xpm::ValidationSettings settings;
  settings.metric = "loss";
  settings.mode = xpm::MetricMode::kMin;
  settings.warmup_validations = 1;
  settings.patience = 2;
  const std::vector<double> values = {9.0, 1.0, 0.5, 0.6, 0.4, 0.45, 0.41};
  xpm::EarlyStopping uninterrupted(settings);
  const auto all_votes = feed(uninterrupted, "loss", values, nullptr);
  CHECK(all_votes.back() == kStop);

  xpm::EarlyStopping first(settings);
  const auto first_votes = feed(first, "loss", {values.begin(), values.begin() + 4}, nullptr);
  xpm::EarlyStopping resumed(settings);
  resumed.restore(nlohmann::json::parse(first.to_json().dump()));
  const auto later_votes = feed(resumed, "loss", {values.begin() + 4, values.end()}, nullptr, 500);
  std::vector<xpm::LearnerVote> joined = first_votes;
  joined.insert(joined.end(), later_votes.begin(), later_votes.end());
  CHECK(joined == all_votes);
  CHECK(resumed.state().best_step == uninterrupted.state().best_step);
  CHECK(*resumed.state().best_value == *uninterrupted.state().best_value);
}

TEST_CASE("a listener voting continue overrides early stopping's stop (combine_votes)") {
  xpm::ValidationSettings settings;  // by default the validation loss decides, lower is better
  CHECK(settings.metric == "loss");
  CHECK(settings.mode == xpm::MetricMode::kMin);
  settings.patience = 1;
  xpm::EarlyStopping early_stopping(settings);
  const auto votes = feed(early_stopping, "loss", {0.4, 0.5}, nullptr);
  REQUIRE(votes.back() == kStop);
  CHECK(xpm::combine_votes({votes.back(), xpm::LearnerVote::kContinue}) == xpm::LearnerVote::kContinue);
  CHECK(xpm::combine_votes({votes.back(), kNo}) == kStop);
  CHECK(xpm::combine_votes({kNo, kNo}) == kNo);
  CHECK(xpm::should_stop({kNo, kStop}));
}

TEST_CASE("a missing validation metric is named with the metrics the validation reported") {
  xpm::ValidationSettings settings;
  settings.metric = "loss";
  settings.mode = xpm::MetricMode::kMin;
  xpm::EarlyStopping early_stopping(settings);
  xpm::TrainState state;
  xpm::TrainerContext context(state);
  {
    auto scope = context.scope("validation");
    context.add_metric("token_accuracy", 0.9);
  }
  try {
    early_stopping.on_validation(context);
    FAIL("no error");
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    CHECK(message.find("validation: the metric 'validation/loss' (set_validation_every's, which picks the best "
                       "parameters) is missing") != std::string::npos);
    CHECK(message.find("validation/token_accuracy") != std::string::npos);
  }
}

TEST_CASE("validation is due every N steps and every N epochs") {
  xpm::ValidationSettings settings;
  settings.every_steps = 100;
  CHECK_FALSE(settings.due(0, 0));
  CHECK_FALSE(settings.due(99, 0));
  CHECK(settings.due(200, 0));
  settings.every_steps = 0;
  settings.every_epochs = 2;
  CHECK_FALSE(settings.due(100, 1));
  CHECK(settings.due(101, 2));
  CHECK_FALSE(settings.due(102, 0));
}

TEST_CASE("the metric mode is explicit or the metric's natural direction with auto") {
  CHECK(xpm::parse_metric_mode("min", "token_accuracy") == xpm::MetricMode::kMin);
  CHECK(xpm::parse_metric_mode("auto", "token_accuracy") == xpm::MetricMode::kMax);
  CHECK(xpm::parse_metric_mode("auto", "loss") == xpm::MetricMode::kMin);
  CHECK_THROWS_AS(xpm::parse_metric_mode("auto", "f1"), std::invalid_argument);
  CHECK_THROWS_AS(xpm::parse_metric_mode("lower", "loss"), std::invalid_argument);
  xpm::ValidationSettings bad;
  bad.patience = -1;
  CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains("patience must be >= 0"), std::invalid_argument);
}
