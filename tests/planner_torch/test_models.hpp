// test_models.hpp — small LibTorch models written for the planner's tests, not bundled with
// xpm: architectures, optimizers and memory behaviour the bundled taggers do not have, to check
// that probing and fitting hold on models the planner has never seen.
//
//   auto model = make_test_model(TestModelKind::kConvClassifier);
//   TorchProbeExecutor executor(model->probe_steps(), CpuMemoryMeter::install());
//   ProbeResult r = executor.run_probe({8, 64});   // dims {bs, l} ({bs, hw} for kImageCnn)
//
// Every model builds a synthetic batch of the given dims (random token ids, labels and pixels
// from LibTorch's generator), computes a summed loss, runs backward and an optimizer step at
// learning rate 0 (parameters unchanged), and is put in the steady state at construction (one
// step run, so gradients and optimizer state are allocated before any probe).
//  - kTransformerTagger: torch::nn::TransformerEncoder (post-norm, 2 layers, d 64, 4 heads,
//    ff 128), token tagging, Adam.
//  - kGruTagger: bidirectional GRU (hidden 64), token tagging, SGD with momentum.
//  - kConvClassifier: two Conv1d over embeddings, max over time, 10 classes, RMSprop; on x86
//    its convolutions run through oneDNN, which allocates through Allocator::raw_allocate.
//  - kPreNormTransformer: a hand-written pre-norm Transformer (explicit softmax attention,
//    GELU feed-forward, 2 layers, d 64, 4 heads), next-token loss, AdamW; the step is written
//    as user code often is: the logits and the loss stay alive during optimizer.step(), so the
//    optimizer-step peak grows with the shape (a moving floor).
//  - kImageCnn: a three-stage Conv2d image classifier over hw x hw RGB images, Adagrad (dims
//    {bs, hw}: activations grow with bs*hw^2).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "xpm/planner_torch/probe_runner.hpp"

namespace xpm::test {

enum class TestModelKind {
  kTransformerTagger,
  kGruTagger,
  kConvClassifier,
  kPreNormTransformer,
  kImageCnn,
};

class TestModel {
 public:
  virtual ~TestModel() = default;
  /// Steps for TorchProbeExecutor: forward_backward(dims), optimizer_step, zero_grad.
  virtual TorchProbeSteps probe_steps() = 0;
  /// e.g. "transformer tagger (Adam)".
  virtual std::string name() const = 0;
  /// The formula's variable names: {"bs", "l"} or {"bs", "hw"}.
  virtual std::vector<std::string> variable_names() const = 0;
};

/// Builds the model (seeded: the same weights every time) in the steady state.
std::unique_ptr<TestModel> make_test_model(TestModelKind kind);

std::vector<TestModelKind> all_test_model_kinds();

}  // namespace xpm::test
