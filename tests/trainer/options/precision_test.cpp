// Precision settings: names and refusals, the autocast guard, dynamic loss scaling with injected
// infinities, and bf16-mixed on the real model and corpus: logits close to float32, training
// that converges.
#include "torch_doctest.hpp"

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>

#include "trainer/distributed/sharding_fixture.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/tasks/tagging_task.hpp"
#include "xpm/trainer/options/weight_decay_groups.hpp"

namespace {

namespace fx = sharding_fixture;

// The convergence run's length and the accuracy it must reach (see its MESSAGE for the numbers).
constexpr std::int64_t kBf16TrainingSteps = 30;
constexpr double kBf16AccuracyFloor = 0.45;

}  // namespace

namespace {

// The job's default Transformer (seed 5) for the corpus's vocabulary and tags.
xpm::TransformerTagger default_transformer(const fx::Corpus& corpus) {
  xpm::TransformerTaggerOptions options;  // the job's defaults
  options.vocab_size = corpus.vocab_size;
  options.num_tags = corpus.num_tags;
  torch::manual_seed(5);
  return xpm::TransformerTagger(options);
}

// The corpus's first `count` sentences as one padded batch.
xpm::TaggingBatch first_sentences(const fx::Corpus& corpus, std::size_t count) {
  std::vector<std::size_t> ids;
  for (std::size_t i = 0; i < count; ++i) ids.push_back(i);
  return xpm::collate(corpus.sentences, ids);
}

}  // namespace

