#include "torch_doctest.hpp"

#include <torch/torch.h>

#include <limits>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/trainer/steps/data_parallel_trainer.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/trainer/steps/loss_trainer.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/tasks/transformer_tagger.hpp"

namespace {

std::vector<xpm::EncodedSentence> random_sentences(std::size_t n) {
  std::vector<xpm::EncodedSentence> sentences;
  torch::manual_seed(7);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t length = torch::randint(1, 20, {1}).item<std::int64_t>();
    xpm::EncodedSentence s;
    for (std::int64_t t = 0; t < length; ++t) {
      s.token_ids.push_back(torch::randint(2, 50, {1}).item<std::int64_t>());
      s.tag_ids.push_back(torch::randint(0, 7, {1}).item<std::int64_t>());
    }
    sentences.push_back(s);
  }
  return sentences;
}

std::vector<torch::Tensor> gradients(xpm::TransformerTagger& model) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().detach().clone());
  return grads;
}

}  // namespace

TEST_CASE("the gradient of k microbatches weighted by real tokens equals one batch's gradient") {
  const auto sentences = random_sentences(23);
  xpm::TransformerTaggerOptions options;
  options.vocab_size = 50;
  options.num_tags = 7;
  options.d_model = 16;
  options.nhead = 2;
  options.dim_feedforward = 32;
  options.dropout = 0.0;
  torch::manual_seed(3);
  xpm::TransformerTagger model(options);
  model->to(torch::kFloat64);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));

  std::vector<std::size_t> all(sentences.size());
  std::vector<std::vector<double>> record_dims;
  std::vector<double> record_units;
  for (std::size_t i = 0; i < sentences.size(); ++i) {
    all[i] = i;
    record_dims.push_back({1.0, static_cast<double>(sentences[i].token_ids.size())});
    record_units.push_back(static_cast<double>(sentences[i].token_ids.size()));
  }
  const auto loss_sum = [&](const std::vector<std::size_t>& ids) {
    const xpm::TaggingBatch batch = xpm::collate(sentences, ids);
    return xpm::token_cross_entropy_sum(model->forward(batch.token_ids, batch.padding_mask),
                                        batch.tag_ids);
  };

  // One batch: mean token loss over the whole outer batch.
  optimizer.zero_grad();
  const xpm::TaggingBatch whole = xpm::collate(sentences, all);
  (loss_sum(all) / static_cast<double>(whole.real_tokens)).backward();
  const auto expected = gradients(model);

  // Microbatches planned under a budget of 60 token slots (bs * l <= 60).
  xpm::PredictiveBatcherOptions batcher_options;
  batcher_options.formula = xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"});
  batcher_options.probe_points = {{{{"bs", 1}, {"l", 1}}}};
  batcher_options.budget = {60, 1.0, 0};
  xpm::PredictiveBatcher batcher(batcher_options,
                                 std::make_shared<xpm::AdaptivePacker>(xpm::AdaptivePackerOptions{"l"}));
  batcher.set_model(xpm::MemoryModel(xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"}), {1.0}, 0, "bs"));
  const xpm::MicrobatchPlan plan = batcher.plan(record_dims);
  REQUIRE(plan.microbatches.size() >= 4);
  REQUIRE(plan.over_budget_records.empty());

  optimizer.zero_grad();
  xpm::LossTrainer trainer(optimizer, batcher, nullptr);
  const xpm::StepResult result = trainer.accumulate_gradients(plan, record_units, loss_sum);
  CHECK(result.microbatches == static_cast<std::int64_t>(plan.microbatches.size()));
  CHECK(result.units == doctest::Approx(static_cast<double>(whole.real_tokens)));
  const auto actual = gradients(model);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double scale = expected[i].abs().max().item<double>() + 1e-30;
    CHECK((actual[i] - expected[i]).abs().max().item<double>() / scale < 1e-6);
  }
}

