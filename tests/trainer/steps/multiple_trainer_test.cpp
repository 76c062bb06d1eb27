// MultipleTrainer (multiple_trainer.hpp) on the Brown corpus: two tagging sub-tasks sharing one
// Transformer tagger, short sentences (<= 10 tokens) and long ones (25..45 tokens), each with
// its own PredictiveBatcher (its own formula and budget) and probe executor. Probing reaches
// every sub-trainer (each batcher fitted, each executor ran its probes); one step's gradient
// equals the weighted sum of each sub-task's gradient computed separately on its whole outer
// batch; one optimizer step; an out-of-memory error in one sub-trainer skips the step.
#include "torch_doctest.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "xpm/planner/packer.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/trainer/steps/multiple_trainer.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/tasks/transformer_tagger.hpp"
#include "trainer/steps/gradient_snapshot.hpp"

namespace {

const std::string kData = std::string(XPM_SOURCE_DIR) + "/data/brown";

struct BrownBuckets {
  std::int64_t vocab_size = 0;
  std::int64_t num_tags = 0;
  std::vector<xpm::EncodedSentence> short_sentences;  // 1..10 tokens
  std::vector<xpm::EncodedSentence> long_sentences;   // 25..45 tokens
};

const BrownBuckets& brown_buckets() {
  static const BrownBuckets buckets = [] {
    const xpm::CorpusSplit split = xpm::split_by_file(xpm::read_brown_corpus(kData));
    const xpm::Vocabulary vocab = xpm::Vocabulary::build(split.train, 3000, 2);
    const xpm::TagSet tags = xpm::TagSet::build(split.train);
    BrownBuckets b;
    b.vocab_size = static_cast<std::int64_t>(vocab.size());
    b.num_tags = static_cast<std::int64_t>(tags.size());
    for (const auto& s : xpm::encode(split.train, vocab, tags)) {
      const std::size_t n = s.token_ids.size();
      if (n >= 1 && n <= 10 && b.short_sentences.size() < 24) b.short_sentences.push_back(s);
      if (n >= 25 && n <= 45 && b.long_sentences.size() < 12) b.long_sentences.push_back(s);
    }
    return b;
  }();
  return buckets;
}

xpm::TransformerTagger brown_tagger(const BrownBuckets& data) {
  xpm::TransformerTaggerOptions options;
  options.vocab_size = data.vocab_size;
  options.num_tags = data.num_tags;
  options.d_model = 16;
  options.nhead = 2;
  options.dim_feedforward = 32;
  options.dropout = 0.0;
  options.max_length = 64;
  torch::manual_seed(9);
  xpm::TransformerTagger model(options);
  model->to(torch::kFloat64);  // sums in another order agree to ~1e-15
  return model;
}

void zero_gradients(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

using xpm_test::gradients;

// Counts the probes that reach a sub-trainer's executor.
struct CountingExecutor : xpm::ProbeExecutor {
  explicit CountingExecutor(xpm::ProbeExecutor& inner) : inner_(inner) {}
  xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
    ++probes;
    return inner_.run_probe(dims);
  }
  double static_bytes() override { return inner_.static_bytes(); }
  xpm::ProbeExecutor& inner_;
  int probes = 0;
};

xpm::OuterBatch outer_batch(xpm::TransformerTagger& model, const std::vector<xpm::EncodedSentence>& sentences) {
  xpm::OuterBatch batch;
  for (const auto& s : sentences) {
    batch.record_dims.push_back({1.0, static_cast<double>(s.token_ids.size())});
    batch.record_units.push_back(static_cast<double>(s.token_ids.size()));
  }
  batch.loss_sum_fn = [&model, &sentences](const std::vector<std::size_t>& ids) {
    const xpm::TaggingBatch b = xpm::collate(sentences, ids);
    return xpm::token_cross_entropy_sum(model->forward(b.token_ids, b.padding_mask), b.tag_ids);
  };
  return batch;
}

xpm::PredictiveBatcherOptions batcher_options(const std::string& formula,
                                              std::vector<std::string> coefficients,
                                              std::vector<std::vector<double>> probe_dims,
                                              std::int64_t capacity_bytes) {
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula(formula, std::move(coefficients), {"bs", "l"});
  for (const auto& d : probe_dims) options.probe_points.push_back({{{"bs", d[0]}, {"l", d[1]}}});
  options.budget = {capacity_bytes, 1.0, 0};
  return options;
}

}  // namespace

