// Activation checkpointing of the Transformer tagger's encoder layers: the same loss and
// gradients as an ordinary backward with dropout on (the recompute replays forward's dropout
// masks), the RNG left where an ordinary step leaves it, and a lower peak on a real batch.
#include "torch_doctest.hpp"

#include <string>
#include <vector>

#include <ATen/autocast_mode.h>

#include "trainer/distributed/sharding_fixture.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/options/activation_checkpoint.hpp"
#include "xpm/trainer/options/precision.hpp"

namespace {

namespace fx = sharding_fixture;

struct StepOutcome {
  double loss = 0;
  std::vector<torch::Tensor> gradients;
  std::int64_t peak_above_start_bytes = 0;  // forward + backward, above the bytes live before it
  torch::Tensor next_random;                // the RNG's next draw after the step
};

// One forward/backward of a real batch (the first 32 sentences) with dropout seeded identically.
StepOutcome run_step(xpm::TransformerTagger& model, const fx::Corpus& corpus, std::uint64_t seed) {
  std::vector<std::size_t> ids;
  for (std::size_t i = 0; i < 32; ++i) ids.push_back(i);
  const xpm::TaggingBatch batch = xpm::collate(corpus.sentences, ids);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  StepOutcome outcome;
  torch::manual_seed(seed);
  const std::int64_t start = meter.current_allocated_bytes();
  meter.reset_peak();
  {
    const torch::Tensor loss =
        xpm::token_cross_entropy_sum(model->forward(batch.token_ids, batch.padding_mask), batch.tag_ids) /
        static_cast<double>(batch.real_tokens);
    loss.backward();
    outcome.loss = loss.item<double>();
  }
  outcome.peak_above_start_bytes = meter.peak_allocated_bytes() - start;
  for (const auto& p : model->parameters()) outcome.gradients.push_back(p.grad().clone());
  outcome.next_random = torch::rand({4});
  return outcome;
}

xpm::TransformerTaggerOptions default_options(const fx::Corpus& corpus, bool checkpointing) {
  xpm::TransformerTaggerOptions options;  // the job's defaults: d_model 128, 2 layers, dropout 0.1
  options.vocab_size = corpus.vocab_size;
  options.num_tags = corpus.num_tags;
  options.activation_checkpointing = checkpointing;
  return options;
}

// Two models with the same weights, checkpointing off and on.
std::pair<xpm::TransformerTagger, xpm::TransformerTagger> twin_models(const fx::Corpus& corpus,
                                                                     const xpm::TransformerTaggerOptions& base) {
  auto plain_options = base;
  plain_options.activation_checkpointing = false;
  auto checkpointed_options = base;
  checkpointed_options.activation_checkpointing = true;
  torch::manual_seed(3);
  xpm::TransformerTagger plain(plain_options);
  xpm::TransformerTagger checkpointed(checkpointed_options);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < plain->parameters().size(); ++i) {
    checkpointed->parameters()[i].copy_(plain->parameters()[i]);
  }
  (void)corpus;
  return {plain, checkpointed};
}

}  // namespace

TEST_CASE("checkpointed encoder layers give an ordinary backward's loss and gradients, dropout on") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  auto [plain, checkpointed] = twin_models(corpus, default_options(corpus, false));
  const StepOutcome expected = run_step(plain, corpus, 42);
  const StepOutcome actual = run_step(checkpointed, corpus, 42);
  CHECK(actual.loss == expected.loss);  // same forward, same dropout masks
  double worst = 0;
  for (std::size_t i = 0; i < expected.gradients.size(); ++i) {
    const double scale = std::max(1e-12, expected.gradients[i].abs().max().item<double>());
    worst = std::max(worst, (actual.gradients[i] - expected.gradients[i]).abs().max().item<double>() / scale);
  }
  MESSAGE("largest gradient difference, relative to each tensor's largest entry: " << worst);
  CHECK(worst <= 1e-6);
  // The step leaves the generator where an ordinary step does (recompute restores it).
  CHECK(torch::equal(actual.next_random, expected.next_random));
  // Dropout really was on: another seed changes the gradients.
  const StepOutcome other_seed = run_step(plain, corpus, 43);
  CHECK((other_seed.gradients[0] - expected.gradients[0]).abs().max().item<double>() > 1e-4);
}

