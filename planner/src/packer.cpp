// packer.cpp — UniformPacker and AdaptivePacker (see packer.hpp).
#include "xpm/planner/packer.hpp"

#include "number_format.hpp"
#include "packer_internal.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

namespace xpm {
namespace packer_internal {

void validate_pack_inputs(RecordDimsView record_dims, const MemoryModel& model, std::int64_t usable_bytes) {
  if (usable_bytes <= 0) {
    throw std::invalid_argument("pack: usable_bytes must be > 0, got " +
                                std::to_string(usable_bytes));
  }
  const auto& vars = model.formula().variable_names();
  if (record_dims.variables != vars.size()) {
    throw std::invalid_argument("pack: record dims have " + std::to_string(record_dims.variables) +
                                " value(s) per record, expected " + std::to_string(vars.size()) +
                                " (one per formula variable)");
  }
  if (record_dims.records > 0 && record_dims.data == nullptr) {
    throw std::invalid_argument("pack: record dims of " + std::to_string(record_dims.records) +
                                " records have no data (null pointer)");
  }
  const std::size_t bs = model.batch_size_index();
  for (std::size_t i = 0; i < record_dims.records; ++i) {
    const double* r = record_dims.row(i);
    for (std::size_t v = 0; v < vars.size(); ++v) {
      if (v != bs && !(std::isfinite(r[v]) && r[v] >= 0)) {
        throw std::invalid_argument("pack: record " + std::to_string(i) + " has " + vars[v] +
                                    " = " + detail::format_double(r[v]) + "; dims must be finite and >= 0");
      }
    }
  }
}

std::vector<double> contiguous_dims(const std::vector<std::vector<double>>& record_dims,
                                    const MemoryModel& model, std::int64_t usable_bytes) {
  if (usable_bytes <= 0) {
    throw std::invalid_argument("pack: usable_bytes must be > 0, got " +
                                std::to_string(usable_bytes));
  }
  const std::size_t nv = model.formula().variable_names().size();
  std::vector<double> out(record_dims.size() * nv);
  for (std::size_t i = 0; i < record_dims.size(); ++i) {
    if (record_dims[i].size() != nv) {
      throw std::invalid_argument("pack: record " + std::to_string(i) + " has " +
                                  std::to_string(record_dims[i].size()) + " dims, expected " +
                                  std::to_string(nv));
    }
    std::copy(record_dims[i].begin(), record_dims[i].end(), out.begin() + static_cast<std::ptrdiff_t>(i * nv));
  }
  return out;
}

namespace {

// True when the n keys key(0..n-1) are all integers in [0, kCountingSortMaxKey] spanning at
// most 2n + 65536 values (record lengths, token counts): a counting sort takes them in O(n +
// range). Sets [lo, hi] to their range.
template <class Key>
bool counting_sortable(std::size_t n, Key key, std::size_t& lo, std::size_t& hi) {
  if (n == 0) return false;
  double low = key(0), high = key(0);
  for (std::size_t i = 0; i < n; ++i) {
    const double k = key(i);
    if (!(k >= 0 && k <= kCountingSortMaxKey && k == std::floor(k))) return false;
    low = std::min(low, k);
    high = std::max(high, k);
  }
  if (high - low > static_cast<double>(2 * n + 65536)) return false;
  lo = static_cast<std::size_t>(low);
  hi = static_cast<std::size_t>(high);
  return true;
}

// Where each key's records start in the descending order: start[hi - k] for key k, ties in
// index order as they are placed (stable by construction).
template <class Key>
std::vector<std::size_t> bucket_starts(std::size_t n, Key key, std::size_t lo, std::size_t hi) {
  std::vector<std::size_t> start(hi - lo + 2, 0);  // bucket b holds key hi - b
  for (std::size_t i = 0; i < n; ++i) ++start[hi - static_cast<std::size_t>(key(i)) + 1];
  for (std::size_t b = 1; b < start.size(); ++b) start[b] += start[b - 1];
  return start;
}

}  // namespace

void sort_rows_descending(RecordDimsView view, std::size_t key, const std::vector<std::size_t>& columns,
                          std::vector<std::size_t>& order, std::vector<double>& rows) {
  const std::size_t n = view.records;
  const std::size_t width = columns.size();
  const auto key_of = [&](std::size_t i) { return view(i, key); };
  std::size_t lo = 0, hi = 0;
  if (!counting_sortable(n, key_of, lo, hi)) {
    std::vector<double> keys(n);
    for (std::size_t i = 0; i < n; ++i) keys[i] = key_of(i);
    order = descending_order(keys);
    rows.assign(n * width, 0.0);
    for (std::size_t k = 0; k < n; ++k) {
      for (std::size_t j = 0; j < width; ++j) rows[k * width + j] = view(order[k], columns[j]);
    }
    return;
  }
  // One pass places each record's index and dims at its slot (reads the view in order, writes
  // scattered): no key array, no inverse permutation.
  std::vector<std::size_t> start = bucket_starts(n, key_of, lo, hi);
  order.assign(n, 0);
  rows.assign(n * width, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t slot = start[hi - static_cast<std::size_t>(key_of(i))]++;
    order[slot] = i;
    const double* record = view.row(i);
    for (std::size_t j = 0; j < width; ++j) rows[slot * width + j] = record[columns[j]];
  }
}

std::vector<std::size_t> descending_order(const std::vector<double>& keys) {
  const std::size_t n = keys.size();
  std::vector<std::size_t> order(n);
  if (n == 0) return order;
  // Counting sort when every key is a small non-negative integer (lengths, token counts): O(n +
  // range), and stable by construction.
  const auto key_of = [&](std::size_t i) { return keys[i]; };
  std::size_t lo = 0, hi = 0;
  if (counting_sortable(n, key_of, lo, hi)) {
    std::vector<std::size_t> start = bucket_starts(n, key_of, lo, hi);
    for (std::size_t i = 0; i < n; ++i) order[start[hi - static_cast<std::size_t>(keys[i])]++] = i;
    return order;
  }
  // Otherwise: NaN counts as +infinity (first, the heaviest). Small inputs: sort (key, index)
  // pairs. Large ones: least-significant-digit radix sort, 16 bits per pass, of the keys mapped
  // to unsigned integers whose ascending order is the keys' descending order; each pass is
  // stable, so ties keep index order. O(n) per pass, passes whose digit is the same for every
  // key skipped.
  auto sortable = [](double key) {
    if (std::isnan(key)) key = std::numeric_limits<double>::infinity();
    if (key == 0) key = 0.0;  // -0 and +0 are equal keys
    std::uint64_t bits = 0;
    std::memcpy(&bits, &key, sizeof bits);
    bits = (bits >> 63) != 0 ? ~bits : bits | (std::uint64_t{1} << 63);  // ascending with the key
    return ~bits;                                                         // descending
  };
  if (n < 4096) {
    std::vector<std::pair<std::uint64_t, std::size_t>> pairs(n);
    for (std::size_t i = 0; i < n; ++i) pairs[i] = {sortable(keys[i]), i};
    std::sort(pairs.begin(), pairs.end());
    for (std::size_t i = 0; i < n; ++i) order[i] = pairs[i].second;
    return order;
  }
  std::vector<std::uint64_t> sort_keys(n), scratch_keys(n);
  std::vector<std::size_t> scratch(n);
  for (std::size_t i = 0; i < n; ++i) {
    sort_keys[i] = sortable(keys[i]);
    order[i] = i;
  }
  std::vector<std::size_t> count(1 << 16);
  for (int shift = 0; shift < 64; shift += 16) {
    std::fill(count.begin(), count.end(), 0);
    for (std::uint64_t k : sort_keys) ++count[(k >> shift) & 0xffff];
    if (count[(sort_keys[0] >> shift) & 0xffff] == n) continue;  // one digit value: nothing moves
    std::size_t sum = 0;
    for (std::size_t& c : count) sum += std::exchange(c, sum);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t slot = count[(sort_keys[k] >> shift) & 0xffff]++;
      scratch_keys[slot] = sort_keys[k];
      scratch[slot] = order[k];
    }
    sort_keys.swap(scratch_keys);
    order.swap(scratch);
  }
  return order;
}

FitTest::FitTest(const MemoryModel& model, double usable_bytes)
    : model_(model),
      usable_bytes_(usable_bytes),
      direct_(model.formula().is_linear() && model.infeasible_probes().empty() &&
              model.floor_formula() == nullptr),
      single_record_own_(model.single_record_factor() != 1 || !model.single_record_coefficients().empty()) {
  if (!direct_) return;
  for (const Monomial& m : model.formula().monomials()) {
    Term term{m.coefficient >= 0 ? model.coefficients()[static_cast<std::size_t>(m.coefficient)] : 1.0,
              m.factor, {}};
    for (std::size_t v = 0; v < m.powers.size(); ++v) {
      if (m.powers[v] > 0) term.powers.emplace_back(v, m.powers[v]);
    }
    terms_.push_back(std::move(term));
  }
}

bool FitTest::operator()(const std::vector<double>& dims) const {
  if (!direct_ || (single_record_own_ && dims[model_.batch_size_index()] == 1) || model_.beyond_refit_region(dims))
    return model_.fits(dims, usable_bytes_);
  // CostFormula::predict computes out += scale * term_value(m, dims), term_value = factor x
  // prod_v integer_power(dims[v], powers[v]) with integer_power = 1.0 x d x d ...; leaving out
  // the factors 1.0 (exponent 0, and the first of each power) changes no bit of the result.
  double formula = 0.0;
  for (const Term& t : terms_) {
    double value = t.factor;
    for (const auto& [v, exponent] : t.powers) {
      double power = dims[v];
      for (int k = 1; k < exponent; ++k) power *= dims[v];
      value *= power;
    }
    formula += t.coefficient * value;
  }
  return std::max(model_.floor_bytes(), formula) <= usable_bytes_;  // MemoryModel::predict_bytes
}

std::vector<double> permute_rows(const double* values, const std::vector<std::size_t>& order, std::size_t width) {
  const std::size_t n = order.size();
  std::vector<std::size_t> position(n);
  for (std::size_t k = 0; k < n; ++k) position[order[k]] = k;
  std::vector<double> out(n * width);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < width; ++j) out[position[i] * width + j] = values[i * width + j];
  }
  return out;
}

}  // namespace packer_internal

