// packer_baselines.cpp — see packer_baselines.hpp.
#include "packer_baselines.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <utility>

namespace xpm_bench {

MaxTokensBatcher::MaxTokensBatcher(std::size_t length_index, std::int64_t max_tokens)
    : length_index_(length_index), max_tokens_(max_tokens) {
  if (max_tokens < 1) throw std::invalid_argument("MaxTokensBatcher: max_tokens must be >= 1");
}

xpm::MicrobatchPlan MaxTokensBatcher::pack(const std::vector<std::vector<double>>& record_dims,
                                           const xpm::MemoryModel& /*model*/,
                                           std::int64_t /*usable_bytes*/) const {
  const std::size_t n = record_dims.size();
  // fairseq: indices ordered by size (numpy argsort, ascending), then cut in one pass.
  std::vector<std::pair<double, std::size_t>> by_length(n);
  for (std::size_t i = 0; i < n; ++i) by_length[i] = {record_dims[i][length_index_], i};
  std::sort(by_length.begin(), by_length.end());
  xpm::MicrobatchPlan plan;
  xpm::Microbatch current;
  double longest = 0;
  const auto max_tokens = static_cast<double>(max_tokens_);
  auto emit = [&] {
    current.dims = {static_cast<double>(current.record_indices.size()), longest};
    plan.microbatches.push_back(std::move(current));
    current = xpm::Microbatch();
  };
  for (const auto& [length, i] : by_length) {
    const double new_longest = std::max(longest, length);
    if (!current.record_indices.empty() &&
        static_cast<double>(current.record_indices.size() + 1) * new_longest > max_tokens) {
      emit();
      longest = length;
    } else {
      longest = new_longest;
    }
    current.record_indices.push_back(i);
  }
  if (!current.record_indices.empty()) emit();
  return plan;
}

xpm::MicrobatchPlan ReferenceAdaptivePacker::pack(const std::vector<std::vector<double>>& record_dims,
                                                  const xpm::MemoryModel& model,
                                                  std::int64_t usable_bytes) const {
  const std::size_t n = record_dims.size();
  const std::size_t bs = model.batch_size_index();
  const std::size_t upper = n;  // the worker's max_batch_size: the outer batch size
  const auto budget = static_cast<double>(usable_bytes);
  std::vector<std::size_t> items(n);
  std::iota(items.begin(), items.end(), std::size_t{0});
  if (sort_index_ >= 0) {  // Python's list.sort(key=..., reverse=True): stable
    const auto key = static_cast<std::size_t>(sort_index_);
    std::stable_sort(items.begin(), items.end(), [&](std::size_t a, std::size_t b) {
      return record_dims[a][key] > record_dims[b][key];
    });
  }
  // fits(candidate): dims recomputed from every record of the candidate list.
  auto fits = [&](const std::vector<std::size_t>& candidate) {
    if (candidate.size() > upper) return false;
    std::vector<double> dims = xpm::aggregate_dims(record_dims, candidate, model);
    dims[bs] = static_cast<double>(candidate.size());
    return model.predict_bytes(dims) <= budget;
  };
  xpm::MicrobatchPlan plan;
  std::vector<std::size_t> current;
  auto emit = [&](std::vector<std::size_t> indices) {
    xpm::Microbatch mb;
    mb.dims = xpm::aggregate_dims(record_dims, indices, model);
    mb.record_indices = std::move(indices);
    plan.microbatches.push_back(std::move(mb));
  };
  for (std::size_t record : items) {
    std::vector<std::size_t> candidate = current;  // current + [record]: a new list
    candidate.push_back(record);
    if (fits(candidate)) {
      current = std::move(candidate);
      continue;
    }
    if (!current.empty()) {
      emit(std::move(current));
      current.clear();
    }
    if (fits({record})) {
      current = {record};
    } else {
      emit({record});  // emitted anyway (the reference logs a warning)
    }
  }
  if (!current.empty()) emit(std::move(current));
  return plan;
}

}  // namespace xpm_bench