TEST_CASE("precision settings parse by name and 16-mixed is refused on CPU naming the value") {
  for (const std::string name : {"32-true", "bf16-mixed", "16-mixed"}) {
    CHECK(xpm::to_string(xpm::parse_precision(name, "--precision")) == name);
  }
  CHECK_THROWS_WITH_AS(xpm::parse_precision("bf16", "--precision"),
                       doctest::Contains("--precision must be '32-true', 'bf16-mixed' or '16-mixed', got 'bf16'"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::check_precision_supported(xpm::Precision::k16Mixed, torch::Device(torch::kCPU)),
                       doctest::Contains("precision '16-mixed' needs a CUDA device"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::check_precision_supported(xpm::Precision::k16Mixed, torch::Device(torch::kCPU)),
                       doctest::Contains("this run is on 'cpu'"), std::invalid_argument);
  CHECK_NOTHROW(xpm::check_precision_supported(xpm::Precision::kBf16Mixed, torch::Device(torch::kCPU)));
  CHECK_NOTHROW(xpm::check_precision_supported(xpm::Precision::k16Mixed, torch::Device(torch::kCUDA, 0)));
  CHECK_THROWS_AS(xpm::AutocastGuard(xpm::Precision::k16Mixed, torch::kCPU), std::invalid_argument);
}

TEST_CASE("the bf16-mixed guard runs matmuls in bfloat16 inside and restores autocast after") {
  const torch::Tensor a = torch::randn({4, 8});
  const torch::Tensor b = torch::randn({8, 3});
  REQUIRE_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  {
    xpm::AutocastGuard outer(xpm::Precision::kBf16Mixed, torch::kCPU);
    CHECK(at::autocast::is_autocast_enabled(at::kCPU));
    CHECK((torch::mm(a, b).scalar_type() == torch::kBFloat16));
    {
      xpm::AutocastGuard fp32(xpm::Precision::k32True, torch::kCPU);  // does nothing
      CHECK((torch::mm(a, b).scalar_type() == torch::kBFloat16));
    }
    CHECK(at::autocast::is_autocast_enabled(at::kCPU));
  }
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  CHECK((torch::mm(a, b).scalar_type() == torch::kFloat32));
}

TEST_CASE("the loss scaler skips overflowing steps, backs off, and grows after clean steps") {
  xpm::DynamicLossScalerOptions options;
  options.initial_scale = 8;
  options.growth_interval = 2;
  xpm::DynamicLossScaler scaler(options);
  xpm::DistributedContext single_process;
  CHECK(scaler.scale(torch::tensor(1.5)).item<double>() == 12.0);
  // Clean step: gradients divided by the scale exactly (a power of two).
  torch::Tensor g = torch::tensor({16.0f, -4.0f});
  CHECK_FALSE(scaler.unscale_({g, torch::Tensor()}, single_process));
  CHECK(torch::equal(g, torch::tensor({2.0f, -0.5f})));
  scaler.update();
  CHECK(scaler.current_scale() == 8);
  CHECK(scaler.clean_steps_in_a_row() == 1);
  // Second clean step: the scale doubles.
  CHECK_FALSE(scaler.unscale_({torch::ones({3})}, single_process));
  scaler.update();
  CHECK(scaler.current_scale() == 16);
  CHECK(scaler.clean_steps_in_a_row() == 0);
  // Injected infinity, then nan: each step is skipped and halves the scale.
  CHECK(scaler.unscale_({torch::ones({2}), torch::tensor({1.0f, std::numeric_limits<float>::infinity()})},
                        single_process));
  scaler.update();
  CHECK(scaler.unscale_({torch::tensor({std::numeric_limits<float>::quiet_NaN()})}, single_process));
  scaler.update();
  CHECK(scaler.current_scale() == 4);
  CHECK(scaler.skipped_steps() == 2);
  CHECK(scaler.state() == std::vector<double>{4, 0, 2});
  CHECK_THROWS_AS(scaler.update(), std::logic_error);  // no unscale_ since the last update
  CHECK_FALSE(scaler.unscale_({torch::ones({1})}, single_process));
  CHECK_THROWS_AS(scaler.unscale_({torch::ones({1})}, single_process), std::logic_error);
  xpm::DynamicLossScaler restored;
  restored.load_state({4, 1, 2});
  CHECK(restored.current_scale() == 4);
  CHECK(restored.skipped_steps() == 2);
  options.backoff_factor = 1.0;
  CHECK_THROWS_WITH_AS(options.validate(), doctest::Contains("backoff_factor must be in (0, 1), got 1"),
                       std::invalid_argument);
}

TEST_CASE("a loss scaler on a real model's gradients: an overflow skips the step and leaves the parameters") {
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger model = fx::make_model(corpus);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  xpm::DynamicLossScaler scaler;
  xpm::DistributedContext single_process;
  const xpm::TaggingBatch batch = xpm::collate(corpus.sentences, {0, 1, 2, 3});
  const auto loss_fn = [&] {
    return xpm::token_cross_entropy_sum(model->forward(batch.token_ids, batch.padding_mask), batch.tag_ids) /
           static_cast<double>(batch.real_tokens);
  };
  // Unscaled gradient, for comparison.
  loss_fn().backward();
  const torch::Tensor unscaled = model->parameters()[0].grad().clone();
  optimizer.zero_grad();
  scaler.scale(loss_fn()).backward();
  CHECK_FALSE(scaler.unscale_(model->parameters().size() > 0 ? std::vector<torch::Tensor>{model->parameters()[0].grad()}
                                                            : std::vector<torch::Tensor>{},
                              single_process));
  CHECK(torch::allclose(model->parameters()[0].grad(), unscaled, 1e-5, 1e-9));
  scaler.update();
  // Now an overflow in one gradient: the step is skipped, nothing moves.
  optimizer.zero_grad();
  scaler.scale(loss_fn()).backward();
  model->parameters()[3].grad()[0].fill_(std::numeric_limits<float>::infinity());
  const torch::Tensor before = model->parameters()[0].detach().clone();
  std::vector<torch::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad());
  if (!scaler.unscale_(grads, single_process)) optimizer.step();
  scaler.update();
  CHECK(torch::equal(model->parameters()[0].detach(), before));
  CHECK(scaler.skipped_steps() == 1);
  CHECK(scaler.current_scale() == 32768);
}

TEST_CASE("the tagger's own encoder layer forward computes what LibTorch's layer computes, dropout on") {
  torch::manual_seed(6);
  torch::nn::TransformerEncoderLayer layer(
      torch::nn::TransformerEncoderLayerOptions(32, 4).dim_feedforward(64).dropout(0.1));
  layer->train();
  const torch::Tensor src = torch::randn({7, 3, 32});
  torch::Tensor mask = torch::zeros({3, 7}, torch::kBool);
  mask.index_put_({1, torch::indexing::Slice(4, torch::indexing::None)}, true);  // row 1: 4 real tokens
  mask.index_put_({2, torch::indexing::Slice(1, torch::indexing::None)}, true);  // row 2: 1 real token
  for (const torch::Tensor& padding : {mask, torch::Tensor()}) {
    torch::manual_seed(8);
    const torch::Tensor expected = layer->forward(src, torch::Tensor(), padding);
    torch::manual_seed(8);
    const torch::Tensor actual = xpm::encoder_layer_forward(*layer, src, padding);
    CHECK(torch::allclose(actual, expected, 1e-6, 1e-6));
  }
  // Under bf16 autocast LibTorch's layer refuses a padding mask; ours runs it.
  xpm::AutocastGuard autocast(xpm::Precision::kBf16Mixed, torch::kCPU);
  CHECK_THROWS_WITH(layer->forward(src, torch::Tensor(), mask), doctest::Contains("not implemented for 'BFloat16'"));
  const torch::Tensor low = xpm::encoder_layer_forward(*layer, src, mask);
  CHECK(low.isfinite().all().item<bool>());
}

TEST_CASE("bf16-mixed logits of the real Transformer on real Brown batches are close to float32") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger model = default_transformer(corpus);
  model->eval();
  const xpm::TaggingBatch batch = first_sentences(corpus, 32);
  const torch::Tensor fp32 = model->forward(batch.token_ids, batch.padding_mask);
  torch::Tensor bf16;
  {
    xpm::AutocastGuard autocast(xpm::Precision::kBf16Mixed, torch::kCPU);
    bf16 = model->forward(batch.token_ids, batch.padding_mask);
  }
  CHECK((bf16.scalar_type() == torch::kBFloat16));
  const torch::Tensor real = batch.padding_mask.logical_not();
  const torch::Tensor a = fp32.index({real});
  const torch::Tensor b = bf16.to(torch::kFloat32).index({real});
  const double relative = (a - b).norm().item<double>() / a.norm().item<double>();
  const double agreement = (a.argmax(-1) == b.argmax(-1)).to(torch::kFloat64).mean().item<double>();
  MESSAGE("bf16-mixed vs float32 logits: relative error " << relative << ", same argmax on " << 100 * agreement
                                                          << " % of " << a.size(0) << " real tokens");
  CHECK(relative < 0.02);  // bfloat16 keeps 8 significant bits (relative rounding 2^-9 per op)
  CHECK(agreement > 0.95);
}