namespace {

using packer_internal::validate_pack_inputs;

// Running aggregation of a growing set of records: O(1) per added record. A record is a row of
// values of which variable v's is at record[column[v]] (a count variable's is not read).
class RunningDims {
 public:
  RunningDims(const MemoryModel& model, std::vector<std::size_t> column)
      : model_(model), column_(std::move(column)), dims_(model.formula().variable_names().size(), 0.0) {}

  std::size_t count() const { return count_; }
  const std::vector<double>& dims() const { return dims_; }

  // The dims this set would have with `record` added; does not modify the set. `out` must have
  // one entry per variable.
  void with(const double* record, std::vector<double>& out) const {
    const auto& agg = model_.aggregation();
    for (std::size_t v = 0; v < dims_.size(); ++v) {
      switch (agg[v]) {
        case DimAggregation::kCount: out[v] = static_cast<double>(count_ + 1); break;
        case DimAggregation::kMax:
          out[v] = count_ == 0 ? record[column_[v]] : std::max(dims_[v], record[column_[v]]);
          break;
        case DimAggregation::kSum: out[v] = dims_[v] + record[column_[v]]; break;
      }
    }
  }
  void add(const std::vector<double>& new_dims) {
    for (std::size_t v = 0; v < dims_.size(); ++v) dims_[v] = new_dims[v];
    ++count_;
  }
  void clear() {
    std::fill(dims_.begin(), dims_.end(), 0.0);
    count_ = 0;
  }

