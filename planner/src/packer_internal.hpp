// packer_internal.hpp — helpers shared by the packers (packer.cpp, ffd_packer.cpp). Private to
// xpm::planner: not installed, not an API for embedders.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "xpm/planner/memory_model.hpp"

namespace xpm::packer_internal {

/// model.fits(dims, usable_bytes) for one model and budget, many times: for a linear formula and
/// a model without infeasible probes or floor formula it evaluates the expanded monomials directly, with the
/// same operations in the same order as CostFormula::predict (so the same result, bit for
/// bit) but without its per-call argument checks; otherwise it calls model.fits. The model must
/// outlive it; dims must have one entry per variable (the packers' inputs are validated).
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
  std::vector<Term> terms_;
};

/// Largest key the counting sort of descending_order() takes (larger keys: comparison sort).
constexpr double kCountingSortMaxKey = 1 << 24;

/// Checks a pack() call's inputs. Throws std::invalid_argument when usable_bytes <= 0, or a
/// record has the wrong number of dims or a non-finite dim (naming the record and variable).
void validate_pack_inputs(const std::vector<std::vector<double>>& record_dims,
                          const MemoryModel& model, std::int64_t usable_bytes);

/// Indices 0..n-1 ordered by keys[i] descending, ties by index ascending: the order a stable
/// sort by descending key gives. O(n + range) counting sort when every key is an integer in
/// [0, kCountingSortMaxKey] spanning at most 2n + 65536 values (record lengths); otherwise a
/// radix sort of the keys (O(n), 4 passes at most), NaN keys first (as +infinity).
std::vector<std::size_t> descending_order(const std::vector<double>& keys);

/// validate_pack_inputs, then the records' dims copied contiguously in record order:
/// out[i * variable_count + v] = record_dims[i][v]. One pass over the records (one heap block
/// each); the packers then read only contiguous memory.
std::vector<double> flat_dims(const std::vector<std::vector<double>>& record_dims, const MemoryModel& model,
                              std::int64_t usable_bytes);

/// Rows of `values` (width values each) in `order`: out[k * width + j] = values[order[k] * width
/// + j]. Reads `values` sequentially and scatters (cheaper in cache misses than reading in
/// `order`). `order` is a permutation of the rows.
std::vector<double> permute_rows(const std::vector<double>& values, const std::vector<std::size_t>& order,
                                 std::size_t width);

}  // namespace xpm::packer_internal