TEST_CASE("a multiple trainer probes every sub-trainer and one step's gradient is the weighted sum of each sub-task's own gradient") {
  const BrownBuckets& data = brown_buckets();
  REQUIRE(data.short_sentences.size() == 24);
  REQUIRE(data.long_sentences.size() == 12);
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  xpm::TransformerTagger model = brown_tagger(data);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.0));  // lr 0: same
  for (auto& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);     // parameters

  // Probes: full steps at synthetic shapes on the shared model.
  xpm::TorchProbeSteps steps;
  steps.forward_backward = [&](const std::vector<double>& dims) {
    const xpm::TaggingBatch b = xpm::synthetic_batch(static_cast<std::int64_t>(dims[0]),
                                                     static_cast<std::int64_t>(dims[1]),
                                                     data.vocab_size, data.num_tags);
    (xpm::token_cross_entropy_sum(model->forward(b.token_ids, b.padding_mask), b.tag_ids) /
     static_cast<double>(b.real_tokens))
        .backward();
  };
  steps.optimizer_step = [&] { optimizer.step(); };
  steps.zero_grad = [&] { zero_gradients(*model); };
  xpm::TorchProbeExecutor executor(steps, meter);
  CountingExecutor short_probes(executor), long_probes(executor);

  // Budgets: the long bucket's whole outer batch must be split; the short one has room.
  const std::int64_t static_bytes = meter.current_allocated_bytes();
  meter.reset_peak();
  {
    xpm::OuterBatch whole = outer_batch(model, data.long_sentences);
    std::vector<std::size_t> all(data.long_sentences.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    whole.loss_sum_fn(all).backward();
  }
  const std::int64_t long_peak_bytes = meter.peak_allocated_bytes();
  zero_gradients(*model);
  xpm::PredictiveBatcher short_batcher(
      batcher_options("a*bs*l + c", {"a", "c"}, {{4, 10}, {8, 10}, {16, 8}, {24, 10}},
                      static_bytes + 4 * (long_peak_bytes - static_bytes)),
      std::make_shared<xpm::UniformPacker>());
  xpm::PredictiveBatcher long_batcher(
      batcher_options("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"},
                      {{1, 45}, {2, 45}, {2, 30}, {4, 45}, {4, 25}},
                      static_bytes + (long_peak_bytes - static_bytes) / 3),
      std::make_shared<xpm::AdaptivePacker>(xpm::AdaptivePackerOptions{"l"}));

  const double short_weight = 1.0, long_weight = 0.5;
  xpm::MultipleTrainer trainer(
      optimizer, &meter,
      {{"short", short_weight, &short_batcher, &short_probes,
        [&] { return outer_batch(model, data.short_sentences); }},
       {"long", long_weight, &long_batcher, &long_probes,
        [&] { return outer_batch(model, data.long_sentences); }}});
  const auto models = trainer.probe_and_fit();
  CHECK(models.size() == 2);
  CHECK(short_batcher.has_model());
  CHECK(long_batcher.has_model());
  CHECK(short_probes.probes == 4);
  CHECK(long_probes.probes == 5);
  CHECK(models.at("short") == &short_batcher.model());
  CHECK(models.at("long") == &long_batcher.model());
  CHECK(short_batcher.model().formula().canonical() != long_batcher.model().formula().canonical());

  // One step over each sub-trainer's next outer batch.
  std::vector<torch::Tensor> stepped_gradients;
  int optimizer_steps = 0;
  const xpm::MultipleStepResult result = trainer.train_step([&] {
    ++optimizer_steps;
    stepped_gradients = gradients(*model);
  });
  REQUIRE_FALSE(result.oom);
  CHECK(optimizer_steps == 1);
  const xpm::StepResult& long_result = result.sub_results.at("long");
  const xpm::StepResult& short_result = result.sub_results.at("short");
  INFO("long microbatches ", long_result.microbatches, ", short ", short_result.microbatches);
  CHECK(long_result.microbatches >= 2);
  CHECK(short_result.microbatches >= 1);
  CHECK(long_result.skipped_records == 0);
  CHECK(result.peak_allocated_bytes > static_bytes);

  // Separately: each sub-task's mean loss over its whole outer batch, one backward each.
  const auto separate = [&](const std::vector<xpm::EncodedSentence>& sentences, double& mean) {
    zero_gradients(*model);
    xpm::OuterBatch batch = outer_batch(model, sentences);
    std::vector<std::size_t> all(sentences.size());
    double units = 0;
    for (std::size_t i = 0; i < all.size(); ++i) {
      all[i] = i;
      units += batch.record_units[i];
    }
    const torch::Tensor loss = batch.loss_sum_fn(all) / units;
    mean = loss.item<double>();
    loss.backward();
    return gradients(*model);
  };
  double short_mean = 0, long_mean = 0;
  const auto short_gradients = separate(data.short_sentences, short_mean);
  const auto long_gradients = separate(data.long_sentences, long_mean);
  double worst = 0;
  for (std::size_t i = 0; i < stepped_gradients.size(); ++i) {
    const torch::Tensor expected = short_weight * short_gradients[i] + long_weight * long_gradients[i];
    const double scale = expected.abs().max().item<double>() + 1e-30;
    worst = std::max(worst, (stepped_gradients[i] - expected).abs().max().item<double>() / scale);
  }
  INFO("largest relative difference ", worst);
  CHECK(worst < 1e-6);
  CHECK(short_result.loss == doctest::Approx(short_mean).epsilon(1e-10));
  CHECK(long_result.loss == doctest::Approx(long_mean).epsilon(1e-10));
  CHECK(result.loss == doctest::Approx(short_weight * short_mean + long_weight * long_mean).epsilon(1e-10));

  xpm::TrainState state;
  xpm::TrainerContext context(state);
  xpm::report_losses(result, context);
  CHECK(context.metrics().at("loss") == result.loss);
  CHECK(context.metrics().at("long/loss") == long_result.loss);
  CHECK(context.metrics().at("short/units") == short_result.units);
}