 private:
  const MemoryModel& model_;
  std::vector<std::size_t> column_;  // where each variable's value is in a record's row
  std::vector<double> dims_;         // aggregated dims of the records added so far
  std::size_t count_ = 0;
};

Microbatch make_microbatch(std::vector<std::size_t> indices, std::vector<double> dims,
                           const MemoryModel& model, std::int64_t usable_bytes) {
  Microbatch mb;
  mb.record_indices = std::move(indices);
  mb.predicted_bytes = model.predict_bytes(dims);
  mb.dims = std::move(dims);
  mb.over_budget = !model.fits(mb.dims, static_cast<double>(usable_bytes));
  return mb;
}

// Equal slices of `records` (in the given order) of at most `max_size` each; sizes differ by at
// most one. Returns false (and leaves `out` untouched) if a slice is predicted over budget,
// which only happens when the model is not monotone in the dims.
bool equal_slices(RecordDimsView record_dims, const std::vector<std::size_t>& records, std::int64_t max_size,
                  const MemoryModel& model, std::int64_t usable_bytes, std::vector<Microbatch>& out) {
  const std::size_t n = records.size();
  const std::size_t m = static_cast<std::size_t>(max_size);
  const std::size_t k = (n + m - 1) / m;
  const std::size_t base = n / k;
  const std::size_t extra = n % k;  // the first `extra` slices get one more record
  std::vector<Microbatch> slices;
  slices.reserve(k);
  std::size_t begin = 0;
  for (std::size_t s = 0; s < k; ++s) {
    const std::size_t size = base + (s < extra ? 1 : 0);
    std::vector<std::size_t> indices(records.begin() + static_cast<std::ptrdiff_t>(begin),
                                     records.begin() + static_cast<std::ptrdiff_t>(begin + size));
    begin += size;
    std::vector<double> dims = aggregate_dims(record_dims, indices, model);
    Microbatch mb = make_microbatch(std::move(indices), std::move(dims), model, usable_bytes);
    if (mb.over_budget) return false;
    slices.push_back(std::move(mb));
  }
  for (Microbatch& mb : slices) out.push_back(std::move(mb));
  return true;
}

// Record indices by `keys` (the first, then the next among equals, ...), largest first, stable.
std::vector<std::size_t> lexicographic_descending_order(RecordDimsView view, const std::vector<std::size_t>& keys) {
  std::vector<std::size_t> order(view.records);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    for (std::size_t key : keys) {
      const double x = view.row(a)[key], y = view.row(b)[key];
      if (x != y) return x > y;
    }
    return false;
  });
  return order;
}

