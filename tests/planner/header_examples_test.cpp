// header_examples_test.cpp — the usage examples at the top of the planner's public headers,
// compiled and run. Each test case sets up what its example takes as given (a formula, a
// model, a budget) and includes the example's statements, which the build extracts from the
// header (cmake/xpm_header_example.cmake): an example that goes stale fails this build.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "xpm/planner/budget.hpp"
#include "xpm/planner/fastest_packer.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/record_dims_view.hpp"
#include "xpm/planner/time_model.hpp"

namespace xpm {
namespace {

// a*bs*l + b*bs + c with a = 100, b = 30, c = 1000 bytes; variables (bs, l).
MemoryModel linear_model() {
  return MemoryModel(CostFormula::with_variables("a*bs*l + b*bs + c", {"bs", "l"}), {100.0, 30.0, 1000.0},
                     /*floor_bytes=*/0, "bs", {{"l", DimAggregation::kMax}});
}

TEST_CASE("formula.hpp's example compiles and runs") {
#include "xpm/planner/formula.example.inc"
  CHECK(f.canonical() == "a*bs*l^2 + b*bs*l - b*bs + c");
}

TEST_CASE("budget.hpp's example compiles and runs") {
#include "xpm/planner/budget.example.inc"
  CHECK(b.usable_bytes() == static_cast<std::int64_t>((80LL << 30) * 0.9) - (512LL << 20));
}

TEST_CASE("fit.hpp's example compiles and runs") {
#include "xpm/planner/fit.example.inc"
  CHECK(r.summary.usable);
  CHECK(r.coefficients.size() == 3);
}

TEST_CASE("memory_model.hpp's example compiles and runs") {
  const CostFormula formula = CostFormula::with_variables("a*bs*l + b*bs + c", {"bs", "l"});
  FitResult fit;
  fit.coefficients = {100.0, 30.0, 1000.0};
  const double static_bytes = 5000;
  const std::int64_t usable_bytes = 100'000;
  const std::filesystem::path folder = std::filesystem::path(XPM_BINARY_DIR) / "test_scratch" / "header_examples";
  std::filesystem::create_directories(folder);
  const std::string path = (folder / "model.json").string();
#include "xpm/planner/memory_model.example.inc"
  CHECK(model.predict_bytes({8, 100}) == doctest::Approx(8 * 100 * 100.0 + 8 * 30.0 + 1000));
  CHECK(model.max_microbatch_size({1, 100}, usable_bytes) == 9);  // 9 x 10,030 + 1,000 <= 100,000
}

TEST_CASE("packer.hpp's example compiles and runs") {
  const MemoryModel model = linear_model();
  MemoryBudget budget;
  budget.capacity_bytes = 40'000;
  budget.memory_fraction = 0.9;  // 36,000 usable: the records at l = 120 and 40 together, 250 alone
  std::vector<std::vector<std::size_t>> ran;
  auto run = [&](const std::vector<std::size_t>& record_indices) { ran.push_back(record_indices); };
#include "xpm/planner/packer.example.inc"
  CHECK(ran == std::vector<std::vector<std::size_t>>{{2}, {0, 1}});
}

TEST_CASE("packer_kind.hpp's example compiles and runs") {
#include "xpm/planner/packer_kind.example.inc"
  CHECK(packer != nullptr);
  CHECK(to_string(kind) == "ffd");
}

TEST_CASE("time_model.hpp's example compiles and runs") {
  MemoryModel model = linear_model();
  std::vector<ProbeResult> probes;
  for (double l : {10.0, 40.0, 120.0, 250.0}) {  // 1 ms a microbatch, 2 ns a byte of work
    ProbeResult probe;
    probe.dims = {1, l};
    probe.forward_backward_s = 1e-3 + 2e-9 * TimeModel::work_bytes(model, probe.dims);
    probes.push_back(probe);
  }
#include "xpm/planner/time_model.example.inc"
  REQUIRE(time);
  CHECK(TimeModel::from_metadata(model)->seconds(model, {8, 128}) ==
        doctest::Approx(1e-3 + 2e-9 * (8 * 128 * 100.0 + 8 * 30.0)).epsilon(1e-6));
}

TEST_CASE("fastest_packer.hpp's example compiles and runs") {
  MemoryModel model = linear_model();
  model.metadata()["time_model"] = TimeModel{1e-3, 2e-9, 0.0, 0}.to_json();
  MemoryBudget budget;
  budget.capacity_bytes = 40'000;
  const std::vector<double> dims = {1, 120, 1, 40, 1, 250};  // {bs, l} per record
  const std::size_t n = 3;
#include "xpm/planner/fastest_packer.example.inc"
  // 250 alone; 40 padded to 120 costs 16 us of work, less than a microbatch's 1 ms.
  CHECK(plan.microbatches.size() == 2);
}

}  // namespace
}  // namespace xpm