TEST_CASE("bf16-mixed changes the measured peak of a forward/backward on a real batch") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  xpm::TransformerTagger model = default_transformer(corpus);
  const xpm::TaggingBatch batch = first_sentences(corpus, 32);
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const auto peak_of = [&](xpm::Precision precision) {
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    const std::int64_t start = meter.current_allocated_bytes();
    meter.reset_peak();
    torch::Tensor logits;
    {
      xpm::AutocastGuard autocast(precision, torch::kCPU);
      logits = model->forward(batch.token_ids, batch.padding_mask);
    }
    (xpm::token_cross_entropy_sum(logits.to(torch::kFloat32), batch.tag_ids) / static_cast<double>(batch.real_tokens))
        .backward();
    return meter.peak_allocated_bytes() - start;
  };
  peak_of(xpm::Precision::k32True);  // lazily allocated buffers first
  peak_of(xpm::Precision::kBf16Mixed);
  const std::int64_t fp32 = peak_of(xpm::Precision::k32True);
  const std::int64_t bf16 = peak_of(xpm::Precision::kBf16Mixed);
  MESSAGE("forward/backward peak above the weights, 32 real sentences (" << batch.token_ids.size(1)
          << " tokens padded): 32-true " << fp32 << " bytes, bf16-mixed " << bf16 << " bytes");
  CHECK(bf16 != fp32);  // the planner must probe each precision: the peaks differ
}

