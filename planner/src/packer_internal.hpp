// packer_internal.hpp — helpers shared by the packers (packer.cpp, ffd_packer.cpp). Private to
// xpm::planner: not installed, not an API for embedders.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/record_dims_view.hpp"

namespace xpm::packer_internal {

/// model.fits(dims, usable_bytes) for one model and budget, many times: for a linear formula and
/// a model without infeasible probes or floor formula (and at batch size 1 without a
/// single-record factor or coefficients) it evaluates the expanded monomials directly, with the
/// same operations in the same order as CostFormula::predict (so the same result, bit for
/// bit) but without its per-call argument checks; otherwise, and beyond a refit's region
/// (MemoryModel::beyond_refit_region), it calls model.fits. The model must outlive it; dims
/// must have one entry per variable (the packers' inputs are validated).
class FitTest {
 public:
  FitTest(const MemoryModel& model, double usable_bytes);
  bool operator()(const std::vector<double>& dims) const;

 private:
  struct Term {
    double coefficient;  // 1 for a term without a coefficient
    double factor;       // the monomial's numeric factor
    std::vector<std::pair<std::size_t, int>> powers;  // (variable, exponent > 0), in order
  };
  const MemoryModel& model_;
  double usable_bytes_;
  bool direct_;
  bool single_record_own_;  // batch size 1 predicted otherwise than by the formula (model.fits)
  std::vector<Term> terms_;
};

/// Largest key the counting sort of descending_order() takes (larger keys: comparison sort).
constexpr double kCountingSortMaxKey = 1 << 24;

/// Checks a pack() call's inputs. Throws std::invalid_argument when usable_bytes <= 0, the
/// view's width is not the formula's variable count, or a dim other than the batch size is not
/// finite (naming the record and variable).
void validate_pack_inputs(RecordDimsView record_dims, const MemoryModel& model, std::int64_t usable_bytes);

/// One vector of dims per record copied contiguously in record order (out[i * variable_count +
/// v] = record_dims[i][v]), the input of a RecordDimsView. Throws std::invalid_argument when
/// usable_bytes <= 0 or a record has the wrong number of dims (naming it); finiteness is left to
/// validate_pack_inputs.
std::vector<double> contiguous_dims(const std::vector<std::vector<double>>& record_dims, const MemoryModel& model,
                                    std::int64_t usable_bytes);

/// Indices 0..n-1 ordered by keys[i] descending, ties by index ascending: the order a stable
/// sort by descending key gives. O(n + range) counting sort when every key is an integer in
/// [0, kCountingSortMaxKey] spanning at most 2n + 65536 values (record lengths); otherwise a
/// radix sort of the keys (O(n), 4 passes at most), NaN keys first (as +infinity).
std::vector<std::size_t> descending_order(const std::vector<double>& keys);

/// The records of `view` ordered by variable `key` descending, ties by index (descending_order
/// of that column): `order` their indices, `rows` the values of variables `columns` in that
/// order (rows[k * columns.size() + j] = view(order[k], columns[j])). For small integer keys one
/// counting-sort pass places indices and rows together (no key array, no inverse permutation);
/// otherwise descending_order, then the rows gathered.
void sort_rows_descending(RecordDimsView view, std::size_t key, const std::vector<std::size_t>& columns,
                          std::vector<std::size_t>& order, std::vector<double>& rows);

/// Rows of `values` (width values each) in `order`: out[k * width + j] = values[order[k] * width
/// + j]. Reads `values` sequentially and scatters (cheaper in cache misses than reading in
/// `order`). `order` is a permutation of the rows.
std::vector<double> permute_rows(const double* values, const std::vector<std::size_t>& order, std::size_t width);

}  // namespace xpm::packer_internal
