// test_models.hpp — small LibTorch models written for the planner's tests, not bundled with
// xpm: architectures, optimizers and memory behaviour the bundled taggers do not have, to check
// that probing and fitting hold on models the planner has never seen.
//
//   auto model = make_test_model(TestModelKind::kConvClassifier);
//   TorchProbeExecutor executor(model->probe_steps(), CpuMemoryMeter::install());
//   ProbeResult r = executor.run_probe({8, 64});   // dims in variable_names() order
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
//  - kEncoderDecoder: torch::nn::Transformer (1 encoder and 1 decoder layer, d 64, 4 heads, ff
//    128, causal target mask), source and target of their own lengths, next-token loss over a
//    512-token target vocabulary, Adam (dims {bs, ls, lt}: self-attention grows with bs*ls^2
//    and bs*lt^2, cross-attention with bs*ls*lt).
//  - kVariableImageCnn: Conv2d + BatchNorm2d x3 over h x w RGB images (height and width
//    apart), SGD with Nesterov momentum and weight decay (dims {bs, h, w}).
//  - kCheckpointedCharLm: a character LM of 3 causal pre-norm blocks, each run through
//    xpm::checkpoint (activations recomputed in backward), label smoothing 0.1, gradients
//    clipped to norm 1 in the optimizer step, SGD with momentum (dims {bs, l}).
//  - kPackedLstm: an LSTM tagger over packed sequences (pack_padded_sequence), lengths spread
//    evenly from l down to about l/2 within the batch (the same lengths for the same dims),
//    Adam (dims {bs, l}); also a batch of given records (forward_backward_records: records
//    {1, l, ...}, each of its own length l, e.g. {bs, l, t} with t its real tokens). On the CPU a
//    batch whose lengths are all equal peaks far higher per token than one where any two
//    differ, so no formula in (bs, longest l, summed t) holds for both.
//  - kPackedTokenTagger: token embeddings of a padded batch, then only the real tokens, packed
//    ([t, 48], padding-free), through an MLP 48-384-48 to per-token tags, RMSprop (dims {bs, l,
//    t}: l the longest record, t the summed real tokens; records through
//    forward_backward_records, or equal records of length l from dims).
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
  kEncoderDecoder,
  kVariableImageCnn,
  kCheckpointedCharLm,
  kPackedLstm,
  kPackedTokenTagger,
};

class TestModel {
 public:
  virtual ~TestModel() = default;
  /// Steps for TorchProbeExecutor: forward_backward(dims), optimizer_step, zero_grad.
  virtual TorchProbeSteps probe_steps() = 0;
  /// e.g. "transformer tagger (Adam)".
  virtual std::string name() const = 0;
  /// The formula's variable names, bs first: {"bs", "l"}, {"bs", "hw"}, {"bs", "ls", "lt"} or
  /// {"bs", "h", "w"}.
  virtual std::vector<std::string> variable_names() const = 0;
};

/// Builds the model (seeded: the same weights every time) in the steady state.
std::unique_ptr<TestModel> make_test_model(TestModelKind kind);

std::vector<TestModelKind> all_test_model_kinds();

}  // namespace xpm::test