TEST_CASE("bf16-mixed training on the Brown task converges above the most-frequent-tag baselines") {
  // The job's default model and data (every 10th file held out), bf16-mixed forward, float32
  // loss, master weights and AdamW; a short run, timed.
  torch::set_num_threads(2);
  const auto start = std::chrono::steady_clock::now();
  xpm::TaggingJobConfig config;
  config.data_dir = std::string(XPM_SOURCE_DIR) + "/data/brown";
  const xpm::TaggingData data = xpm::load_tagging_data(config);
  torch::manual_seed(1);
  xpm::TransformerTagger model(xpm::model_options_for(config, data));
  torch::optim::AdamW optimizer(xpm::adamw_param_groups(*model, torch::optim::AdamWOptions(3e-3).weight_decay(0.01)),
                                torch::optim::AdamWOptions(3e-3));
  const std::int64_t steps = kBf16TrainingSteps;
  const std::int64_t outer_batch = 20;
  const torch::Tensor order = torch::randperm(static_cast<std::int64_t>(data.train.size()));
  std::vector<double> losses;
  for (std::int64_t step = 0; step < steps; ++step) {
    std::vector<std::size_t> ids;
    for (std::int64_t i = 0; i < outer_batch; ++i) {
      ids.push_back(static_cast<std::size_t>(order[(step * outer_batch + i) % order.size(0)].item<std::int64_t>()));
    }
    const xpm::TaggingBatch batch = xpm::collate(data.train, ids);
    optimizer.zero_grad();
    torch::Tensor logits;
    {
      xpm::AutocastGuard autocast(xpm::Precision::kBf16Mixed, torch::kCPU);
      logits = model->forward(batch.token_ids, batch.padding_mask);
    }
    const torch::Tensor loss = xpm::token_cross_entropy_sum(logits.to(torch::kFloat32), batch.tag_ids) /
                               static_cast<double>(batch.real_tokens);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  // Validation: the first 1000 held-out sentences, bf16-mixed forward as in training.
  model->eval();
  torch::NoGradGuard no_grad;
  std::int64_t correct = 0, tokens = 0;
  std::map<std::int64_t, std::int64_t> train_tag_counts;
  for (const auto& s : data.train) {
    for (std::int64_t tag : s.tag_ids) ++train_tag_counts[tag];
  }
  std::int64_t majority_tag = 0;
  for (const auto& [tag, count] : train_tag_counts) {
    if (count > train_tag_counts[majority_tag]) majority_tag = tag;
  }
  std::int64_t majority_correct = 0;
  const std::size_t evaluated = std::min<std::size_t>(1000, data.validation.size());
  for (std::size_t first = 0; first < evaluated; first += 100) {
    std::vector<std::size_t> ids;
    for (std::size_t i = first; i < std::min(evaluated, first + 100); ++i) ids.push_back(i);
    const xpm::TaggingBatch batch = xpm::collate(data.validation, ids);
    torch::Tensor logits;
    {
      xpm::AutocastGuard autocast(xpm::Precision::kBf16Mixed, torch::kCPU);
      logits = model->forward(batch.token_ids, batch.padding_mask);
    }
    const torch::Tensor real = batch.padding_mask.logical_not();
    correct += logits.argmax(-1).eq(batch.tag_ids).logical_and(real).sum().item<std::int64_t>();
    majority_correct += batch.tag_ids.eq(majority_tag).logical_and(real).sum().item<std::int64_t>();
    tokens += batch.real_tokens;
  }
  const std::vector<xpm::TaggedSentence> evaluated_sentences(data.validation_sentences.begin(),
                                                             data.validation_sentences.begin() +
                                                                 static_cast<std::ptrdiff_t>(evaluated));
  const double accuracy = static_cast<double>(correct) / static_cast<double>(tokens);
  const double majority = static_cast<double>(majority_correct) / static_cast<double>(tokens);
  const double per_word = xpm::most_frequent_tag_accuracy(data.train_sentences, evaluated_sentences);
  const double first_loss = (losses[0] + losses[1] + losses[2]) / 3;
  const double last_loss = (losses[steps - 1] + losses[steps - 2] + losses[steps - 3]) / 3;
  std::ostringstream curve;
  for (std::int64_t step = 0; step < steps; step += std::max<std::int64_t>(1, steps / 10)) {
    curve << " " << step << ":" << std::setprecision(3) << losses[static_cast<std::size_t>(step)];
  }
  MESSAGE("bf16-mixed, " << steps << " steps of " << outer_batch << " sentences in "
                         << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                         << " s; loss" << curve.str() << ", last 3 mean " << last_loss << "; held-out token accuracy "
                         << accuracy << " on " << tokens << " tokens (most frequent tag overall " << majority
                         << ", most frequent tag per word " << per_word << ")");
  CHECK(last_loss < 0.4 * first_loss);
  CHECK(accuracy > majority);
  CHECK(accuracy > kBf16AccuracyFloor);
}
