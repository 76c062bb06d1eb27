#include "xpm/trainer/options/gradient_clipping.hpp"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace xpm {

double clip_gradient_norm_(const std::vector<torch::Tensor>& gradient_shards, double max_norm,
                           DistributedContext& context, double norm_type) {
  const bool infinity = norm_type == std::numeric_limits<double>::infinity();
  if (!(max_norm > 0) || !std::isfinite(max_norm)) {
    throw std::invalid_argument("clip_gradient_norm_: max_norm must be finite and > 0, got " +
                                std::to_string(max_norm));
  }
  if (!infinity && norm_type != 2.0) {
    throw std::invalid_argument("clip_gradient_norm_: norm_type must be 2 or infinity, got " +
                                std::to_string(norm_type));
  }
  torch::NoGradGuard no_grad;
  double local = 0;  // sum of squares, or max |g|
  for (const torch::Tensor& shard : gradient_shards) {
    if (!shard.defined() || shard.numel() == 0) continue;
    const double shard_norm = torch::linalg_vector_norm(shard, norm_type).item<double>();
    local = infinity ? std::max(local, shard_norm) : local + shard_norm * shard_norm;
  }
  const double global = context.all_reduce({local}, infinity ? ReduceOp::kMax : ReduceOp::kSum)[0];
  const double norm = infinity ? global : std::sqrt(global);
  // clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to at most 1.
  if (!std::isfinite(norm)) return norm;
  const double coefficient = std::min(1.0, max_norm / (norm + 1e-6));
  if (coefficient < 1.0) {
    for (const torch::Tensor& shard : gradient_shards) {
      if (shard.defined() && shard.numel() > 0) shard.mul_(coefficient);
    }
  }
  return norm;
}

}  // namespace xpm
