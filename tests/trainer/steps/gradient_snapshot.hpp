// gradient_snapshot.hpp — copies of a module's parameter gradients, for the suites that compare
// the gradients of two ways of computing one step.
#pragma once

#include <vector>

#include <torch/torch.h>

namespace xpm_test {

/// A detached copy of every parameter's .grad, in parameters() order.
inline std::vector<torch::Tensor> gradients(const torch::nn::Module& model) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : model.parameters()) grads.push_back(p.grad().detach().clone());
  return grads;
}

}  // namespace xpm_test
