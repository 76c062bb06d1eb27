// xpm/trainer/options/gradient_clipping.hpp — clipping by the global gradient norm when each rank holds
// only a shard of the gradient (sharded optimizer) or the whole of it (one process, no_shard).
//
//   // each rank: its reduced gradient slice(s), disjoint across ranks, covering the gradient
//   double norm = clip_gradient_norm_(sharded.owned_gradients(), /*max_norm=*/1.0, dist);
//
// The norm is global: each rank sums |g|^p over its shards, one all-reduce (sum; max for the
// infinity norm) adds the ranks' sums, every rank takes the p-th root and scales its shards by
// min(1, max_norm / (norm + 1e-6)) — torch::nn::utils::clip_grad_norm_'s coefficient
// (torch/nn/utils/clip_grad.h, LibTorch 1.13), so sharded clipping equals the unsharded clip
// of the whole gradient. Each shard's norm is one ATen reduction (no temporary copy of the
// shard, so clipping adds nothing to the optimizer step's peak); the shards' norms are combined
// in float64.
#pragma once

#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/distributed/distributed.hpp"

namespace xpm {

/// Scales `gradient_shards` in place so the global gradient's norm is at most `max_norm`, and
/// returns the norm before clipping. The shards of all ranks together must hold every gradient
/// element exactly once (a whole gradient on one rank: pass a single-process
/// DistributedContext(), so no collective runs). Undefined tensors are skipped; a rank may
/// hold no shard (empty vector). norm_type: 2 (Euclidean) or infinity. A non-finite norm (inf
/// or nan gradients) leaves the gradients unchanged and is returned as is (torch would
/// multiply them by nan); the caller skips such a step (DynamicLossScaler does, precision.hpp).
/// Collective when `context` is distributed: every rank calls it once per step, in the same
/// place in its collective sequence. Throws std::invalid_argument for max_norm <= 0 or a
/// norm_type other than 2 or infinity (naming the value); DistributedError from the all-reduce.
double clip_gradient_norm_(const std::vector<torch::Tensor>& gradient_shards, double max_norm,
                           DistributedContext& context, double norm_type = 2.0);

}  // namespace xpm
