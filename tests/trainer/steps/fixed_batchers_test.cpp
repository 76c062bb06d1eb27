// FixedBatcher and PowerAdaptativeBatcher (fixed_batchers.hpp): fixed slices in sampler order,
// exact gradients against one big batch, the `outer_batch_size // n` shrink sequence
// (16, 8, 5, 4, 3, 2, 1, then the size-1 error rethrown), the size kept across steps, one size
// per attempt (no split of a split), the refusal of world_size > 1, and on a real model under
// the CPU memory cap: an out-of-memory error in backward, a retry that starts from the
// pre-step allocated bytes (gradients allocated or not), and the gradient without a cap.
#include "torch_doctest.hpp"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/steps/fixed_batchers.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/tasks/transformer_tagger.hpp"
#include "trainer/steps/gradient_snapshot.hpp"

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

std::vector<double> token_units(const std::vector<xpm::EncodedSentence>& sentences) {
  std::vector<double> units;
  for (const auto& s : sentences) units.push_back(static_cast<double>(s.token_ids.size()));
  return units;
}

[[noreturn]] void throw_out_of_memory(std::size_t records = 0) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "test: out of memory at ", records, " records");
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
      if (static_cast<std::int64_t>(ids.size()) > limit) throw_out_of_memory(ids.size());
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
  // The first microbatch created the gradient; the failed attempt's cleanup freed it again.
  CHECK_FALSE(layer->weight.grad().defined());
  CHECK(torch::equal(layer->weight.detach(), weight_before));
  // With a gradient allocated before the step, it is kept and zeroed.
  layer->weight.mutable_grad() = torch::ones_like(layer->weight);
  calls = 0;
  CHECK(batcher.train_step({1, 1, 1, 1, 1}, loss).step.oom);
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

TEST_CASE("the power batcher tries 16, 8, 5, 4, 3, 2 and 1 records, then rethrows the size-1 out-of-memory error with the state clean") {
  FakeTask task(0);
  torch::optim::SGD optimizer(task.layer->parameters(), torch::optim::SGDOptions(0.1));
  const torch::Tensor weight_before = task.layer->weight.detach().clone();
  xpm::PowerAdaptativeBatcherOptions options;
  options.outer_batch_size = 16;
  xpm::PowerAdaptativeBatcher batcher(optimizer, nullptr, options, 1);
  int optimizer_steps_announced = 0;
  std::string message;
  try {
    batcher.train_step(std::vector<double>(16, 1.0), task.loss(), [&] { ++optimizer_steps_announced; });
    FAIL("no error after 1-record microbatches ran out of memory");
  } catch (const c10::OutOfMemoryError& error) {
    message = error.what_without_backtrace();
  }
  CHECK(message.find("out of memory at 1 records") != std::string::npos);  // the size-1 error
  CHECK(task.sizes == std::vector<std::size_t>{16, 8, 5, 4, 3, 2, 1});
  CHECK(batcher.ooms() == 7);
  CHECK(batcher.failed_steps() == 1);
  CHECK(batcher.microbatch_size() == 1);
  CHECK(batcher.next_microbatch_size() == 0);
  CHECK(optimizer_steps_announced == 0);
  CHECK(torch::equal(task.layer->weight.detach(), weight_before));
  CHECK_FALSE(task.layer->weight.grad().defined());  // created by no attempt

  // Whatever the sizes, each attempt cuts the whole outer batch at one size from record 0.
  FakeTask fits_five(5);
  xpm::PowerAdaptativeBatcher again(optimizer, nullptr, options, 1);
  std::vector<std::vector<std::size_t>> calls;
  const xpm::MicrobatchLossFn inner = fits_five.loss();
  again.train_step(std::vector<double>(16, 1.0), [&](const std::vector<std::size_t>& ids) {
    calls.push_back(ids);
    return inner(ids);
  });
  REQUIRE(calls.size() == 2 + 4);  // 16 and 8 fail at their first microbatch; 5 + 5 + 5 + 1
  CHECK(calls[2] == std::vector<std::size_t>{0, 1, 2, 3, 4});
  CHECK(calls[5] == std::vector<std::size_t>{15});
}

