// LossTrainer (loss_trainer.hpp): a weighted sum of named losses with their own units gives the
// gradient of sum_k w_k * mean_k whatever the microbatch split (checked against one big batch
// computed directly), each named loss's per-unit mean is reported and combines across halves
// weighted by units; and after an out-of-memory error in backward the buffers LibTorch's
// autograd engine keeps are released, so allocated memory is back to its pre-step value.
#include "torch_doctest.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/steps/fixed_batchers.hpp"
#include "xpm/trainer/steps/loss_trainer.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/tasks/transformer_tagger.hpp"
#include "trainer/steps/gradient_snapshot.hpp"

namespace {

namespace F = torch::nn::functional;

std::vector<xpm::EncodedSentence> random_sentences(std::size_t n) {
  std::vector<xpm::EncodedSentence> sentences;
  torch::manual_seed(11);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t length = torch::randint(1, 15, {1}).item<std::int64_t>();
    xpm::EncodedSentence s;
    for (std::int64_t t = 0; t < length; ++t) {
      s.token_ids.push_back(torch::randint(2, 40, {1}).item<std::int64_t>());
      s.tag_ids.push_back(torch::randint(0, 5, {1}).item<std::int64_t>());
    }
    sentences.push_back(s);
  }
  return sentences;
}

xpm::TransformerTagger small_tagger() {
  xpm::TransformerTaggerOptions options;
  options.vocab_size = 40;
  options.num_tags = 5;
  options.d_model = 16;
  options.nhead = 2;
  options.dim_feedforward = 32;
  options.dropout = 0.0;
  torch::manual_seed(3);
  xpm::TransformerTagger model(options);
  model->to(torch::kFloat64);
  return model;
}

// Two losses from one forward: "tagging", the token cross-entropy (units: tokens), and
// "first_tag", each sentence's mean logits against its first tag (units: sentences).
std::map<std::string, torch::Tensor> named_sums(xpm::TransformerTagger& model,
                                                const std::vector<xpm::EncodedSentence>& sentences,
                                                const std::vector<std::size_t>& ids) {
  const xpm::TaggingBatch batch = xpm::collate(sentences, ids);
  const torch::Tensor logits = model->forward(batch.token_ids, batch.padding_mask);  // [bs, l, tags]
  const torch::Tensor real = (~batch.padding_mask).unsqueeze(-1).to(logits.dtype());
  const torch::Tensor mean_logits = (logits * real).sum(1) / real.sum(1);  // [bs, tags]
  std::vector<std::int64_t> first;
  for (std::size_t i : ids) first.push_back(sentences[i].tag_ids.front());
  return {{"tagging", xpm::token_cross_entropy_sum(logits, batch.tag_ids)},
          {"first_tag", F::cross_entropy(mean_logits, torch::tensor(first, torch::kLong),
                                         F::CrossEntropyFuncOptions().reduction(torch::kSum))}};
}

using xpm_test::gradients;