// With summed variables: the largest m such that any m of `records` fit, i.e. m records with
// the largest max dims and, per summed variable, the sum of its m largest values (0: none fits).
std::int64_t largest_uniform_size(RecordDimsView record_dims, const std::vector<std::size_t>& records,
                                  const MemoryModel& model, double usable_bytes) {
  const std::vector<double> all = aggregate_dims(record_dims, records, model);
  const auto& aggregation = model.aggregation();
  std::vector<std::vector<double>> top_sums(aggregation.size());  // [v][m]: sum of the m largest
  for (std::size_t v = 0; v < aggregation.size(); ++v) {
    if (aggregation[v] != DimAggregation::kSum) continue;
    std::vector<double> values;
    for (std::size_t i : records) values.push_back(record_dims.row(i)[v]);
    std::sort(values.rbegin(), values.rend());
    top_sums[v].assign(1, 0.0);
    for (double value : values) top_sums[v].push_back(top_sums[v].back() + value);
  }
  const auto fits_at = [&](std::size_t m) {
    std::vector<double> dims = all;
    dims[model.batch_size_index()] = static_cast<double>(m);
    for (std::size_t v = 0; v < dims.size(); ++v) {
      if (aggregation[v] == DimAggregation::kSum) dims[v] = top_sums[v][m];
    }
    return model.fits(dims, usable_bytes);
  };
  std::size_t lo = 0, hi = records.size() + 1;  // fits_at(lo) (or lo = 0), !fits_at(hi)
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (fits_at(mid) ? lo : hi) = mid;
  }
  return static_cast<std::int64_t>(lo);
}

// Uniform slicing of `records`: one size from their aggregated dims. False if even one record
// at those dims is over budget (or a slice is, for a non-monotone model).
bool try_uniform(RecordDimsView record_dims, const std::vector<std::size_t>& records, const MemoryModel& model,
                 std::int64_t usable_bytes, std::vector<Microbatch>& out) {
  if (records.empty()) return true;
  std::vector<double> dims = aggregate_dims(record_dims, records, model);
  dims[model.batch_size_index()] = 1;
  const auto& aggregation = model.aggregation();
  const bool summed = std::find(aggregation.begin(), aggregation.end(), DimAggregation::kSum) != aggregation.end();
  if (summed) {
    const std::int64_t m = largest_uniform_size(record_dims, records, model, static_cast<double>(usable_bytes));
    return m > 0 && equal_slices(record_dims, records, m, model, usable_bytes, out);
  }
  if (!model.fits(dims, static_cast<double>(usable_bytes))) return false;
  const std::int64_t m = model.max_microbatch_size(dims, usable_bytes,
                                                   static_cast<std::int64_t>(records.size()));
  return equal_slices(record_dims, records, m, model, usable_bytes, out);
}

