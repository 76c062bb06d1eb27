// xpm/trainer/options/activation_checkpoint.hpp — activation checkpointing (Chen et al. 2016, "Training
// Deep Nets with Sublinear Memory Cost"; torch.utils.checkpoint, which LibTorch 1.13's C++ API
// lacks): run a block without keeping its intermediate activations, recompute them in backward.
//
//   auto layer = encoder->layers->ptr<torch::nn::TransformerEncoderLayerImpl>(i);
//   x = checkpoint([layer, mask](const torch::Tensor& in) { return layer->forward(in, {}, mask); },
//                  x, layer->parameters());
//
// Forward runs `function` under NoGradGuard, so only its input (and the RNG state) is kept;
// backward sets the RNG back to the state forward started from, reruns `function` with
// gradients on (and the autocast state forward had), and differentiates that graph with
// torch::autograd::grad, so the recomputed dropout masks are forward's and the gradients equal
// an ordinary backward's. Memory: the block's activations live only while its backward runs
// (one block at a time), at the price of a second forward of the block.
#pragma once

#include <functional>
#include <vector>

#include <torch/torch.h>

namespace xpm {

using CheckpointedFunction = std::function<torch::Tensor(const torch::Tensor&)>;

/// function(input), with its activations recomputed in backward instead of kept. `parameters`
/// must hold every tensor requiring grad that `function` reads besides `input` (typically the
/// block's parameters()); gradients reach nothing else. `function` must be a deterministic
/// function of its input, its parameters and the default generator of the input's device (CPU
/// or CUDA), and must not change state (e.g. running statistics) that a second call would
/// change again. Without grad mode (inference, NoGradGuard) it is just function(input).
/// Shapes and dtypes: whatever `function` takes and returns (one tensor each).
torch::Tensor checkpoint(CheckpointedFunction function, const torch::Tensor& input,
                         const std::vector<torch::Tensor>& parameters);

}  // namespace xpm
