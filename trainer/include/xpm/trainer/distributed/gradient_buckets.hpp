// xpm/trainer/distributed/gradient_buckets.hpp — gradients laid out in a few flat buckets so a step needs
// one all-reduce per bucket, with no copy: each parameter's .grad is a view into its bucket
// (PyTorch DDP's gradient_as_bucket_view, https://pytorch.org/docs/stable/generated/
// torch.nn.parallel.DistributedDataParallel.html), so the buckets cost no memory beyond the
// gradients themselves and the static memory the planner measured stays the same.
//
//   GradientBuckets buckets(model->parameters(), /*bucket_cap_bytes=*/25 << 20);
//   ... backward over this rank's microbatches (gradients accumulate into the views) ...
//   buckets.all_reduce_sum(dist);   // every rank, once per optimizer step
//
// Buckets: parameters in registration order, a new bucket when adding the next gradient would
// pass bucket_cap_bytes or its dtype/device differs (a gradient larger than the cap gets a
// bucket of its own). The layout depends only on the parameters, so it is the same on every
// rank. Gradients are summed, not averaged: the loss of each microbatch is already divided by
// the global number of units (tokens) of the whole global batch, so the sum over ranks is the
// gradient of the global batch's mean loss (docs/design.md section 4).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/distributed/distributed.hpp"

namespace xpm {

class GradientBuckets {
 public:
  /// Moves the gradients of `parameters` (those requiring grad; an undefined gradient becomes
  /// zeros) into flat buckets and makes each .grad a view of its bucket. Throws
  /// std::invalid_argument when bucket_cap_bytes < 1. Call before the first backward of
  /// training and after any code that replaces .grad tensors.
  GradientBuckets(std::vector<torch::Tensor> parameters, std::int64_t bucket_cap_bytes);

  /// Sums every bucket over the ranks in place (one all-reduce per bucket, in bucket order).
  /// Collective: every rank calls it once per optimizer step, including steps it ran no
  /// microbatch in (its gradients are zero). A .grad that no longer aliases its bucket view
  /// (replaced by other code) is copied into it first and re-pointed, so results stay correct.
  void all_reduce_sum(DistributedContext& context);

  /// Bytes of each bucket, in order.
  std::vector<std::int64_t> bucket_bytes() const;
  /// How many times all_reduce_sum found a replaced .grad (0 in normal training).
  std::int64_t regrafted_gradients() const { return regrafted_gradients_; }

 private:
  struct Slot {
    torch::Tensor parameter;
    torch::Tensor view;  // the bucket's slice, shaped like the parameter
  };
  struct Bucket {
    torch::Tensor flat;
    std::vector<Slot> slots;
  };
  std::vector<Bucket> buckets_;
  std::int64_t regrafted_gradients_ = 0;
};

}  // namespace xpm