TEST_CASE("a record over budget even alone is skipped and counted, not run") {
  xpm::PredictiveBatcherOptions batcher_options;
  batcher_options.formula = xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"});
  batcher_options.probe_points = {{{{"bs", 1}, {"l", 1}}}};
  batcher_options.budget = {10, 1.0, 0};
  xpm::PredictiveBatcher batcher(batcher_options, std::make_shared<xpm::AdaptivePacker>());
  batcher.set_model(xpm::MemoryModel(xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"}), {1.0}, 0, "bs"));
  torch::nn::Linear layer(1, 1);
  torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
  xpm::LossTrainer trainer(optimizer, batcher, nullptr);
  int calls = 0;
  const xpm::StepResult result = trainer.train_step(
      {{1, 4}, {1, 50}, {1, 3}}, {4, 50, 3}, [&](const std::vector<std::size_t>& ids) {
        ++calls;
        CHECK(std::find(ids.begin(), ids.end(), 1) == ids.end());
        return layer(torch::ones({static_cast<std::int64_t>(ids.size()), 1})).sum();
      });
  CHECK(result.skipped_records == 1);
  CHECK(result.units == doctest::Approx(7.0));
  CHECK(calls == result.microbatches);
}

TEST_CASE("loss scaling in the data-parallel step: exact on clean steps and an overflow skips the step") {
  // Two identical float32 models, one trained with a DynamicLossScaler (16-mixed's), one without.
  // Scaling by a power of two and dividing back is exact, so clean steps give bit-identical
  // parameters; an inf loss skips the step (parameters untouched) and halves the scale.
  const auto make_model = [] {
    torch::manual_seed(21);
    return torch::nn::Linear(4, 3);
  };
  torch::nn::Linear plain = make_model(), scaled = make_model();
  torch::optim::AdamW plain_adamw(plain->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW scaled_adamw(scaled->parameters(), torch::optim::AdamWOptions(1e-2));
  xpm::PredictiveBatcherOptions batcher_options;
  batcher_options.formula = xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"});
  batcher_options.probe_points = {{{{"bs", 1}, {"l", 1}}}};
  batcher_options.budget = {12, 1.0, 0};  // 12 token slots: several microbatches per step
  xpm::PredictiveBatcher batcher(batcher_options, std::make_shared<xpm::AdaptivePacker>());
  batcher.set_model(xpm::MemoryModel(xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"}), {1.0}, 0, "bs"));
  xpm::DistributedContext single_process;
  xpm::DataParallelTrainer plain_trainer(plain_adamw, batcher, nullptr, single_process, nullptr);
  xpm::DataParallelTrainer scaled_trainer(scaled_adamw, batcher, nullptr, single_process, nullptr);
  xpm::DynamicLossScaler scaler;
  scaled_trainer.set_loss_scaler(&scaler);

  torch::manual_seed(5);
  const torch::Tensor inputs = torch::randn({10, 4});
  const torch::Tensor targets = torch::randn({10, 3});
  const std::vector<std::vector<double>> dims = {{1, 3}, {1, 5}, {1, 2}, {1, 4}, {1, 6},
                                                 {1, 1}, {1, 3}, {1, 2}, {1, 5}, {1, 4}};
  const std::vector<double> units(dims.size(), 1.0);
  bool poison = false;
  const auto loss_of = [&](torch::nn::Linear& model) {
    return [&](const std::vector<std::size_t>& records) {
      std::vector<std::int64_t> rows(records.begin(), records.end());
      const torch::Tensor index = torch::tensor(rows, torch::kLong);
      torch::Tensor loss = (model(inputs.index_select(0, index)) - targets.index_select(0, index)).pow(2).sum();
      return poison ? loss * std::numeric_limits<float>::infinity() : loss;
    };
  };
  const auto parameters_equal = [&] {
    for (std::size_t i = 0; i < plain->parameters().size(); ++i) {
      if (!torch::equal(plain->parameters()[i], scaled->parameters()[i])) return false;
    }
    return true;
  };
  for (int step = 0; step < 3; ++step) {
    const xpm::GlobalStepResult a = plain_trainer.train_step(dims, units, loss_of(plain));
    const xpm::GlobalStepResult b = scaled_trainer.train_step(dims, units, loss_of(scaled));
    REQUIRE(b.microbatches >= 2);
    CHECK_FALSE(b.loss_scale_overflow);
    CHECK(b.loss_scale == 65536.0);
    CHECK(b.loss == a.loss);  // the reported loss is the unscaled one
    CHECK(parameters_equal());
  }
  std::vector<torch::Tensor> before;
  for (const auto& p : scaled->parameters()) before.push_back(p.detach().clone());
  poison = true;
  const xpm::GlobalStepResult overflow = scaled_trainer.train_step(dims, units, loss_of(scaled));
  poison = false;
  CHECK(overflow.loss_scale_overflow);
  CHECK(overflow.units == 0);
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(torch::equal(before[i], scaled->parameters()[i]));
  CHECK(scaler.current_scale() == 32768.0);
  CHECK(scaler.skipped_steps() == 1);
  // The next clean step steps again, at the lower scale.
  const xpm::GlobalStepResult after = scaled_trainer.train_step(dims, units, loss_of(scaled));
  CHECK_FALSE(after.loss_scale_overflow);
  CHECK(after.loss_scale == 32768.0);
  CHECK_FALSE(torch::equal(before[0], scaled->parameters()[0]));
}
