// FixedBatcher and PowerAdaptativeBatcher (fixed_batchers.hpp): fixed slices in sampler order,
// exact gradients against one big batch, the reference's `batch_size // n` shrink sequence, the
// size kept across steps, a step skipped when nothing fits, the refusal of world_size > 1, and
// on a real model under the CPU memory cap: an out-of-memory error, a shrink and a completed
// step whose gradient is the one without a cap.
#include "../torch_doctest.hpp"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/fixed_batchers.hpp"
#include "xpm/trainer/tagging_batch.hpp"
#include "xpm/trainer/transformer_tagger.hpp"

namespace {

std::vector<xpm::EncodedSentence> random_sentences(std::size_t n, std::int64_t min_length,
                                                   std::int64_t max_length) {
  std::vector<xpm::EncodedSentence> sentences;
  torch::manual_seed(7);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t length = torch::randint(min_length, max_length + 1, {1}).item<std::int64_t>();
    xpm::EncodedSentence s;
    for (std::int64_t t = 0; t < length; ++t) {
      s.token_ids.push_back(torch::randint(2, 50, {1}).item<std::int64_t>());
      s.tag_ids.push_back(torch::randint(0, 7, {1}).item<std::int64_t>());
    }
    sentences.push_back(s);
  }
  return sentences;
}

// A small Transformer tagger in float64 (sums in a different order agree to ~1e-15), no dropout.
xpm::TransformerTagger small_tagger() {
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
  return model;
}

std::vector<torch::Tensor> gradients(const torch::nn::Module& model) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : model.parameters()) grads.push_back(p.grad().detach().clone());
  return grads;
}

