// xpm/planner/packer.hpp — split an outer batch into microbatches that fit a memory budget.
//
// Records are described by their dims only: record i's value of variable v (formula
// variable_names() order; the batch-size entry is ignored). A microbatch's dims are the
// aggregation of its records' dims (MemoryModel::aggregation(): count, max or sum). The primary
// input is a RecordDimsView (record_dims_view.hpp): a row-major [records, variables] buffer the
// packer reads without copying (a NumPy array from Python, a std::vector<double>); one
// std::vector<double> per record is also taken (copied once into one contiguous block).
//
//   std::vector<double> dims = {1, 120, 1, 40, 1, 250};        // {bs, l} per record, 3 records
//   AdaptivePackerOptions packer_options;
//   packer_options.sort_by = "l";
//   AdaptivePacker packer(packer_options);
//   MicrobatchPlan plan = packer.pack(RecordDimsView(dims.data(), 3, 2), model, budget.usable_bytes());
//   for (const Microbatch& mb : plan.microbatches) run(mb.record_indices);
//
// Guarantees of every packer: each record index 0..n-1 appears in exactly one microbatch; a
// microbatch fits (MemoryModel::fits: predicted within budget, and dominating no probe that ran
// out of memory); a record that does not fit alone is put in a microbatch of its own with
// over_budget = true and listed in plan.over_budget_records (never silently treated as fitting).
// Both inputs give the same plan for the same dims.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/option_setters.hpp"
#include "xpm/planner/record_dims_view.hpp"

namespace xpm {

struct Microbatch {
  std::vector<std::size_t> record_indices;  // indices into the outer batch
  std::vector<double> dims;                 // aggregated dims, variable_names() order
  double predicted_bytes = 0;               // model.predict_bytes(dims)
  bool over_budget = false;                 // !model.fits(dims, budget) (only a lone record):
                                            // over budget, or dominates an infeasible probe
};

struct MicrobatchPlan {
  std::vector<Microbatch> microbatches;
  std::vector<std::size_t> over_budget_records;  // records that do not fit even alone
};

/// Aggregates the dims of the records `indices` under `model`'s aggregation rules (count: the
/// number of indices; max; sum). Throws std::invalid_argument for an index out of range or a
/// view whose width is not the formula's variable count.
std::vector<double> aggregate_dims(RecordDimsView record_dims, const std::vector<std::size_t>& indices,
                                   const MemoryModel& model);
/// The same under per-variable rules (variable order, the batch size's kCount), for dims
/// aggregated before any model exists (the probe design's mixes of records).
std::vector<double> aggregate_dims(RecordDimsView record_dims, const std::vector<std::size_t>& indices,
                                   const std::vector<DimAggregation>& aggregation);
/// The same over one vector per record; also throws when a listed record has the wrong width.
std::vector<double> aggregate_dims(const std::vector<std::vector<double>>& record_dims,
                                   const std::vector<std::size_t>& indices,
                                   const MemoryModel& model);

/// A packer implements pack(RecordDimsView, ...) (the packers here) or, as older ones do,
/// pack(const std::vector<std::vector<double>>&, ...); each overload's default adapts its input
/// to the other (throwing std::logic_error naming the packer when a class overrides neither).
/// A class that overrides one adds `using MicrobatchPacker::pack;` to keep both callable on it.
class MicrobatchPacker {
 public:
  virtual ~MicrobatchPacker() = default;
  /// Packs records 0..record_dims.records-1, read in place (the buffer must not change until it
  /// returns). Throws std::invalid_argument when the view's width is not the formula's variable
  /// count, a dim other than the batch size is not finite, or usable_bytes <= 0.
  /// Deterministic; every rank calling with the same input gets the same plan. The default
  /// copies the rows into vectors and calls the vector overload.
  virtual MicrobatchPlan pack(RecordDimsView record_dims, const MemoryModel& model,
                              std::int64_t usable_bytes) const;
  /// Packs records 0..record_dims.size()-1, one vector of dims each. Throws
  /// std::invalid_argument when a record has the wrong number of dims (naming it), a dim is not
  /// finite, or usable_bytes <= 0. The default copies the rows into one contiguous block (one
  /// pass) and packs a view of it: the same plan as the view overload.
  virtual MicrobatchPlan pack(const std::vector<std::vector<double>>& record_dims,
                              const MemoryModel& model, std::int64_t usable_bytes) const;
  virtual std::string name() const = 0;
};

/// One microbatch size from the whole outer batch's dims, then equal slices in record order
/// (sizes differ by at most one). Optimal for homogeneous records, conservative otherwise.
/// If even one record at the whole batch's dims is over budget, the batch is handled per
/// record: each record over budget alone gets its own over-budget microbatch, the other records
/// are sliced the same way at their own aggregated dims (one record per microbatch if that still
/// does not fit), and the microbatches are ordered by their first record index.
class UniformPacker : public MicrobatchPacker {
 public:
  using MicrobatchPacker::pack;  // the vector-per-record overload, adapted to a view
  MicrobatchPlan pack(RecordDimsView record_dims, const MemoryModel& model,
                      std::int64_t usable_bytes) const override;
  std::string name() const override { return "uniform"; }
};

/// How AdaptivePacker orders the records it packs:
///
///   AdaptivePacker packer(AdaptivePackerOptions().set_sort_by("h,w"));  // by h, then w
struct AdaptivePackerOptions {
  /// Variable to sort by, heaviest first (stable); several, comma-separated ("h,w"), sort by
  /// the first, then by the next among equal values, so records alike in every padded
  /// dimension share microbatches; "" keeps record order.
  std::string sort_by;

  XPM_OPTION_SETTER(AdaptivePackerOptions, std::string, sort_by)
  /// Throws std::invalid_argument "AdaptivePackerOptions.sort_by '<text>' has an empty variable
  /// name" for "h,,w", ",h" or "h,". Whether the names are the model's variables is checked
  /// when packing (the options know no model).
  void validate() const;
};

/// Grows the current microbatch record by record while its predicted bytes fit, then starts a
/// new one. Dims are aggregated incrementally, O(1) per record; sort_by adds an O(n) sort
/// (counting sort of integer dims such as lengths, radix sort otherwise). 1M Brown sentence
/// lengths take about 0.05 s unsorted, 0.1 s sorted (docs/benchmarks.md, "Packers").
/// With count and max dims only, sorted by the one max dim, and a model that never predicts less
/// for more records or a longer one, the plan has the fewest microbatches possible
/// (docs/benchmarks.md, "Packers", says why); FirstFitDecreasingPacker (ffd_packer.hpp) does
/// better when a dim is summed.
class AdaptivePacker : public MicrobatchPacker {
 public:
  explicit AdaptivePacker(AdaptivePackerOptions options = {});
  using MicrobatchPacker::pack;  // the vector-per-record overload, adapted to a view
  MicrobatchPlan pack(RecordDimsView record_dims, const MemoryModel& model,
                      std::int64_t usable_bytes) const override;
  std::string name() const override;

 private:
  std::vector<std::size_t> sort_keys(const MemoryModel& model) const;
  AdaptivePackerOptions options_;
};

}  // namespace xpm
