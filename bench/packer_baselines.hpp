// packer_baselines.hpp — two packers written here only to compare ours with:
//
//   MaxTokensBatcher: fairseq's batch_by_size with max_tokens (fairseq/data/data_utils.py):
//     sort by length, then cut a new microbatch when (records + 1) x longest length would
//     exceed max_tokens. It knows no memory model; max_tokens must be chosen so that the
//     longest records still fit (safe_max_tokens in packer_inputs.hpp).
//   ReferenceAdaptivePacker: the reference's (xpm-torch, Python) AdaptivePacker as its
//     documentation and docs/design.md section 5 describe it: grow a microbatch record by record,
//     and for each candidate build the candidate list (current + [record]) and recompute its
//     dims from every record in it; optional stable sort by a dim, heaviest first; at most
//     `upper` records per microbatch (the outer batch size). O(sum of microbatch sizes^2).
//
// Both return an xpm::MicrobatchPlan (records once each, dims aggregated) so the same quality
// measures apply; they never mark a microbatch over budget (the reference emits a record that
// does not fit alone, with a warning).
#pragma once

#include <cstdint>
#include <string>

#include "xpm/planner/packer.hpp"

namespace xpm_bench {

class MaxTokensBatcher : public xpm::MicrobatchPacker {
 public:
  /// `length_index`: the dim holding the record length; max_tokens >= 1.
  MaxTokensBatcher(std::size_t length_index, std::int64_t max_tokens);
  /// The model and budget are ignored (fairseq does not have them); dims are {count, max}.
  xpm::MicrobatchPlan pack(const std::vector<std::vector<double>>& record_dims,
                           const xpm::MemoryModel& model, std::int64_t usable_bytes) const override;
  std::string name() const override { return "max_tokens"; }

 private:
  std::size_t length_index_;
  std::int64_t max_tokens_;
};

class ReferenceAdaptivePacker : public xpm::MicrobatchPacker {
 public:
  /// sort_index: the dim to sort by, heaviest first (stable); -1 keeps record order.
  explicit ReferenceAdaptivePacker(int sort_index = -1) : sort_index_(sort_index) {}
  xpm::MicrobatchPlan pack(const std::vector<std::vector<double>>& record_dims,
                           const xpm::MemoryModel& model, std::int64_t usable_bytes) const override;
  std::string name() const override { return sort_index_ < 0 ? "reference" : "reference(sorted)"; }

 private:
  int sort_index_;
};

}  // namespace xpm_bench