// Sets `guard` to the packer adapting one pack() overload to the other on this thread, and
// back when the adapted call returns: reentering the same adaptation means the packer overrides
// neither overload (each default would call the other forever).
class AdaptationGuard {
 public:
  AdaptationGuard(const MicrobatchPacker* packer, const char* overload) : previous_(adapting_) {
    if (adapting_ == packer) {
      throw std::logic_error("packer '" + packer->name() + "' overrides neither pack(RecordDimsView, ...) nor "
                             "pack(const std::vector<std::vector<double>>&, ...); override one (called: " +
                             overload + ")");
    }
    adapting_ = packer;
  }
  AdaptationGuard(const AdaptationGuard&) = delete;
  AdaptationGuard& operator=(const AdaptationGuard&) = delete;
  ~AdaptationGuard() { adapting_ = previous_; }

 private:
  static thread_local const MicrobatchPacker* adapting_;
  const MicrobatchPacker* previous_;
};

thread_local const MicrobatchPacker* AdaptationGuard::adapting_ = nullptr;

}  // namespace

std::vector<double> aggregate_dims(RecordDimsView record_dims, const std::vector<std::size_t>& indices,
                                   const MemoryModel& model) {
  return aggregate_dims(record_dims, indices, model.aggregation());
}

std::vector<double> aggregate_dims(RecordDimsView record_dims, const std::vector<std::size_t>& indices,
                                   const std::vector<DimAggregation>& agg) {
  const std::size_t nv = agg.size();
  if (record_dims.variables != nv) {
    throw std::invalid_argument("aggregate_dims: record dims have " + std::to_string(record_dims.variables) +
                                " value(s) per record, expected " + std::to_string(nv));
  }
  std::vector<double> dims(nv, 0.0);
  for (std::size_t v = 0; v < nv; ++v) {
    if (agg[v] == DimAggregation::kCount) dims[v] = static_cast<double>(indices.size());
  }
  bool first = true;
  for (std::size_t i : indices) {
    if (i >= record_dims.records) {
      throw std::invalid_argument("aggregate_dims: record index " + std::to_string(i) +
                                  " out of range (" + std::to_string(record_dims.records) +
                                  " records)");
    }
    const double* r = record_dims.row(i);
    for (std::size_t v = 0; v < nv; ++v) {
      if (agg[v] == DimAggregation::kMax) dims[v] = first ? r[v] : std::max(dims[v], r[v]);
      if (agg[v] == DimAggregation::kSum) dims[v] += r[v];
    }
    first = false;
  }
  return dims;
}

std::vector<double> aggregate_dims(const std::vector<std::vector<double>>& record_dims,
                                   const std::vector<std::size_t>& indices,
                                   const MemoryModel& model) {
  // Only the listed records are read (a view of all of them would copy every record): their
  // dims, checked, copied contiguously, then aggregated as a view of `indices.size()` rows.
  const std::size_t nv = model.formula().variable_names().size();
  std::vector<double> rows;
  rows.reserve(indices.size() * nv);
  for (std::size_t i : indices) {
    if (i >= record_dims.size()) {
      throw std::invalid_argument("aggregate_dims: record index " + std::to_string(i) +
                                  " out of range (" + std::to_string(record_dims.size()) +
                                  " records)");
    }
    const std::vector<double>& r = record_dims[i];
    if (r.size() != nv) {
      throw std::invalid_argument("aggregate_dims: record " + std::to_string(i) + " has " +
                                  std::to_string(r.size()) + " dims, expected " +
                                  std::to_string(nv));
    }
    rows.insert(rows.end(), r.begin(), r.end());
  }
  std::vector<std::size_t> positions(indices.size());
  std::iota(positions.begin(), positions.end(), std::size_t{0});
  return aggregate_dims(RecordDimsView(rows.data(), indices.size(), nv), positions, model);
}

// ---------------------------------------------------------------------------------------------
// MicrobatchPacker: each overload's default adapts its input to the other.

MicrobatchPlan MicrobatchPacker::pack(RecordDimsView record_dims, const MemoryModel& model,
                                      std::int64_t usable_bytes) const {
  const AdaptationGuard guard(this, "pack(RecordDimsView, ...)");
  std::vector<std::vector<double>> rows(record_dims.records);
  for (std::size_t i = 0; i < record_dims.records; ++i) {
    rows[i].assign(record_dims.row(i), record_dims.row(i) + record_dims.variables);
  }
  return pack(rows, model, usable_bytes);
}

