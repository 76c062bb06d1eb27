// xpm/planner/fastest_packer.hpp — packs an outer batch for the least predicted time.
//
//   FastestPacker packer("l");  // records sorted by l, longest first
//   MicrobatchPlan plan = packer.pack(RecordDimsView(dims.data(), n, 2), model, budget.usable_bytes());
//
// (dims: n records x 2 variables, row-major; record_dims_view.hpp.) The model must carry a time
// model (metadata.time_model, time_model.hpp: the probes fit one). The records, sorted by
// sort_by, are cut into consecutive runs, each fitting the budget (MemoryModel::fits), that
// minimise the sum of the runs' predicted forward and backward seconds: overhead_s per
// microbatch against the work each adds, its padding included. Where a microbatch costs little
// beyond its arithmetic (a CPU) that gives more, tighter microbatches than the fewest that fit;
// where it costs much (a GPU's launches for a small model) fewer, fuller ones.
//
// Exact among consecutive runs of the sorted records (dynamic programming over run ends): for
// count and max dims sorted by the one max dim, the cheapest plan whose microbatches each hold
// records of neighbouring lengths. Cost: the sort, then O(n * m) predictions for n records and
// microbatches of at most m records (every run that fits is priced), so meant for a step's
// records (thousands), not millions at once. Same guarantees as every packer (packer.hpp): each
// record once, each microbatch fits, a record that does not fit alone gets an over-budget
// microbatch of its own. Deterministic, no communication: every rank that packs the same records
// with the same model (time model included) gets the same plan, so ranks must share one model
// file (rank 0's, or lockstep probing's), not fit their own time models.
#pragma once

#include <cstdint>
#include <string>

#include "xpm/planner/packer.hpp"

namespace xpm {

class FastestPacker : public MicrobatchPacker {
 public:
  /// `sort_by`: the variable the records are sorted by, heaviest first; "" takes the first
  /// variable aggregated by max (record order when there is none). One variable: throws
  /// std::invalid_argument for a list ("h,w").
  explicit FastestPacker(std::string sort_by = "");
  using MicrobatchPacker::pack;  // the vector-per-record overload, adapted to a view
  /// Also throws std::invalid_argument when `model` has no time model (naming how to get one),
  /// a malformed one, or sort_by is not one of its variables.
  MicrobatchPlan pack(RecordDimsView record_dims, const MemoryModel& model,
                      std::int64_t usable_bytes) const override;
  std::string name() const override { return "fastest"; }

 private:
  std::string sort_by_;
};

}  // namespace xpm