TEST_CASE("a multiple trainer skips the whole step when one sub-trainer runs out of memory") {
  torch::nn::Linear layer(1, 1);
  torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
  const torch::Tensor before = layer->weight.detach().clone();
  xpm::PredictiveBatcherOptions options = batcher_options("a*bs", {"a"}, {{1, 1}}, 100);
  options.formula = xpm::CostFormula("a*bs", {"a"}, {"bs"});
  options.probe_points = {{{{"bs", 1}}}};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::UniformPacker>());
  batcher.set_model(xpm::MemoryModel(xpm::CostFormula("a*bs", {"a"}, {"bs"}), {1.0}, 0, "bs"));
  const auto batch = [&](bool oom) {
    xpm::OuterBatch b;
    b.record_dims = {{1}, {1}};
    b.record_units = {1, 1};
    b.loss_sum_fn = [&layer, oom](const std::vector<std::size_t>& ids) {
      if (oom) TORCH_CHECK_WITH(OutOfMemoryError, false, "test: out of memory");
      return layer(torch::ones({static_cast<std::int64_t>(ids.size()), 1})).sum();
    };
    return b;
  };
  int optimizer_steps = 0;
  xpm::MultipleTrainer trainer(optimizer, nullptr,
                               {{"fits", 1.0, &batcher, nullptr, [&] { return batch(false); }},
                                {"fails", 1.0, &batcher, nullptr, [&] { return batch(true); }}});
  CHECK(trainer.probe_and_fit().size() == 2);  // models set by hand: nothing to probe
  const xpm::MultipleStepResult result = trainer.train_step([&] { ++optimizer_steps; });
  CHECK(result.oom);
  CHECK(result.oom_sub_trainer == "fails");
  CHECK(optimizer_steps == 0);
  CHECK(layer->weight.grad().abs().sum().item<double>() == 0.0);
  CHECK(torch::equal(layer->weight.detach(), before));
}

TEST_CASE("a multiple trainer refuses bad sub-trainers, naming them") {
  torch::nn::Linear layer(1, 1);
  torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
  xpm::PredictiveBatcherOptions options = batcher_options("a*bs", {"a"}, {{1, 1}}, 100);
  options.formula = xpm::CostFormula("a*bs", {"a"}, {"bs"});
  options.probe_points = {{{{"bs", 1}}}};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::UniformPacker>());
  const auto next = [] { return xpm::OuterBatch{}; };
  using Subs = std::vector<xpm::SubTrainer>;
  CHECK_THROWS_AS(xpm::MultipleTrainer(optimizer, nullptr, Subs{}), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::MultipleTrainer(optimizer, nullptr, Subs{{"a", 0.0, &batcher, nullptr, next}}),
                       doctest::Contains("'a'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::MultipleTrainer(optimizer, nullptr,
                                            Subs{{"a", 1.0, &batcher, nullptr, next},
                                                 {"a", 1.0, &batcher, nullptr, next}}),
                       doctest::Contains("appears twice"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::MultipleTrainer(optimizer, nullptr, Subs{{"b", 1.0, nullptr, nullptr, next}}),
                       doctest::Contains("'b' has no batcher"), std::invalid_argument);
  xpm::MultipleTrainer no_model(optimizer, nullptr, Subs{{"c", 1.0, &batcher, nullptr, next}});
  CHECK_THROWS_WITH_AS(no_model.probe_and_fit(), doctest::Contains("'c'"), std::invalid_argument);
  CHECK_THROWS_AS(no_model.train_step(), std::logic_error);
}