double max_relative_difference(const std::vector<torch::Tensor>& actual,
                               const std::vector<torch::Tensor>& expected) {
  double worst = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double scale = expected[i].abs().max().item<double>() + 1e-30;
    worst = std::max(worst, (actual[i] - expected[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

// A batcher whose model is set by hand: a microbatch costs bs * l bytes, budget in token slots.
xpm::PredictiveBatcher token_slot_batcher(std::int64_t slots) {
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"});
  options.probe_points = {{{{"bs", 1}, {"l", 1}}}};
  options.budget = {slots, 1.0, 0};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>(xpm::AdaptivePackerOptions{"l"}));
  batcher.set_model(xpm::MemoryModel(xpm::CostFormula("a*bs*l", {"a"}, {"bs", "l"}), {1.0}, 0, "bs"));
  return batcher;
}

}  // namespace

TEST_CASE("a weighted sum of named losses gives the gradient of sum_k w_k mean_k over microbatches and reports each loss's per-unit mean") {
  const auto sentences = random_sentences(21);
  xpm::TransformerTagger model = small_tagger();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.0));
  std::vector<std::size_t> all(sentences.size());
  std::vector<double> tokens, ones;
  std::vector<std::vector<double>> dims;
  for (std::size_t i = 0; i < sentences.size(); ++i) {
    all[i] = i;
    tokens.push_back(static_cast<double>(sentences[i].token_ids.size()));
    ones.push_back(1.0);
    dims.push_back({1.0, tokens.back()});
  }

  // Directly: one batch, 1.0 * tagging / tokens + 0.5 * first_tag / sentences.
  optimizer.zero_grad();
  const auto whole = named_sums(model, sentences, all);
  double total_tokens = 0;
  for (double t : tokens) total_tokens += t;
  const double tagging_mean = whole.at("tagging").item<double>() / total_tokens;
  const double first_tag_mean = whole.at("first_tag").item<double>() / 21.0;
  (whole.at("tagging") / total_tokens + 0.5 * whole.at("first_tag") / 21.0).backward();
  const auto expected = gradients(*model);

  xpm::PredictiveBatcher batcher = token_slot_batcher(40);
  const xpm::MicrobatchPlan plan = batcher.plan(dims);
  REQUIRE(plan.microbatches.size() >= 4);
  xpm::WeightedLosses losses;
  losses.weights = {{"tagging", 1.0}, {"first_tag", 0.5}};
  losses.record_units = {{"tagging", tokens}};  // first_tag: the step's record units (1 each)
  optimizer.zero_grad();
  xpm::LossTrainer trainer(optimizer, batcher, nullptr);
  const xpm::StepResult result = trainer.accumulate_weighted_losses(
      plan, ones, losses,
      [&](const std::vector<std::size_t>& ids) { return named_sums(model, sentences, ids); });
  CHECK(result.microbatches == static_cast<std::int64_t>(plan.microbatches.size()));
  CHECK(max_relative_difference(gradients(*model), expected) < 1e-10);
  CHECK(result.units == doctest::Approx(21.0));
  CHECK(result.named_losses.at("tagging").units == doctest::Approx(total_tokens));
  CHECK(result.named_losses.at("first_tag").units == doctest::Approx(21.0));
  CHECK(result.named_losses.at("tagging").mean == doctest::Approx(tagging_mean).epsilon(1e-12));
  CHECK(result.named_losses.at("first_tag").mean == doctest::Approx(first_tag_mean).epsilon(1e-12));
  CHECK(result.named_losses.at("first_tag").weight == 0.5);
  CHECK(result.loss == doctest::Approx(tagging_mean + 0.5 * first_tag_mean).epsilon(1e-12));

  // Means of two halves, each over its own records, combine weighted by their units.
  const std::vector<std::size_t> front = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, back = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
  xpm::UnitWeightedMean tagging;
  for (const auto* half : {&front, &back}) {
    xpm::MicrobatchPlan half_plan;
    half_plan.microbatches.push_back({*half, {}, 0, false});
    optimizer.zero_grad();
    const xpm::StepResult r = trainer.accumulate_weighted_losses(
        half_plan, ones, losses,
        [&](const std::vector<std::size_t>& ids) { return named_sums(model, sentences, ids); });
    tagging.add(r.named_losses.at("tagging").mean, r.named_losses.at("tagging").units);
  }
  CHECK(tagging.units == doctest::Approx(total_tokens));
  CHECK(tagging.mean() == doctest::Approx(tagging_mean).epsilon(1e-12));
}

// Nine random sentences, the small tagger, SGD and a LossTrainer planning 30-token microbatches:
// what the train_step cases share.
struct NineSentenceStep {
  std::vector<xpm::EncodedSentence> sentences = random_sentences(9);
  xpm::TransformerTagger model = small_tagger();
  torch::optim::SGD optimizer{model->parameters(), torch::optim::SGDOptions(0.1)};
  std::vector<double> ones = std::vector<double>(sentences.size(), 1.0);
  std::vector<std::vector<double>> dims = token_dims(sentences);
  xpm::PredictiveBatcher batcher = token_slot_batcher(30);
  xpm::LossTrainer trainer{optimizer, batcher, nullptr};

  static std::vector<std::vector<double>> token_dims(const std::vector<xpm::EncodedSentence>& sentences) {
    std::vector<std::vector<double>> out;
    for (const auto& s : sentences) out.push_back({1.0, static_cast<double>(s.token_ids.size())});
    return out;
  }
};