TEST_CASE("checkpointed layers recompute under the autocast state of their forward (bf16-mixed)") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  auto [plain, checkpointed] = twin_models(corpus, default_options(corpus, false));
  const auto bf16_step = [&](xpm::TransformerTagger& model) {
    std::vector<std::size_t> ids = {0, 1, 2, 3, 4, 5, 6, 7};
    const xpm::TaggingBatch batch = xpm::collate(corpus.sentences, ids);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    torch::manual_seed(17);
    torch::Tensor logits;
    {
      xpm::AutocastGuard autocast(xpm::Precision::kBf16Mixed, torch::kCPU);
      logits = model->forward(batch.token_ids, batch.padding_mask);
    }
    // Backward runs outside the guard: the recompute must switch bf16 autocast back on itself.
    (xpm::token_cross_entropy_sum(logits.to(torch::kFloat32), batch.tag_ids) / static_cast<double>(batch.real_tokens))
        .backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto expected = bf16_step(plain);
  const auto actual = bf16_step(checkpointed);
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("parameter " << i);
    CHECK(torch::allclose(actual[i], expected[i], 1e-5, 1e-7));
  }
}

TEST_CASE("checkpointing lowers the measured peak of a forward/backward on a real batch") {
  torch::set_num_threads(1);
  const fx::Corpus corpus = fx::load_corpus();
  for (const std::int64_t layers : {2, 4}) {
    auto options = default_options(corpus, false);
    options.num_layers = layers;
    auto [plain, checkpointed] = twin_models(corpus, options);
    run_step(plain, corpus, 1);  // first calls allocate lazily created buffers; measure the second
    run_step(checkpointed, corpus, 1);
    const StepOutcome without = run_step(plain, corpus, 1);
    const StepOutcome with = run_step(checkpointed, corpus, 1);
    MESSAGE(layers << " layers, 32 real sentences: peak above the weights " << without.peak_above_start_bytes
                   << " bytes without checkpointing, " << with.peak_above_start_bytes << " with ("
                   << 100.0 * (1.0 - static_cast<double>(with.peak_above_start_bytes) /
                                          static_cast<double>(without.peak_above_start_bytes))
                   << " % lower)");
    CHECK(with.peak_above_start_bytes < without.peak_above_start_bytes);
  }
}

TEST_CASE("checkpointing changes nothing in evaluation or without grad mode") {
  const fx::Corpus corpus = fx::load_corpus();
  auto [plain, checkpointed] = twin_models(corpus, default_options(corpus, false));
  std::vector<std::size_t> ids = {0, 1, 2, 3};
  const xpm::TaggingBatch batch = xpm::collate(corpus.sentences, ids);
  plain->eval();
  checkpointed->eval();
  CHECK(torch::equal(plain->forward(batch.token_ids, batch.padding_mask),
                     checkpointed->forward(batch.token_ids, batch.padding_mask)));
  checkpointed->train();
  torch::NoGradGuard no_grad;
  torch::manual_seed(9);
  const torch::Tensor a = checkpointed->forward(batch.token_ids, batch.padding_mask);
  plain->train();
  torch::manual_seed(9);
  CHECK(torch::equal(a, plain->forward(batch.token_ids, batch.padding_mask)));
  CHECK_FALSE(a.requires_grad());
}

TEST_CASE("checkpoint() gives gradients to the input and listed parameters only") {
  torch::manual_seed(4);
  torch::Tensor w = torch::randn({3, 3}, torch::requires_grad());
  torch::Tensor x = torch::randn({2, 3}, torch::requires_grad());
  const auto f = [w](const torch::Tensor& in) { return torch::tanh(in.matmul(w)).pow(2); };
  f(x).sum().backward();
  const torch::Tensor expected_w = w.grad().clone();
  const torch::Tensor expected_x = x.grad().clone();
  w.mutable_grad() = torch::Tensor();
  x.mutable_grad() = torch::Tensor();
  xpm::checkpoint(f, x, {w}).sum().backward();
  CHECK(torch::allclose(w.grad(), expected_w, 1e-6, 1e-7));
  CHECK(torch::allclose(x.grad(), expected_x, 1e-6, 1e-7));
  // w not listed: no gradient reaches it (documented contract).
  w.mutable_grad() = torch::Tensor();
  xpm::checkpoint(f, x, {}).sum().backward();
  CHECK_FALSE(w.grad().defined());
}