MicrobatchPlan MicrobatchPacker::pack(const std::vector<std::vector<double>>& record_dims,
                                      const MemoryModel& model, std::int64_t usable_bytes) const {
  const AdaptationGuard guard(this, "pack(const std::vector<std::vector<double>>&, ...)");
  const std::vector<double> dims = packer_internal::contiguous_dims(record_dims, model, usable_bytes);
  return pack(RecordDimsView(dims.data(), record_dims.size(), model.formula().variable_names().size()), model,
              usable_bytes);
}

// ---------------------------------------------------------------------------------------------
// UniformPacker. If one record at the whole batch's dims does not fit, the batch is handled per
// record: records that do not fit alone become over-budget microbatches of their own, the others
// are sliced uniformly at their own aggregated dims (or, if even that does not fit, delivered
// one per microbatch). Microbatches are then ordered by their first record index.

MicrobatchPlan UniformPacker::pack(RecordDimsView record_dims, const MemoryModel& model,
                                   std::int64_t usable_bytes) const {
  validate_pack_inputs(record_dims, model, usable_bytes);
  MicrobatchPlan plan;
  std::vector<std::size_t> all(record_dims.records);
  std::iota(all.begin(), all.end(), std::size_t{0});
  if (try_uniform(record_dims, all, model, usable_bytes, plan.microbatches)) return plan;

  // Fallback: per-record handling.
  std::vector<std::size_t> fitting;
  for (std::size_t i : all) {
    std::vector<double> dims = aggregate_dims(record_dims, {i}, model);
    Microbatch alone = make_microbatch({i}, std::move(dims), model, usable_bytes);
    if (alone.over_budget) {
      plan.over_budget_records.push_back(i);
      plan.microbatches.push_back(std::move(alone));
    } else {
      fitting.push_back(i);
    }
  }
  if (!try_uniform(record_dims, fitting, model, usable_bytes, plan.microbatches)) {
    for (std::size_t i : fitting) {
      plan.microbatches.push_back(
          make_microbatch({i}, aggregate_dims(record_dims, {i}, model), model, usable_bytes));
    }
  }
  std::stable_sort(plan.microbatches.begin(), plan.microbatches.end(),
                   [](const Microbatch& a, const Microbatch& b) {
                     return a.record_indices.front() < b.record_indices.front();
                   });
  return plan;
}

// ---------------------------------------------------------------------------------------------
// AdaptivePacker

void AdaptivePackerOptions::validate() const {
  if (sort_by.empty()) return;
  const std::string padded = "," + sort_by + ",";
  if (padded.find(",,") != std::string::npos) {
    throw std::invalid_argument("AdaptivePackerOptions.sort_by '" + sort_by + "' has an empty variable name");
  }
}

AdaptivePacker::AdaptivePacker(AdaptivePackerOptions options) : options_(std::move(options)) { options_.validate(); }

// The variables of sort_by ("l", or "h,w": by h, then by w among equal h), by index.
std::vector<std::size_t> AdaptivePacker::sort_keys(const MemoryModel& model) const {
  const auto& vars = model.formula().variable_names();
  std::vector<std::size_t> keys;
  std::size_t begin = 0;
  while (begin <= options_.sort_by.size()) {
    const std::size_t comma = std::min(options_.sort_by.find(',', begin), options_.sort_by.size());
    std::string name = options_.sort_by.substr(begin, comma - begin);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    begin = comma + 1;
    const auto it = std::find(vars.begin(), vars.end(), name);
    if (it == vars.end()) {
      throw std::invalid_argument("AdaptivePacker: sort_by '" + name + "' is not a variable of the formula");
    }
    const std::size_t key = static_cast<std::size_t>(it - vars.begin());
    if (key == model.batch_size_index()) {
      throw std::invalid_argument("AdaptivePacker: sort_by '" + name +
                                  "' is the batch-size variable; sort by a record dimension");
    }
    keys.push_back(key);
  }
  return keys;
}

std::string AdaptivePacker::name() const {
  return options_.sort_by.empty() ? "adaptive" : "adaptive(sort_by=" + options_.sort_by + ")";
}

