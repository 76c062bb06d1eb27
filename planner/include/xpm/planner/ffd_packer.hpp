// xpm/planner/ffd_packer.hpp — first-fit-decreasing microbatch packer.
//
//   FirstFitDecreasingPacker packer;
//   MicrobatchPlan plan = packer.pack(RecordDimsView(dims.data(), n, 2), model, budget.usable_bytes());
//
// (dims: n records x 2 variables, row-major; record_dims_view.hpp.) One std::vector<double> per
// record is taken too (packer.hpp, MicrobatchPacker), with the same plan.
//
// Records are taken heaviest first (by the formula's prediction for the record alone), and each
// goes into the FIRST microbatch opened so far that still fits with it (MemoryModel::fits on the
// aggregated dims), else into a new one. This is bin packing's first-fit decreasing, with the
// memory model deciding what fits instead of a sum of item sizes.
//
// When it beats AdaptivePacker(sort_by): with dims that add up (DimAggregation::kSum, e.g. real
// tokens of packed sequences), a later, lighter record can fill the space left in an earlier
// microbatch. With count and max dims only (bs, padded length), adding a lighter record to a
// microbatch costs the same whichever record it is, so first fit and the sorted adaptive
// packer's next fit give the same microbatches (docs/benchmarks.md measures both).
//
// Cost: O(n) for the order (counting or radix sort), then per record O(log m) to find the first
// microbatch worth trying (m microbatches so far) plus one fits() per microbatch tried. A
// microbatch that could not take a record is not tried again for records whose predicted cost
// alone is as high or higher, and is closed for good once it cannot take a virtual record
// whose dims are the componentwise minimum of every record still to place. For records that
// differ in one dim (a length, padded or summed) and a model that grows with it, neither rule
// skips a microbatch the record would fit: the plan is first fit decreasing exactly. With
// several dims the first rule may skip one (a heavier record can be shorter in one dim); the
// plan then may have a microbatch more, never one over budget. Same guarantees as every packer
// (packer.hpp): each record once, each microbatch fits, a record that does not fit alone gets an
// over-budget microbatch of its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xpm/planner/packer.hpp"

namespace xpm {

/// First-fit decreasing by predicted bytes of each record alone (see the file comment).
/// Microbatches are listed in the order they were opened (heaviest first). Deterministic: ties
/// in the prediction keep record order.
class FirstFitDecreasingPacker : public MicrobatchPacker {
 public:
  using MicrobatchPacker::pack;  // the vector-per-record overload, adapted to a view
  /// Throws std::invalid_argument when the view's width is not the formula's variable count, a
  /// dim is not finite, or usable_bytes <= 0.
  MicrobatchPlan pack(RecordDimsView record_dims, const MemoryModel& model,
                      std::int64_t usable_bytes) const override;
  std::string name() const override { return "ffd"; }
};

}  // namespace xpm