TEST_CASE("LossTrainer::train_step with named losses steps once and report_losses records loss and loss/<name>") {
  NineSentenceStep f;
  const auto& sentences = f.sentences;
  auto& model = f.model;
  const auto& ones = f.ones;
  const auto& dims = f.dims;
  auto& trainer = f.trainer;
  xpm::WeightedLosses losses;
  losses.weights = {{"tagging", 0.0}, {"first_tag", 2.0}};
  const torch::Tensor before = model->parameters()[0].detach().clone();
  int optimizer_steps_announced = 0;
  const xpm::StepResult result = trainer.train_step(
      dims, ones, losses,
      [&](const std::vector<std::size_t>& ids) { return named_sums(model, sentences, ids); },
      [&] { ++optimizer_steps_announced; });
  CHECK(optimizer_steps_announced == 1);
  CHECK_FALSE(result.oom);
  CHECK(result.microbatches >= 2);
  CHECK(result.loss == doctest::Approx(2.0 * result.named_losses.at("first_tag").mean));
  CHECK(result.named_losses.at("tagging").mean > 0);  // reported even with weight 0
  CHECK_FALSE(torch::equal(model->parameters()[0].detach(), before));

  xpm::TrainState state;
  xpm::TrainerContext context(state);
  {
    auto scope = context.scope("train");
    xpm::report_losses(result, context);
  }
  CHECK(context.metrics().at("train/loss") == result.loss);
  CHECK(context.metrics().at("train/loss/first_tag") == result.named_losses.at("first_tag").mean);
  CHECK(context.metrics().at("train/loss/tagging") == result.named_losses.at("tagging").mean);
}

TEST_CASE("LossTrainer keeps every gradient tensor between steps, zeroed in place (LibTorch 2.x's zero_grad would free them)") {
  NineSentenceStep f;
  const auto& sentences = f.sentences;
  auto& model = f.model;
  const auto& ones = f.ones;
  const auto& dims = f.dims;
  auto& trainer = f.trainer;
  xpm::WeightedLosses losses;
  losses.weights = {{"tagging", 1.0}, {"first_tag", 0.0}};
  const auto step = [&] {
    return trainer.train_step(dims, ones, losses, [&](const std::vector<std::size_t>& ids) {
      return named_sums(model, sentences, ids);
    });
  };
  step();
  std::vector<const void*> storages;
  for (const torch::Tensor& parameter : model->parameters()) {
    REQUIRE(parameter.grad().defined());
    storages.push_back(parameter.grad().data_ptr());
  }
  step();
  std::size_t k = 0;
  for (const torch::Tensor& parameter : model->parameters()) {
    REQUIRE(parameter.grad().defined());
    CHECK(parameter.grad().data_ptr() == storages[k++]);  // the same tensor, not a new one
  }
}

TEST_CASE("a loss that is not a scalar is refused naming its shape, not LibTorch's backward message") {
  NineSentenceStep f;
  const torch::Tensor before = f.model->parameters()[0].detach().clone();
  const auto per_token = [&](const std::vector<std::size_t>& ids) {
    return named_sums(f.model, f.sentences, ids).at("tagging").reshape({1}).expand({3});
  };
  CHECK_THROWS_WITH_AS(f.trainer.train_step(f.dims, f.ones, per_token),
                       "the microbatch's loss must be a scalar tensor (the task's loss_sum), got one of shape [3]",
                       std::invalid_argument);
  CHECK(torch::equal(f.model->parameters()[0].detach(), before));  // no optimizer step
}