double max_relative_difference(const std::vector<torch::Tensor>& actual,
                               const std::vector<torch::Tensor>& expected) {
  double worst = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double scale = expected[i].abs().max().item<double>() + 1e-30;
    worst = std::max(worst, (actual[i] - expected[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

std::vector<double> token_units(const std::vector<xpm::EncodedSentence>& sentences) {
  std::vector<double> units;
  for (const auto& s : sentences) units.push_back(static_cast<double>(s.token_ids.size()));
  return units;
}

[[noreturn]] void throw_out_of_memory() {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "test: out of memory");
  throw std::logic_error("unreachable");
}

// A one-parameter model whose loss function runs out of memory for microbatches larger than
// `limit` records, and remembers the size of each microbatch it was asked for.
struct FakeTask {
  explicit FakeTask(std::int64_t limit_records) : limit(limit_records) {}
  std::int64_t limit;
  torch::nn::Linear layer{1, 1};
  std::vector<std::size_t> sizes;
  xpm::MicrobatchLossFn loss() {
    return [this](const std::vector<std::size_t>& ids) {
      sizes.push_back(ids.size());
      if (static_cast<std::int64_t>(ids.size()) > limit) throw_out_of_memory();
      return layer(torch::ones({static_cast<std::int64_t>(ids.size()), 1})).sum();
    };
  }
};

}  // namespace

TEST_CASE("fixed_size_plan cuts the records in order into slices of the microbatch size") {
  const xpm::MicrobatchPlan plan = xpm::fixed_size_plan(7, 3);
  REQUIRE(plan.microbatches.size() == 3);
  CHECK(plan.microbatches[0].record_indices == std::vector<std::size_t>{0, 1, 2});
  CHECK(plan.microbatches[1].record_indices == std::vector<std::size_t>{3, 4, 5});
  CHECK(plan.microbatches[2].record_indices == std::vector<std::size_t>{6});
  CHECK(plan.microbatches[2].dims == std::vector<double>{1.0});
  CHECK_FALSE(plan.microbatches[0].over_budget);
  CHECK(xpm::fixed_size_plan(0, 3).microbatches.empty());
  CHECK(xpm::fixed_size_plan(2, 5).microbatches.size() == 1);
  CHECK_THROWS_AS(xpm::fixed_size_plan(4, 0), std::invalid_argument);
}

TEST_CASE("the fixed batcher's gradient over slices of 5 records equals one big batch's gradient") {
  const auto sentences = random_sentences(23, 1, 19);
  xpm::TransformerTagger model = small_tagger();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.0));
  std::vector<std::size_t> all(sentences.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
  const auto loss_sum = [&](const std::vector<std::size_t>& ids) {
    const xpm::TaggingBatch batch = xpm::collate(sentences, ids);
    return xpm::token_cross_entropy_sum(model->forward(batch.token_ids, batch.padding_mask),
                                        batch.tag_ids);
  };
  optimizer.zero_grad();
  const xpm::TaggingBatch whole = xpm::collate(sentences, all);
  (loss_sum(all) / static_cast<double>(whole.real_tokens)).backward();
  const auto expected = gradients(*model);

  xpm::FixedBatcher batcher(optimizer, nullptr, 5);
  const xpm::BatcherStepResult result = batcher.train_step(token_units(sentences), loss_sum);
  CHECK_FALSE(result.step.oom);
  CHECK(result.ooms == 0);
  CHECK(result.attempts == 1);
  CHECK(result.microbatch_size == 5);
  CHECK(result.step.microbatches == 5);  // 5 + 5 + 5 + 5 + 3
  CHECK(result.step.units == doctest::Approx(static_cast<double>(whole.real_tokens)));
  CHECK(max_relative_difference(gradients(*model), expected) < 1e-9);
  CHECK_THROWS_AS(xpm::FixedBatcher(optimizer, nullptr, 0), std::invalid_argument);
}

TEST_CASE("the fixed batcher skips a step that runs out of memory and counts it, parameters unchanged") {
  // The second microbatch runs out of memory after the first one's backward left gradients.
  torch::nn::Linear layer(1, 1);
  torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
  const torch::Tensor weight_before = layer->weight.detach().clone();
  std::int64_t calls = 0;
  const xpm::MicrobatchLossFn loss = [&](const std::vector<std::size_t>& ids) {
    if (++calls == 2) throw_out_of_memory();
    return layer(torch::ones({static_cast<std::int64_t>(ids.size()), 1})).sum();
  };
  xpm::FixedBatcher batcher(optimizer, nullptr, 3);
  const xpm::BatcherStepResult result = batcher.train_step({1, 1, 1, 1, 1}, loss);
  CHECK(calls == 2);
  CHECK(result.step.oom);
  CHECK(result.step.oom_ranks == std::vector<int>{0});
  CHECK(result.step.microbatches == 0);
  CHECK(result.ooms == 1);
  CHECK(batcher.ooms() == 1);
  CHECK(batcher.microbatch_size() == 3);  // no fallback
  REQUIRE(layer->weight.grad().defined());
  CHECK(layer->weight.grad().abs().sum().item<double>() == 0.0);
  CHECK(torch::equal(layer->weight.detach(), weight_before));
}

TEST_CASE("the power batcher shrinks to outer_batch_size // n for n = 2, 3, ... and keeps the size") {
  FakeTask task(7);
  torch::optim::SGD optimizer(task.layer->parameters(), torch::optim::SGDOptions(0.1));
  xpm::PowerAdaptativeBatcherOptions options;
  options.outer_batch_size = 64;
  xpm::PowerAdaptativeBatcher batcher(optimizer, nullptr, options, 1);
  CHECK(batcher.microbatch_size() == 64);
  CHECK(batcher.next_microbatch_size() == 32);
  const std::vector<double> units(64, 1.0);
  const xpm::BatcherStepResult first = batcher.train_step(units, task.loss());
  // Every failed try stopped at its first microbatch: 64 // n for n = 1, 2, 3, 4, 5, 6, 7, 8, 9.
  const std::vector<std::size_t> tried(task.sizes.begin(), task.sizes.begin() + 9);
  CHECK(tried == std::vector<std::size_t>{64, 32, 21, 16, 12, 10, 9, 8, 7});
  CHECK_FALSE(first.step.oom);
  CHECK(first.ooms == 8);
  CHECK(first.attempts == 9);
  CHECK(first.microbatch_size == 7);
  CHECK(first.step.microbatches == 10);  // 9 x 7 + 1
  CHECK(first.step.units == doctest::Approx(64.0));
  CHECK(batcher.divisor() == 9);
  CHECK(batcher.retried_steps() == 1);
  CHECK(batcher.ooms() == 8);

  task.sizes.clear();
  const xpm::BatcherStepResult second = batcher.train_step(units, task.loss());
  CHECK(second.ooms == 0);
  CHECK(second.attempts == 1);
  CHECK(task.sizes.front() == 7);  // the size reached is kept
  CHECK(batcher.retried_steps() == 1);
}

TEST_CASE("the power batcher starts from the given microbatch size and shrinks by the same rule") {
  FakeTask task(8);
  torch::optim::SGD optimizer(task.layer->parameters(), torch::optim::SGDOptions(0.1));
  xpm::PowerAdaptativeBatcherOptions options;
  options.outer_batch_size = 64;
  options.initial_microbatch_size = 10;
  xpm::PowerAdaptativeBatcher batcher(optimizer, nullptr, options, 1);
  const xpm::BatcherStepResult result = batcher.train_step(std::vector<double>(64, 1.0), task.loss());
  CHECK(task.sizes[0] == 10);
  CHECK(task.sizes[1] == 9);  // 64 // 7
  CHECK(task.sizes[2] == 8);  // 64 // 8
  CHECK(result.ooms == 2);
  CHECK(result.microbatch_size == 8);
  CHECK(batcher.divisor() == 8);
}

TEST_CASE("the power batcher skips the step when one record per microbatch still runs out of memory") {
  FakeTask task(0);
  torch::optim::SGD optimizer(task.layer->parameters(), torch::optim::SGDOptions(0.1));
  const torch::Tensor weight_before = task.layer->weight.detach().clone();
  xpm::PowerAdaptativeBatcherOptions options;
  options.outer_batch_size = 3;
  xpm::PowerAdaptativeBatcher batcher(optimizer, nullptr, options, 1);
  const xpm::BatcherStepResult result = batcher.train_step({1, 1, 1}, task.loss());
  CHECK(task.sizes == std::vector<std::size_t>{3, 1});  // 3 // 1, 3 // 2; 3 // 4 would be 0
  CHECK(result.step.oom);
  CHECK(result.ooms == 2);
  CHECK(batcher.skipped_steps() == 1);
  CHECK(batcher.retried_steps() == 1);
  CHECK(batcher.microbatch_size() == 1);
  CHECK(batcher.next_microbatch_size() == 0);
  CHECK(torch::equal(task.layer->weight.detach(), weight_before));
}

TEST_CASE("the power batcher refuses world_size > 1 and says why, naming pytorch issue 50820") {
  torch::nn::Linear layer(1, 1);
  torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
  xpm::PowerAdaptativeBatcherOptions options;
  options.outer_batch_size = 8;
  CHECK_NOTHROW(xpm::PowerAdaptativeBatcher::check_single_process(1));
  try {
    xpm::PowerAdaptativeBatcher batcher(optimizer, nullptr, options, 2);
    FAIL("world_size 2 was accepted");
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    CHECK(message.find("world_size 2") != std::string::npos);
    CHECK(message.find("desynchronize") != std::string::npos);
    CHECK(message.find("https://github.com/pytorch/pytorch/issues/50820") != std::string::npos);
    CHECK(message.find("predictive") != std::string::npos);
  }
  options.initial_microbatch_size = 9;
  CHECK_THROWS_AS(xpm::PowerAdaptativeBatcher(optimizer, nullptr, options, 1), std::invalid_argument);
  options.initial_microbatch_size = 0;
  options.outer_batch_size = 0;
  CHECK_THROWS_AS(xpm::PowerAdaptativeBatcher(optimizer, nullptr, options, 1), std::invalid_argument);
}

TEST_CASE("the power batcher on a real model under a CPU cap shrinks after an OOM and gets the no-cap gradient") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const auto sentences = random_sentences(32, 20, 40);
  xpm::TransformerTagger model = small_tagger();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.0));  // lr 0: same
  const std::vector<double> units = token_units(sentences);                          // params
  const auto loss_sum = [&](const std::vector<std::size_t>& ids) {
    const xpm::TaggingBatch batch = xpm::collate(sentences, ids);
    return xpm::token_cross_entropy_sum(model->forward(batch.token_ids, batch.padding_mask),
                                        batch.tag_ids);
  };
  // Without a cap: warm up (gradients allocated), then the whole batch and halves.
  xpm::FixedBatcher whole(optimizer, &meter, 32), halves(optimizer, &meter, 16);
  whole.train_step(units, loss_sum);
  const xpm::BatcherStepResult reference = whole.train_step(units, loss_sum);
  REQUIRE_FALSE(reference.step.oom);
  const auto expected = gradients(*model);
  const xpm::BatcherStepResult half = halves.train_step(units, loss_sum);
  REQUIRE_FALSE(half.step.oom);
  CHECK(max_relative_difference(gradients(*model), expected) < 1e-9);
  const std::int64_t peak_whole = reference.step.peak_allocated_bytes;
  const std::int64_t peak_half = half.step.peak_allocated_bytes;
  INFO("peak whole batch ", peak_whole, " bytes, halves ", peak_half, " bytes");
  REQUIRE(peak_half < peak_whole - (peak_whole - meter.current_allocated_bytes()) / 4);

  // A cap between the two: the whole batch runs out of memory, halves fit.
  const std::int64_t cap = (peak_whole + peak_half) / 2;
  xpm::ScopedMemoryCap scoped_cap(cap);
  const std::int64_t refused_before = meter.oom_count();
  const xpm::BatcherStepResult skipped = whole.train_step(units, loss_sum);  // fixed: no fallback
  CHECK(skipped.step.oom);
  CHECK(skipped.ooms == 1);

  xpm::PowerAdaptativeBatcherOptions options;
  options.outer_batch_size = 32;
  xpm::PowerAdaptativeBatcher power(optimizer, &meter, options, 1);
  const xpm::BatcherStepResult result = power.train_step(units, loss_sum);
  CHECK_FALSE(result.step.oom);
  CHECK(result.ooms == 1);
  CHECK(result.attempts == 2);
  CHECK(result.microbatch_size == 16);
  CHECK(result.step.microbatches == 2);
  CHECK(power.retried_steps() == 1);
  CHECK(meter.oom_count() - refused_before == 2);  // the fixed step's and the power batcher's
  CHECK(result.step.peak_allocated_bytes <= cap);
  CHECK(result.step.peak_allocated_bytes > 0);
  CHECK(max_relative_difference(gradients(*model), expected) < 1e-9);
}
