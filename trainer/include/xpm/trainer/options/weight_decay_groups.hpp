// xpm/trainer/options/weight_decay_groups.hpp — AdamW parameter groups with weight decay on weight
// matrices and embeddings only: no decay for biases and normalization weights, as HF's Trainer
// does (get_decay_parameter_names: every bias and every LayerNorm parameter is excluded).
//
//   std::vector<torch::optim::OptimizerParamGroup> groups =
//       adamw_param_groups(*model, torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
//   torch::optim::AdamW optimizer(groups, torch::optim::AdamWOptions(3e-3));
//
// Decided by parameter name (module path), so it works for any module: a parameter is excluded
// when the last part of its name is "bias" (Linear), starts with "bias_" (LSTM's "bias_ih_l0") or
// ends with "_bias" (MultiheadAttention's "in_proj_bias"), or
// when any part of its name contains "norm" (LayerNorm modules named norm1, norm2, layer_norm,
// ...; their weight and bias). Parameters that do not require grad (frozen) are left out of both
// groups, so the optimizer keeps no state for them.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

namespace xpm {

/// True when `name` (a named_parameters() key such as "encoder.layers.0.norm1.weight") names a
/// bias or a normalization parameter, which get no weight decay.
bool excluded_from_weight_decay(const std::string& name);

struct WeightDecaySplit {
  std::vector<std::string> decay_names;     // in registration order
  std::vector<std::string> no_decay_names;  // in registration order
};

/// Which trainable parameters of `module` get weight decay, by excluded_from_weight_decay().
WeightDecaySplit split_for_weight_decay(const torch::nn::Module& module);

/// Two AdamW groups in this order: the decayed parameters with `options` as given, then the
/// excluded ones with `options` but weight_decay 0. A group with no parameter is left out (so
/// the result has one group when nothing is excluded). Parameters keep registration order inside
/// a group. Every rank building the same model gets the same groups (the sharded optimizer
/// relies on it).
std::vector<torch::optim::OptimizerParamGroup> adamw_param_groups(const torch::nn::Module& module,
                                                                   const torch::optim::AdamWOptions& options);

}  // namespace xpm