TEST_CASE("weighted losses refuse bad weights, names and a loss function that returns other losses, naming the loss") {
  xpm::WeightedLosses losses;
  CHECK_THROWS_AS(losses.validate(), std::invalid_argument);
  losses.weights = {{"a", -1.0}};
  CHECK_THROWS_WITH_AS(losses.validate(), doctest::Contains("'a'"), std::invalid_argument);
  losses.weights = {{"a/b", 1.0}};
  CHECK_THROWS_WITH_AS(losses.validate(), doctest::Contains("'a/b'"), std::invalid_argument);
  losses.weights = {{"a", 1.0}};
  losses.record_units = {{"b", {1.0}}};
  CHECK_THROWS_WITH_AS(losses.validate(), doctest::Contains("'b'"), std::invalid_argument);

  torch::nn::Linear layer(1, 1);
  torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
  xpm::PredictiveBatcher batcher = token_slot_batcher(10);
  xpm::LossTrainer trainer(optimizer, batcher, nullptr);
  losses.record_units.clear();
  const xpm::MicrobatchPlan plan = xpm::fixed_size_plan(2, 2);
  const auto sum = [&](const std::vector<std::size_t>& ids) {
    return layer(torch::ones({static_cast<std::int64_t>(ids.size()), 1})).sum();
  };
  CHECK_THROWS_WITH_AS(
      trainer.accumulate_weighted_losses(plan, {1, 1}, losses,
                                         [&](const std::vector<std::size_t>& ids) {
                                           return std::map<std::string, torch::Tensor>{{"b", sum(ids)}};
                                         }),
      doctest::Contains("'b'"), std::invalid_argument);
  losses.weights = {{"a", 1.0}, {"c", 1.0}};
  CHECK_THROWS_WITH_AS(
      trainer.accumulate_weighted_losses(plan, {1, 1}, losses,
                                         [&](const std::vector<std::size_t>& ids) {
                                           return std::map<std::string, torch::Tensor>{{"a", sum(ids)}};
                                         }),
      doctest::Contains("did not return loss 'c'"), std::invalid_argument);
  losses.record_units = {{"c", {1.0, 1.0, 1.0}}};
  CHECK_THROWS_WITH_AS(trainer.accumulate_weighted_losses(plan, {1, 1}, losses, {}),
                       doctest::Contains("record_units['c']"), std::invalid_argument);
}

TEST_CASE("after a backward runs out of memory, release_autograd_buffers_after_oom brings allocated memory back to its value before the step") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  // Three branches joined by a sum: the engine queues each branch's gradient, so when one
  // branch's backward hits the cap the others' gradients are still queued.
  auto branch = [] {
    return torch::nn::Sequential(torch::nn::Linear(64, 512), torch::nn::ReLU(),
                                 torch::nn::Linear(512, 512), torch::nn::ReLU(),
                                 torch::nn::Linear(512, 1));
  };
  torch::manual_seed(1);
  auto a = branch(), b = branch(), c = branch();
  for (auto* m : {&a, &b, &c}) {
    for (auto& p : (*m)->parameters()) p.mutable_grad() = torch::zeros_like(p);
  }
  const torch::Tensor x = torch::randn({256, 64});
  const auto loss = [&] { return (a->forward(x) + b->forward(x) + c->forward(x)).sum(); };
  const std::int64_t base_bytes = meter.current_allocated_bytes();
  meter.reset_peak();
  loss().backward();
  const std::int64_t step_peak_bytes = meter.peak_allocated_bytes() - base_bytes;
  meter.reset_peak();
  { const torch::Tensor l = loss(); }
  const std::int64_t forward_peak_bytes = meter.peak_allocated_bytes() - base_bytes;
  REQUIRE(meter.current_allocated_bytes() == base_bytes);
  REQUIRE(step_peak_bytes > forward_peak_bytes);

  std::int64_t left_after_oom_bytes = -1;
  {
    xpm::ScopedMemoryCap cap(base_bytes + forward_peak_bytes + (step_peak_bytes - forward_peak_bytes) / 2);
    torch::Tensor l = loss();  // the forward fits
    CHECK_THROWS_AS(l.backward(), c10::OutOfMemoryError);
    l = torch::Tensor();  // the graph goes with the loss
    left_after_oom_bytes = meter.current_allocated_bytes() - base_bytes;
    xpm::release_autograd_buffers_after_oom();
    CHECK(meter.capacity_bytes() > 0);  // the cap is back
  }
  INFO("left by the failed backward: ", left_after_oom_bytes, " bytes");
  CHECK(left_after_oom_bytes >= 256 * 512 * 4);  // at least one queued [256, 512] float gradient
  CHECK(meter.current_allocated_bytes() == base_bytes);
}
