// packer_test.cpp — UniformPacker and AdaptivePacker: coverage, budgets, sorting, over-budget;
// packing a RecordDimsView and one vector per record alike.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "xpm/planner/ffd_packer.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/record_dims_view.hpp"

using xpm::AdaptivePacker;
using xpm::AdaptivePackerOptions;
using xpm::CostFormula;
using xpm::DimAggregation;
using xpm::MemoryModel;
using xpm::MicrobatchPlan;
using xpm::UniformPacker;

namespace {

using Records = std::vector<std::vector<double>>;

// a*bs*l^2 with a = 1; variables (bs, l), l aggregated by max.
MemoryModel square_model() {
  return MemoryModel(CostFormula("a*bs*l^2", {"a"}, {"bs", "l"}), {1.0}, 0, "bs",
                     {{"l", DimAggregation::kMax}});
}

// a*bs*l^2 + b*bs*l + c with positive coefficients.
MemoryModel quadratic_model() {
  return MemoryModel(CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
                     {2.0, 64.0, 5000.0}, 0, "bs", {{"l", DimAggregation::kMax}});
}

Records records_of_lengths(const std::vector<double>& lengths) {
  Records r;
  for (double l : lengths) r.push_back({0.0, l});  // batch-size entry ignored
  return r;
}

AdaptivePacker sorted_by(const std::string& variable) {
  AdaptivePackerOptions options;
  options.sort_by = variable;
  return AdaptivePacker(options);
}

// Every record index appears in exactly one microbatch.
void check_each_record_once(const MicrobatchPlan& plan, std::size_t n) {
  std::vector<int> seen(n, 0);
  for (const auto& mb : plan.microbatches) {
    CHECK_FALSE(mb.record_indices.empty());
    for (std::size_t i : mb.record_indices) {
      REQUIRE(i < n);
      ++seen[i];
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(seen[i] == 1);
  }
}

// Microbatches not marked over budget are predicted within budget; marked ones are lone records.
void check_budget_respected(const MicrobatchPlan& plan, std::int64_t usable_bytes) {
  for (const auto& mb : plan.microbatches) {
    if (mb.over_budget) {
      CHECK(mb.record_indices.size() == 1);
      CHECK(mb.predicted_bytes > static_cast<double>(usable_bytes));
      CHECK(std::count(plan.over_budget_records.begin(), plan.over_budget_records.end(),
                       mb.record_indices[0]) == 1);
    } else {
      CHECK(mb.predicted_bytes <= static_cast<double>(usable_bytes));
    }
  }
}

}  // namespace

TEST_CASE("uniform packer cuts 10 records with max size 4 into slices of 4, 3 and 3") {
  const MemoryModel model = square_model();
  const Records records = records_of_lengths(std::vector<double>(10, 8.0));
  const auto budget = static_cast<std::int64_t>(4 * 8 * 8);  // 4 records fit, 5 do not
  const MicrobatchPlan plan = UniformPacker().pack(records, model, budget);
  REQUIRE(plan.microbatches.size() == 3);
  CHECK(plan.microbatches[0].record_indices == std::vector<std::size_t>{0, 1, 2, 3});
  CHECK(plan.microbatches[1].record_indices == std::vector<std::size_t>{4, 5, 6});
  CHECK(plan.microbatches[2].record_indices == std::vector<std::size_t>{7, 8, 9});
  CHECK(plan.microbatches[0].dims == std::vector<double>{4, 8});
  CHECK(plan.microbatches[0].predicted_bytes == 256);
  CHECK(plan.over_budget_records.empty());
}

TEST_CASE("uniform packer slice sizes differ by at most one and respect the max size") {
  const MemoryModel model = square_model();
  for (std::size_t n = 1; n <= 40; ++n) {
    for (std::int64_t max_fit = 1; max_fit <= 12; ++max_fit) {
      const Records records = records_of_lengths(std::vector<double>(n, 2.0));
      const MicrobatchPlan plan = UniformPacker().pack(records, model, max_fit * 4);
      const std::size_t m = static_cast<std::size_t>(max_fit);
      CAPTURE(n);
      CAPTURE(max_fit);
      CHECK(plan.microbatches.size() == (n + m - 1) / m);
      std::size_t smallest = n, largest = 0;
      for (const auto& mb : plan.microbatches) {
        smallest = std::min(smallest, mb.record_indices.size());
        largest = std::max(largest, mb.record_indices.size());
      }
      CHECK(largest - smallest <= 1);
      CHECK(largest <= m);
      check_each_record_once(plan, n);
    }
  }
}

TEST_CASE("uniform packer sizes microbatches from the longest record of the outer batch") {
  const MemoryModel model = square_model();
  const Records records = records_of_lengths({8, 8, 8, 16, 8, 8});
  // One 16-record costs 256: the budget allows 2 at l = 16, so 3 slices of 2.
  const MicrobatchPlan plan = UniformPacker().pack(records, model, 2 * 256);
  CHECK(plan.microbatches.size() == 3);
  check_budget_respected(plan, 2 * 256);
}

TEST_CASE("uniform packer reports an over-budget record and still delivers the others") {
  const MemoryModel model = square_model();
  const Records records = records_of_lengths({8, 8, 100, 8, 8});
  const std::int64_t budget = 2 * 64;  // two records of length 8 fit; the 100 never does
  const MicrobatchPlan plan = UniformPacker().pack(records, model, budget);
  CHECK(plan.over_budget_records == std::vector<std::size_t>{2});
  check_each_record_once(plan, records.size());
  check_budget_respected(plan, budget);
  CHECK(plan.microbatches.size() == 3);  // {0,1}, {2} over budget, {3,4}
}

TEST_CASE("uniform packer returns an empty plan for an empty outer batch") {
  const MicrobatchPlan plan = UniformPacker().pack({}, square_model(), 100);
  CHECK(plan.microbatches.empty());
  CHECK(plan.over_budget_records.empty());
}

TEST_CASE("adaptive packer fills four long and sixteen short records into exactly two microbatches") {
  std::vector<double> lengths(4, 128.0);
  lengths.insert(lengths.end(), 16, 32.0);
  const MicrobatchPlan plan =
      AdaptivePacker().pack(records_of_lengths(lengths), square_model(), 4 * 128 * 128);
  REQUIRE(plan.microbatches.size() == 2);
  CHECK(plan.microbatches[0].record_indices.size() == 4);
  CHECK(plan.microbatches[0].dims == std::vector<double>{4, 128});
  CHECK(plan.microbatches[1].record_indices.size() == 16);
  CHECK(plan.microbatches[1].dims == std::vector<double>{16, 32});
  CHECK(plan.microbatches[1].predicted_bytes == 16 * 32 * 32);
  CHECK(plan.over_budget_records.empty());
}

TEST_CASE("adaptive packer sorting never increases the microbatch count") {
  const MemoryModel model = quadratic_model();
  for (unsigned seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> count(1, 80);
    std::lognormal_distribution<double> length(4.0, 0.8);
    std::vector<double> lengths(static_cast<std::size_t>(count(rng)));
    for (double& l : lengths) l = std::max(1.0, std::round(length(rng)));
    const Records records = records_of_lengths(lengths);
    std::uniform_int_distribution<std::int64_t> budget_dist(20000, 4000000);
    const std::int64_t budget = budget_dist(rng);

    const MicrobatchPlan unsorted = AdaptivePacker().pack(records, model, budget);
    const MicrobatchPlan sorted = sorted_by("l").pack(records, model, budget);
    CAPTURE(seed);
    CHECK(sorted.microbatches.size() <= unsorted.microbatches.size());
    check_each_record_once(sorted, records.size());
    check_budget_respected(sorted, budget);
  }
}

TEST_CASE("adaptive packer sorts heaviest records first and keeps ties in record order") {
  const MicrobatchPlan plan = sorted_by("l").pack(records_of_lengths({4, 9, 4, 9, 1}),
                                                  square_model(), 1 << 20);
  REQUIRE(plan.microbatches.size() == 1);
  CHECK(plan.microbatches[0].record_indices == std::vector<std::size_t>{1, 3, 0, 2, 4});
}

TEST_CASE("every packer delivers all 17 records exactly once under any budget") {
  const MemoryModel model = quadratic_model();
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> length(1, 300);
  std::vector<double> lengths(17);
  for (double& l : lengths) l = length(rng);
  const Records records = records_of_lengths(lengths);
  const UniformPacker uniform;
  const AdaptivePacker adaptive;
  const AdaptivePacker adaptive_sorted = sorted_by("l");
  for (std::int64_t budget = 1; budget < 40000000; budget = budget * 3 / 2 + 1) {
    for (const xpm::MicrobatchPacker* packer :
         {static_cast<const xpm::MicrobatchPacker*>(&uniform),
          static_cast<const xpm::MicrobatchPacker*>(&adaptive),
          static_cast<const xpm::MicrobatchPacker*>(&adaptive_sorted)}) {
      CAPTURE(budget);
      CAPTURE(packer->name());
      const MicrobatchPlan plan = packer->pack(records, model, budget);
      check_each_record_once(plan, records.size());
      check_budget_respected(plan, budget);
    }
  }
}

TEST_CASE("adaptive packer reports an over-budget record and delivers it exactly once") {
  const Records records = records_of_lengths({8, 8, 100, 8, 8});
  const std::int64_t budget = 4 * 64;
  const MicrobatchPlan plan = AdaptivePacker().pack(records, square_model(), budget);
  CHECK(plan.over_budget_records == std::vector<std::size_t>{2});
  check_each_record_once(plan, records.size());
  check_budget_respected(plan, budget);
  REQUIRE(plan.microbatches.size() == 3);
  CHECK(plan.microbatches[1].over_budget);
  CHECK(plan.microbatches[1].predicted_bytes == 100 * 100);
}

TEST_CASE("adaptive packer rejects sorting by an unknown or the batch-size variable") {
  const Records records = records_of_lengths({8, 8});
  CHECK_THROWS_WITH_AS(sorted_by("len").pack(records, square_model(), 1000),
                       doctest::Contains("'len'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(sorted_by("bs").pack(records, square_model(), 1000),
                       doctest::Contains("batch-size"), std::invalid_argument);
}

TEST_CASE("packers reject records with the wrong number of dims and a non-positive budget") {
  const Records bad = {{0.0, 8.0}, {8.0}};
  CHECK_THROWS_WITH_AS(AdaptivePacker().pack(bad, square_model(), 1000),
                       doctest::Contains("record 1"), std::invalid_argument);
  CHECK_THROWS_AS(UniformPacker().pack(bad, square_model(), 1000), std::invalid_argument);
  CHECK_THROWS_AS(UniformPacker().pack(records_of_lengths({8}), square_model(), 0),
                  std::invalid_argument);
}

TEST_CASE("aggregate dims count records, take the max and sum as declared") {
  const MemoryModel model(CostFormula("a*bs*l + b*t", {"a", "b"}, {"bs", "l", "t"}), {1, 1}, 0,
                          "bs", {{"t", DimAggregation::kSum}});
  const Records records = {{0, 5, 10}, {0, 9, 20}, {0, 7, 30}};
  CHECK(xpm::aggregate_dims(records, {0, 2}, model) == std::vector<double>{2, 7, 40});
  CHECK(xpm::aggregate_dims(records, {0, 1, 2}, model) == std::vector<double>{3, 9, 60});
}

TEST_CASE("adaptive packer with a sum dimension matches the aggregated dims it reports") {
  const MemoryModel model(CostFormula("a*bs + b*t", {"a", "b"}, {"bs", "t"}), {100, 1}, 0, "bs",
                          {{"t", DimAggregation::kSum}});
  Records records;
  for (int i = 0; i < 50; ++i) records.push_back({0, static_cast<double>(10 + i % 7)});
  const MicrobatchPlan plan = AdaptivePacker().pack(records, model, 1000);
  check_each_record_once(plan, records.size());
  check_budget_respected(plan, 1000);
  for (const auto& mb : plan.microbatches) {
    CHECK(mb.dims == xpm::aggregate_dims(records, mb.record_indices, model));
  }
}

TEST_CASE("500 records of length 1 and 8 of maximum length pack densely, each microbatch in budget") {
  // Per-record overhead (b*bs*l) and the quadratic term (a*bs*l^2) both matter here; the
  // coefficients are the bundled tagger's fitted ones (bytes).
  const xpm::MemoryModel model(
      xpm::CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
      {96.0, 25811.8, 49091683.6}, 69570620.0, "bs");
  std::vector<std::vector<double>> records(500, std::vector<double>{1, 1});
  for (int i = 0; i < 8; ++i) records.push_back({1, 180});
  const std::int64_t budget = 88363094;
  const xpm::MicrobatchPlan adaptive =
      xpm::AdaptivePacker(xpm::AdaptivePackerOptions{"l"}).pack(records, model, budget);
  const xpm::MicrobatchPlan uniform = xpm::UniformPacker().pack(records, model, budget);
  std::vector<int> seen(records.size(), 0);
  for (const auto& mb : adaptive.microbatches) {
    CHECK(mb.predicted_bytes <= budget);
    for (std::size_t i : mb.record_indices) ++seen[i];
  }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  CHECK(adaptive.over_budget_records.empty());
  // 8 long records need 2 microbatches (at most 6 fit at l = 180); the 500 short ones 1.
  CHECK(adaptive.microbatches.size() == 3);
  CHECK(uniform.microbatches.size() > 50);  // one size for all, set by l = 180
}

namespace {

// The records' dims one after the other: the buffer a RecordDimsView reads.
std::vector<double> contiguous(const Records& records) {
  std::vector<double> out;
  for (const auto& r : records) out.insert(out.end(), r.begin(), r.end());
  return out;
}

void check_same_plan(const MicrobatchPlan& a, const MicrobatchPlan& b) {
  REQUIRE(a.microbatches.size() == b.microbatches.size());
  for (std::size_t m = 0; m < a.microbatches.size(); ++m) {
    CAPTURE(m);
    CHECK(a.microbatches[m].record_indices == b.microbatches[m].record_indices);
    CHECK(a.microbatches[m].dims == b.microbatches[m].dims);
    CHECK(a.microbatches[m].predicted_bytes == b.microbatches[m].predicted_bytes);
    CHECK(a.microbatches[m].over_budget == b.microbatches[m].over_budget);
  }
  CHECK(a.over_budget_records == b.over_budget_records);
}

// Next fit over the records in the stable descending order of variable `key`, from
// aggregate_dims and MemoryModel::fits alone: what AdaptivePacker(sort_by) must give.
std::vector<std::vector<std::size_t>> reference_sorted_next_fit(const Records& records, std::size_t key,
                                                                const MemoryModel& model, std::int64_t budget) {
  std::vector<std::size_t> order(records.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return records[a][key] > records[b][key]; });
  const auto fits = [&](const std::vector<std::size_t>& indices) {
    return model.fits(xpm::aggregate_dims(records, indices, model), static_cast<double>(budget));
  };
  std::vector<std::vector<std::size_t>> out;
  std::vector<std::size_t> current;
  for (std::size_t i : order) {
    std::vector<std::size_t> grown = current;
    grown.push_back(i);
    if (fits(grown)) {
      current = grown;
      continue;
    }
    if (!current.empty()) out.push_back(current);
    current.clear();
    if (fits({i})) {
      current = {i};
    } else {
      out.push_back({i});  // over budget alone
    }
  }
  if (!current.empty()) out.push_back(current);
  return out;
}

// Packs one microbatch per record and implements only the vector-per-record overload, as a
// packer written before RecordDimsView does.
class OnePerRecordPacker : public xpm::MicrobatchPacker {
 public:
  using xpm::MicrobatchPacker::pack;
  MicrobatchPlan pack(const Records& record_dims, const MemoryModel& model, std::int64_t) const override {
    MicrobatchPlan plan;
    for (std::size_t i = 0; i < record_dims.size(); ++i) {
      xpm::Microbatch mb;
      mb.record_indices = {i};
      mb.dims = xpm::aggregate_dims(record_dims, {i}, model);
      mb.predicted_bytes = model.predict_bytes(mb.dims);
      plan.microbatches.push_back(std::move(mb));
    }
    return plan;
  }
  std::string name() const override { return "one_per_record"; }
};

// Overrides neither pack() overload.
class NamelessPacker : public xpm::MicrobatchPacker {
 public:
  std::string name() const override { return "nameless"; }
};

}  // namespace

TEST_CASE("every packer gives the same plan from a view of 3,000 records as from one vector per record") {
  // Three variables, l aggregated by max and t summed, so every aggregation is exercised; the
  // view reads the same values in place.
  const MemoryModel model(CostFormula("a*bs*l^2 + b*bs*l + d*t + c", {"a", "b", "c", "d"}, {"bs", "l", "t"}),
                          {2.0, 64.0, 5000.0, 3.0}, 0, "bs",
                          {{"l", DimAggregation::kMax}, {"t", DimAggregation::kSum}});
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> length(1, 400);
  Records records;
  for (int i = 0; i < 3000; ++i) {
    const double l = length(rng);
    records.push_back({1.0, l, l - 1});
  }
  const std::vector<double> flat = contiguous(records);
  const xpm::RecordDimsView view(flat.data(), records.size(), 3);
  REQUIRE(view(2, 1) == records[2][1]);
  REQUIRE(view.row(2)[2] == records[2][2]);
  const UniformPacker uniform;
  const AdaptivePacker adaptive;
  const AdaptivePacker adaptive_sorted = sorted_by("l");
  const AdaptivePacker adaptive_sorted_t = sorted_by("t");
  for (const std::int64_t budget : {std::int64_t{60000}, std::int64_t{3000000}, std::int64_t{90000000}}) {
    for (const xpm::MicrobatchPacker* packer :
         {static_cast<const xpm::MicrobatchPacker*>(&uniform), static_cast<const xpm::MicrobatchPacker*>(&adaptive),
          static_cast<const xpm::MicrobatchPacker*>(&adaptive_sorted),
          static_cast<const xpm::MicrobatchPacker*>(&adaptive_sorted_t)}) {
      CAPTURE(budget);
      CAPTURE(packer->name());
      const MicrobatchPlan from_view = packer->pack(view, model, budget);
      const MicrobatchPlan from_rows = packer->pack(records, model, budget);
      check_same_plan(from_view, from_rows);
      check_each_record_once(from_view, records.size());
      check_budget_respected(from_view, budget);
      for (const auto& mb : from_view.microbatches) {
        CHECK(mb.dims == xpm::aggregate_dims(view, mb.record_indices, model));
      }
    }
    // The sorted packers read only the columns they aggregate (l and t here), sorted by l or t.
    for (const auto& [packer, key] : {std::make_pair(&adaptive_sorted, std::size_t{1}),
                                      std::make_pair(&adaptive_sorted_t, std::size_t{2})}) {
      CAPTURE(key);
      const MicrobatchPlan plan = packer->pack(view, model, budget);
      const auto expected = reference_sorted_next_fit(records, key, model, budget);
      REQUIRE(plan.microbatches.size() == expected.size());
      for (std::size_t m = 0; m < expected.size(); ++m) CHECK(plan.microbatches[m].record_indices == expected[m]);
    }
  }
}

TEST_CASE("a view's record dims are checked: its width, finite dims >= 0, a positive budget") {
  const std::vector<double> three_wide = {1, 8, 0, 1, 9, 0};
  CHECK_THROWS_WITH_AS(AdaptivePacker().pack(xpm::RecordDimsView(three_wide.data(), 2, 3), square_model(), 1000),
                       doctest::Contains("3 value(s) per record, expected 2"), std::invalid_argument);
  CHECK_THROWS_AS(UniformPacker().pack(xpm::RecordDimsView(three_wide.data(), 2, 3), square_model(), 1000),
                  std::invalid_argument);
  const std::vector<double> infinite = {1, 8, 1, 9, 1, std::numeric_limits<double>::infinity()};
  CHECK_THROWS_WITH_AS(sorted_by("l").pack(xpm::RecordDimsView(infinite.data(), 3, 2), square_model(), 1000),
                       doctest::Contains("record 2 has l"), std::invalid_argument);
  const std::vector<double> negative = {1, 8, 1, -9};  // planned before, under-predicted
  CHECK_THROWS_WITH_AS(AdaptivePacker().pack(xpm::RecordDimsView(negative.data(), 2, 2), square_model(), 1000),
                       doctest::Contains("record 1 has l = -9; dims must be finite and >= 0"),
                       std::invalid_argument);
  const std::vector<double> lengths = {1, 8, 1, 9};
  CHECK_THROWS_WITH_AS(UniformPacker().pack(xpm::RecordDimsView(lengths.data(), 2, 2), square_model(), 0),
                       doctest::Contains("usable_bytes"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(AdaptivePacker().pack(xpm::RecordDimsView(nullptr, 2, 2), square_model(), 1000),
                       doctest::Contains("no data"), std::invalid_argument);
  // The batch-size entry is not read: NaN there packs as 1 does.
  const std::vector<double> nan_count = {std::nan(""), 8, std::nan(""), 9};
  check_same_plan(AdaptivePacker().pack(xpm::RecordDimsView(nan_count.data(), 2, 2), square_model(), 200),
                  AdaptivePacker().pack(xpm::RecordDimsView(lengths.data(), 2, 2), square_model(), 200));
  // No records: no microbatches, from a null buffer too.
  CHECK(sorted_by("l").pack(xpm::RecordDimsView(nullptr, 0, 2), square_model(), 1000).microbatches.empty());
  CHECK(UniformPacker().pack(xpm::RecordDimsView(nullptr, 0, 2), square_model(), 1000).microbatches.empty());
}

TEST_CASE("aggregate dims over a view equal those over vectors and reject an index out of range") {
  const MemoryModel model(CostFormula("a*bs*l + b*t", {"a", "b"}, {"bs", "l", "t"}), {1, 1}, 0,
                          "bs", {{"t", DimAggregation::kSum}});
  const Records records = {{0, 5, 10}, {0, 9, 20}, {0, 7, 30}};
  const std::vector<double> flat = contiguous(records);
  const xpm::RecordDimsView view(flat.data(), 3, 3);
  CHECK(xpm::aggregate_dims(view, {0, 2}, model) == std::vector<double>{2, 7, 40});
  CHECK(xpm::aggregate_dims(view, {2, 1, 0}, model) == xpm::aggregate_dims(records, {2, 1, 0}, model));
  CHECK(xpm::aggregate_dims(view, {}, model) == std::vector<double>{0, 0, 0});
  CHECK_THROWS_WITH_AS(xpm::aggregate_dims(view, {3}, model), doctest::Contains("record index 3 out of range"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::aggregate_dims(xpm::RecordDimsView(flat.data(), 4, 2), {0}, model),
                       doctest::Contains("2 value(s) per record, expected 3"), std::invalid_argument);
}

TEST_CASE("a packer implementing only the vector overload packs a view; one implementing neither throws") {
  const std::vector<double> lengths = {1, 8, 1, 3, 1, 5};
  const xpm::RecordDimsView view(lengths.data(), 3, 2);
  const OnePerRecordPacker one_per_record;
  const xpm::MicrobatchPacker& as_base = one_per_record;
  const MicrobatchPlan plan = as_base.pack(view, square_model(), 1000);
  REQUIRE(plan.microbatches.size() == 3);
  CHECK(plan.microbatches[1].record_indices == std::vector<std::size_t>{1});
  CHECK(plan.microbatches[1].predicted_bytes == 3 * 3);
  check_same_plan(plan, one_per_record.pack(records_of_lengths({8, 3, 5}), square_model(), 1000));
  const NamelessPacker nameless;
  CHECK_THROWS_WITH_AS(nameless.pack(view, square_model(), 1000), doctest::Contains("'nameless' overrides neither"),
                       std::logic_error);
  CHECK_THROWS_WITH_AS(nameless.pack(records_of_lengths({8}), square_model(), 1000),
                       doctest::Contains("'nameless' overrides neither"), std::logic_error);
}

TEST_CASE("the uniform packer with a summed token count slices by the largest records' sum, not one record each") {
  // 1000 bytes per token, budget 100,000: at most 100 tokens per microbatch.
  const MemoryModel model(CostFormula("a*t", {"a"}, {"bs", "t"}), {1000.0}, 0, "bs",
                          {{"t", DimAggregation::kSum}});
  Records records;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> length(5, 20);
  for (int i = 0; i < 64; ++i) records.push_back({1.0, static_cast<double>(length(rng))});
  const MicrobatchPlan plan = UniformPacker().pack(records, model, 100'000);
  check_each_record_once(plan, records.size());
  for (const auto& mb : plan.microbatches) CHECK(mb.predicted_bytes <= 100'000);
  double tokens = 0;
  for (const auto& r : records) tokens += r[1];
  // Slices of the size whose largest records fit: 5 to 20 tokens each, at least 5 per slice.
  CHECK(plan.microbatches.size() <= static_cast<std::size_t>(std::ceil(64.0 / 5)));
  CHECK(plan.microbatches.size() >= static_cast<std::size_t>(std::ceil(tokens / 100)));
}

TEST_CASE("max_microbatch_size counts a summed variable once per record") {
  const MemoryModel model(CostFormula("a*t + c", {"a", "c"}, {"bs", "t"}), {1000.0, 10'000.0}, 0, "bs",
                          {{"t", DimAggregation::kSum}});
  // Records of 30 tokens: 90,000 bytes at 3 records, 120,000 at 4.
  CHECK(model.max_microbatch_size({1, 30}, 100'000) == 3);
}

TEST_CASE("the adaptive packer sorts by several variables: the first, then the next among equals") {
  const MemoryModel model(CostFormula("a*bs*h*w", {"a"}, {"bs", "h", "w"}), {1.0}, 0, "bs",
                          {{"h", DimAggregation::kMax}, {"w", DimAggregation::kMax}});
  const Records records = {{1, 32, 10}, {1, 64, 20}, {1, 32, 40}, {1, 64, 10}, {1, 32, 20}, {1, 64, 40}};
  AdaptivePackerOptions options;
  options.sort_by = "h, w";
  const MicrobatchPlan plan = AdaptivePacker(options).pack(records, model, 64 * 40 * 2);
  check_each_record_once(plan, records.size());
  // Heaviest first by h, then by w: (64,40) (64,20) | (64,10) (32,40) | (32,20) (32,10).
  REQUIRE(plan.microbatches.size() == 3);
  CHECK(plan.microbatches[0].record_indices == std::vector<std::size_t>{5, 1});
  CHECK(plan.microbatches[1].record_indices == std::vector<std::size_t>{3, 2});
  CHECK(plan.microbatches[2].record_indices == std::vector<std::size_t>{4, 0});
  options.sort_by = "h,bs";
  CHECK_THROWS_WITH_AS(AdaptivePacker(options).pack(records, model, 10'000),
                       doctest::Contains("sort_by 'bs' is the batch-size variable"), std::invalid_argument);
}

TEST_CASE("AdaptivePackerOptions refuses an empty variable name in sort_by") {
  CHECK_NOTHROW(AdaptivePackerOptions().set_sort_by("h,w").validate());
  CHECK_NOTHROW(AdaptivePackerOptions().validate());  // record order
  for (const char* bad : {"h,,w", ",h", "h,"}) {
    CHECK_THROWS_WITH_AS(AdaptivePacker(AdaptivePackerOptions().set_sort_by(bad)),
                         ("AdaptivePackerOptions.sort_by '" + std::string(bad) + "' has an empty variable name").c_str(),
                         std::invalid_argument);
  }
}

TEST_CASE("a record that fits alone by the single-record fit is not over budget in any packer") {
  // The trend says 5000 bytes per token at bs = 1 too; the probes of one record said 4000.
  MemoryModel model(CostFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"}), {5000.0, 2e6}, 0, "bs",
                    {{"l", DimAggregation::kMax}});
  model.set_single_record_coefficients({4000.0, 2e6});
  const Records records = records_of_lengths({256});
  const std::int64_t budget = 3'279'000;  // 4000 x 256 + 2e6 = 3,024,000 fits; 5000 x 256 + 2e6 does not
  REQUIRE(model.fits({1, 256}, budget));
  for (const MicrobatchPlan& plan : {UniformPacker().pack(records, model, budget),
                                     AdaptivePacker().pack(records, model, budget),
                                     xpm::FirstFitDecreasingPacker().pack(records, model, budget)}) {
    CHECK(plan.over_budget_records.empty());
    REQUIRE(plan.microbatches.size() == 1);
    CHECK_FALSE(plan.microbatches[0].over_budget);
    CHECK(plan.microbatches[0].predicted_bytes == doctest::Approx(3'024'000));
  }
}

TEST_CASE("the packers plan a refitted model's shapes beyond its region by the model outside it") {
  // A refit with a smaller quadratic term, fitted where l <= 120; at l = 200 the model it was
  // refitted from predicts more, and that is what the plans must fit.
  MemoryModel refitted(CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}), {0.5, 64.0, 5000.0}, 0,
                       "bs", {{"l", DimAggregation::kMax}});
  refitted.set_refit_region({{{1, 16}, {10, 120}}, std::make_shared<const MemoryModel>(quadratic_model())});
  const Records records = records_of_lengths(std::vector<double>(40, 200.0));
  const std::int64_t usable = 300'000;  // quadratic_model: 3 records of 200 (283,400 bytes); the refit alone: 8
  for (const std::string name : {"adaptive", "uniform", "ffd"}) {  // "fastest" packs as adaptive does, by time
    CAPTURE(name);
    const auto packer = xpm::make_packer(xpm::parse_packer_kind(name, "packer"));
    const MicrobatchPlan plan = packer->pack(records, refitted, usable);
    check_each_record_once(plan, records.size());
    check_budget_respected(plan, usable);
    for (const auto& mb : plan.microbatches) CHECK(mb.record_indices.size() <= 3);
  }
}