MicrobatchPlan AdaptivePacker::pack(RecordDimsView record_dims, const MemoryModel& model,
                                    std::int64_t usable_bytes) const {
  validate_pack_inputs(record_dims, model, usable_bytes);
  const std::size_t nv = record_dims.variables;
  const std::size_t n = record_dims.records;
  // The records' dims in the order they are visited, contiguous: the view itself in record
  // order (row width nv, variable v at column v). When sorting, a sorted copy of only the
  // columns the aggregation reads (not the count's), so the one pass that sorts writes as little
  // as it can (for {bs, l}: the lengths); reading the view in sorted order instead would miss
  // the cache on nearly every record of a large outer batch.
  const double* dims = record_dims.data;
  std::size_t width = nv;
  std::vector<std::size_t> column(nv);
  std::iota(column.begin(), column.end(), std::size_t{0});
  std::vector<double> sorted_dims;
  std::vector<std::size_t> order;
  if (!options_.sort_by.empty()) {
    const std::vector<std::size_t> keys = sort_keys(model);
    std::vector<std::size_t> read;  // the variables whose values the aggregation reads
    for (std::size_t v = 0; v < nv; ++v) {
      if (model.aggregation()[v] != DimAggregation::kCount) {
        column[v] = read.size();
        read.push_back(v);
      }
    }
    if (keys.size() == 1) {
      packer_internal::sort_rows_descending(record_dims, keys.front(), read, order, sorted_dims);
    } else {
      order = lexicographic_descending_order(record_dims, keys);
      sorted_dims.reserve(n * read.size());
      for (std::size_t i : order) {
        for (std::size_t v : read) sorted_dims.push_back(record_dims.row(i)[v]);
      }
    }
    dims = sorted_dims.data();
    width = read.size();
  }

  const packer_internal::FitTest fits(model, static_cast<double>(usable_bytes));
  MicrobatchPlan plan;
  RunningDims current(model, std::move(column));
  std::vector<std::size_t> current_indices;
  std::vector<double> trial(nv);
  auto close_current = [&] {
    if (current_indices.empty()) return;
    const std::size_t size = current_indices.size();
    Microbatch mb;
    mb.record_indices = std::move(current_indices);
    current_indices = std::vector<std::size_t>();
    current_indices.reserve(size);  // the next one is likely as large (fewer reallocations)
    mb.dims = current.dims();
    mb.predicted_bytes = model.predict_bytes(mb.dims);
    plan.microbatches.push_back(std::move(mb));
    current_indices.clear();
    current.clear();
  };

  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = order.empty() ? k : order[k];
    const double* record = dims + k * width;
    current.with(record, trial);
    if (fits(trial)) {
      current.add(trial);
      current_indices.push_back(i);
      continue;
    }
    if (!current_indices.empty()) {
      close_current();
      current.with(record, trial);
      if (fits(trial)) {
        current.add(trial);
        current_indices.push_back(i);
        continue;
      }
    }
    // Does not fit even alone: its own microbatch, reported.
    Microbatch lone = make_microbatch({i}, trial, model, usable_bytes);
    lone.over_budget = true;
    plan.over_budget_records.push_back(i);
    plan.microbatches.push_back(std::move(lone));
  }
  close_current();
  return plan;
}

}  // namespace xpm

namespace xpm {

std::vector<std::vector<double>> record_dims_from_lengths(const std::vector<double>& lengths, const std::vector<std::string>& variables,
                                             const std::string& batch_size_variable) {
  const auto bs = std::find(variables.begin(), variables.end(), batch_size_variable);
  if (bs == variables.end()) {
    throw std::invalid_argument("record_dims_from_lengths: the variables lack the batch size '" + batch_size_variable + "'");
  }
  if (variables.size() < 2) {
    throw std::invalid_argument("record_dims_from_lengths: no variable besides the batch size '" + batch_size_variable + "'");
  }
  std::vector<std::vector<double>> dims;
  dims.reserve(lengths.size());
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    if (!(std::isfinite(lengths[i]) && lengths[i] >= 0)) {
      throw std::invalid_argument("record_dims_from_lengths: length " + std::to_string(i) + " is " +
                                  std::to_string(lengths[i]) + ", expected a finite value >= 0");
    }
    std::vector<double>& record = dims.emplace_back();
    for (const std::string& variable : variables) record.push_back(variable == batch_size_variable ? 1.0 : lengths[i]);
  }
  return dims;
}

}  // namespace xpm
