// xpm/planner/record_dims_view.hpp — a read-only, row-major view of the dims of n records, the
// input of every packer (packer.hpp) without copying them.
//
//   std::vector<double> dims = {1, 12,    // record 0: bs = 1, l = 12 tokens
//                               1, 40,    // record 1
//                               1,  7};   // record 2
//   const xpm::RecordDimsView view(dims.data(), 3, 2);   // 3 records, 2 variables (bs, l)
//   view(1, 1) == 40;                                    // record 1's value of variable 1 (l)
//   MicrobatchPlan plan = AdaptivePacker().pack(view, model, budget.usable_bytes());
//
// view(i, v) = data[i * variables + v]: record i's value of variable v, in the formula's
// variable_names() order and in that variable's own unit (records for the batch-size variable,
// whose entry packers ignore; tokens, characters or pixels for the others). The rows are
// contiguous and of equal width: a C-contiguous [records, variables] float64 array (a NumPy
// array's buffer, a std::vector<double> of records x variables values).
//
// What it does not own: the dims. A view is a pointer and two sizes (copying it copies no dims);
// the buffer must outlive the view and must not change while a packer reads it. It checks
// nothing by itself: packers check that `variables` is the formula's variable count and that
// every dim is finite (std::invalid_argument otherwise).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace xpm {

struct RecordDimsView {
  const double* data;     // records x variables values, row-major; not owned
  std::size_t records;    // rows: one per record
  std::size_t variables;  // columns: one per formula variable

  /// A view of `records` rows of `variables` values each starting at `data` (which may be null
  /// only when records is 0). No default constructor: a view always says what it views.
  constexpr RecordDimsView(const double* data, std::size_t records, std::size_t variables) noexcept
      : data(data), records(records), variables(variables) {}

  /// Record i's value of variable v; no bounds check (i < records, v < variables).
  constexpr const double& operator()(std::size_t i, std::size_t v) const noexcept {
    return data[i * variables + v];
  }
  /// Record i's dims: `variables` contiguous values.
  constexpr const double* row(std::size_t i) const noexcept { return data + i * variables; }
  constexpr std::size_t size() const noexcept { return records; }
  constexpr bool empty() const noexcept { return records == 0; }
};

/// Records' dims from their lengths, one vector per record in `variables` order (what
/// PredictiveBatcher::plan and the packers take): the batch-size variable 1, every other
/// variable the record's length (a padded length and a summed token count are both the length
/// of one record):
///   record_dims_from_lengths({12, 40}, {"bs", "l"}) == {{1, 12}, {1, 40}}
/// Throws std::invalid_argument when `variables` lacks `batch_size_variable`, holds nothing
/// else, or a length is negative or not finite (naming its index).
std::vector<std::vector<double>> record_dims_from_lengths(const std::vector<double>& lengths, const std::vector<std::string>& variables,
                                             const std::string& batch_size_variable = "bs");

}  // namespace xpm