TEST_CASE("the power batcher refuses world_size > 1 and says why, naming the PyTorch bug 50820") {
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

TEST_CASE("the power batcher on a real model under a CPU cap runs out of memory in backward, retries from the pre-step allocated bytes and gets the no-cap gradient") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const auto sentences = random_sentences(32, 20, 40);
  xpm::TransformerTagger model = small_tagger();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.0));  // lr 0: same
  const std::vector<double> units = token_units(sentences);                          // params
  // Every call records its size, the allocated bytes when it starts and whether its forward
  // completed (then an out-of-memory error of that attempt came from its backward).
  struct Call {
    std::size_t records;
    std::int64_t start_bytes;
    bool forward_done;
  };
  std::vector<Call> calls;
  const auto loss_sum = [&](const std::vector<std::size_t>& ids) {
    calls.push_back({ids.size(), meter.current_allocated_bytes(), false});
    const xpm::TaggingBatch batch = xpm::collate(sentences, ids);
    torch::Tensor loss = xpm::token_cross_entropy_sum(model->forward(batch.token_ids, batch.padding_mask),
                                                      batch.tag_ids);
    calls.back().forward_done = true;
    return loss;
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
  meter.reset_peak();
  { const torch::Tensor forward_only = loss_sum(std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}); }
  const std::int64_t forward_peak_whole = meter.peak_allocated_bytes();
  INFO("peak whole batch ", peak_whole, " bytes (forward ", forward_peak_whole, "), halves ", peak_half, " bytes");
  const std::int64_t floor = std::max(peak_half, forward_peak_whole);
  REQUIRE(floor < peak_whole);

  // A cap above the whole batch's forward and the halves' step: the whole batch runs out of
  // memory in its backward, halves fit.
  const std::int64_t cap = floor + (peak_whole - floor) / 4;
  xpm::ScopedMemoryCap scoped_cap(cap);
  const std::int64_t refused_before = meter.oom_count();
  const xpm::BatcherStepResult skipped = whole.train_step(units, loss_sum);  // fixed: no fallback
  CHECK(skipped.step.oom);
  CHECK(skipped.ooms == 1);
  CHECK(skipped.max_bytes_above_baseline_after_oom == 0);

  xpm::PowerAdaptativeBatcherOptions options;
  options.outer_batch_size = 32;
  xpm::PowerAdaptativeBatcher power(optimizer, &meter, options, 1);
  const std::int64_t baseline_bytes = meter.current_allocated_bytes();  // gradients allocated
  calls.clear();
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
  REQUIRE(calls.size() == 3);  // 32 (fails), 16, 16
  CHECK(calls[0].records == 32);
  CHECK(calls[0].forward_done);  // so the error came from the backward
  CHECK(calls[0].start_bytes == baseline_bytes);
  CHECK(calls[1].records == 16);
  CHECK(calls[1].start_bytes == baseline_bytes);  // the retry starts where the step started
  CHECK(result.max_bytes_above_baseline_after_oom == 0);

  // First step of a run: no gradient allocated yet. The failed attempt's gradients are freed.
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  xpm::PowerAdaptativeBatcher fresh(optimizer, &meter, options, 1);
  const std::int64_t no_gradient_bytes = meter.current_allocated_bytes();
  calls.clear();
  const xpm::BatcherStepResult first = fresh.train_step(units, loss_sum);
  CHECK_FALSE(first.step.oom);
  REQUIRE(calls.size() >= 2);
  CHECK(calls[0].forward_done);
  std::size_t retry = 1;
  while (retry < calls.size() && calls[retry].records == 32) ++retry;
  REQUIRE(retry < calls.size());
  CHECK(calls[retry].start_bytes == no_gradient_bytes);
  CHECK(first.max_bytes_above_baseline_after_oom == 0);
  CHECK(max_relative_difference(gradients(*model), expected) < 1e-9);
}
