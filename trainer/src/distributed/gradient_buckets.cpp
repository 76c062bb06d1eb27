#include "xpm/trainer/distributed/gradient_buckets.hpp"

#include <stdexcept>
#include <string>

namespace xpm {

GradientBuckets::GradientBuckets(std::vector<torch::Tensor> parameters, std::int64_t bucket_cap_bytes) {
  if (bucket_cap_bytes < 1) {
    throw std::invalid_argument("GradientBuckets: bucket_cap_bytes must be >= 1, got " +
                                std::to_string(bucket_cap_bytes));
  }
  torch::NoGradGuard no_grad;
  // Group parameters into buckets first, then allocate each bucket once.
  std::vector<std::vector<torch::Tensor>> groups;
  std::int64_t group_bytes = 0;
  for (torch::Tensor& parameter : parameters) {
    if (!parameter.requires_grad()) continue;
    const std::int64_t bytes = parameter.numel() * static_cast<std::int64_t>(parameter.element_size());
    const bool fits = !groups.empty() && group_bytes + bytes <= bucket_cap_bytes &&
                      groups.back().front().scalar_type() == parameter.scalar_type() &&
                      groups.back().front().device() == parameter.device();
    if (!fits) {
      groups.emplace_back();
      group_bytes = 0;
    }
    groups.back().push_back(parameter);
    group_bytes += bytes;
  }
  for (auto& group : groups) {
    std::int64_t numel = 0;
    for (const torch::Tensor& parameter : group) numel += parameter.numel();
    Bucket bucket;
    bucket.flat = torch::zeros({numel}, group.front().options().requires_grad(false));
    std::int64_t offset = 0;
    for (torch::Tensor& parameter : group) {
      torch::Tensor view = bucket.flat.narrow(0, offset, parameter.numel()).view(parameter.sizes());
      if (parameter.grad().defined()) view.copy_(parameter.grad());
      parameter.mutable_grad() = view;  // the old gradient is freed once nothing else holds it
      bucket.slots.push_back({parameter, view});
      offset += parameter.numel();
    }
    buckets_.push_back(std::move(bucket));
  }
}

std::vector<std::int64_t> GradientBuckets::bucket_bytes() const {
  std::vector<std::int64_t> out;
  for (const Bucket& bucket : buckets_) {
    out.push_back(bucket.flat.numel() * static_cast<std::int64_t>(bucket.flat.element_size()));
  }
  return out;
}

void GradientBuckets::all_reduce_sum(DistributedContext& context) {
  torch::NoGradGuard no_grad;
  for (Bucket& bucket : buckets_) {
    for (Slot& slot : bucket.slots) {
      const torch::Tensor& grad = slot.parameter.grad();
      if (grad.defined() && grad.data_ptr() == slot.view.data_ptr()) continue;
      if (grad.defined()) {
        slot.view.copy_(grad);
      } else {
        slot.view.zero_();
      }
      slot.parameter.mutable_grad() = slot.view;
      ++regrafted_gradients_;
    }
    context.all_reduce_(bucket.flat, ReduceOp::kSum);
  }
}

}  // namespace xpm
