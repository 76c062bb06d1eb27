// memory_model_test.cpp — MemoryModel: prediction with a floor, microbatch-size search, JSON file.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

#include "xpm/planner/memory_model.hpp"

namespace fs = std::filesystem;
using xpm::CostFormula;
using xpm::DimAggregation;
using xpm::MemoryModel;

namespace {

// a*bs*l^2 + b*bs*l + c with a = 2, b = 10, c = 1000; variables (bs, l).
MemoryModel quadratic_model(double floor_bytes = 0) {
  return MemoryModel(CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
                     {2.0, 10.0, 1000.0}, floor_bytes, "bs", {{"l", DimAggregation::kMax}});
}

double cost(double bs, double l) { return 2 * bs * l * l + 10 * bs * l + 1000; }

// A fresh, empty directory under the build tree for file tests.
fs::path scratch_dir(const std::string& name) {
  fs::path dir = fs::path(XPM_BINARY_DIR) / "test_scratch" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string error_of_load(const fs::path& path) {
  try {
    MemoryModel::load(path.string());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

}  // namespace

TEST_CASE("prediction is the formula or the floor, whichever is larger") {
  const MemoryModel model = quadratic_model(/*floor_bytes=*/5000);
  CHECK(model.predict_bytes({1, 8}) == 5000);  // formula gives 1208
  CHECK(model.predict_bytes({4, 64}) == doctest::Approx(cost(4, 64)));
}

TEST_CASE("a prediction of dims that are NaN, infinite, negative or of the wrong width is refused") {
  // Before: predict_bytes({1, NaN}) was 0, fits() true, max_microbatch_size 2^40.
  const MemoryModel model = quadratic_model();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(model.predict_bytes({1, nan}),
                       "MemoryModel::predict_bytes: l = nan; dims must be finite and >= 0", std::invalid_argument);
  CHECK_THROWS_WITH_AS(model.predict_bytes({1, -50}),
                       "MemoryModel::predict_bytes: l = -50; dims must be finite and >= 0", std::invalid_argument);
  CHECK_THROWS_WITH_AS(model.predict_bytes({1}), doctest::Contains("got 1 dims, expected 2"), std::invalid_argument);
  CHECK_THROWS_AS(model.fits({1, std::numeric_limits<double>::infinity()}, 1e9), std::invalid_argument);
  CHECK_THROWS_WITH_AS(model.max_microbatch_size({1, -50}, 1'000'000),
                       doctest::Contains("l = -50; dims must be finite and >= 0"), std::invalid_argument);
}

TEST_CASE("a reserved gap in the metadata turns a reserved budget into the predictions' one") {
  MemoryModel model = quadratic_model();
  CHECK(model.prediction_budget_bytes(1'000'000) == 1'000'000);  // no gap: the budget as given
  model.metadata()["reserved_gap"] = {{"intercept_bytes", 100'000.0}, {"slope", 0.25}};
  CHECK(model.prediction_budget_bytes(1'000'000) == 720'000);  // (1e6 - 1e5) / 1.25
  CHECK(model.prediction_budget_bytes(50'000) == 1);            // never below one byte
  model.metadata()["reserved_gap"] = {{"slope", 0.25}};
  CHECK_THROWS_WITH_AS(model.prediction_budget_bytes(1'000'000),
                       doctest::Contains("metadata.reserved_gap must hold intercept_bytes and slope"),
                       std::invalid_argument);
}

TEST_CASE("added bytes are the formula less its value at batch size 0, the floor aside") {
  const MemoryModel model = quadratic_model(/*floor_bytes=*/5000);
  CHECK(model.added_bytes({1, 8}) == doctest::Approx(cost(1, 8) - 1000));  // under the floor still counts
  CHECK(model.added_bytes({4, 64}) == doctest::Approx(cost(4, 64) - 1000));
  CHECK(model.added_bytes({0, 64}) == 0);
  const MemoryModel shrinking(CostFormula("c - a*bs", {"a", "c"}, {"bs"}), {1.0, 100.0}, 0, "bs", {});
  CHECK(shrinking.added_bytes({3}) == 0);  // at least 0
  CHECK_THROWS_WITH_AS(model.added_bytes({4}), "MemoryModel::added_bytes: 1 dims for 2 variables",
                       std::invalid_argument);
}

TEST_CASE("max microbatch size is 10 for a budget between the costs of 10 and 11") {
  const MemoryModel model = quadratic_model();
  const auto budget = static_cast<std::int64_t>((cost(10, 128) + cost(11, 128)) / 2);
  CHECK(model.max_microbatch_size({0, 128}, budget) == 10);
  CHECK(model.max_microbatch_size({0, 128}, static_cast<std::int64_t>(cost(10, 128))) == 10);
  CHECK(model.max_microbatch_size({0, 128}, static_cast<std::int64_t>(cost(10, 128)) - 1) == 9);
}

TEST_CASE("max microbatch size is an error, not 1, when even one record is over budget") {
  const MemoryModel model = quadratic_model();
  const auto budget = static_cast<std::int64_t>(cost(1, 128)) - 1;
  CHECK_THROWS_WITH_AS(model.max_microbatch_size({0, 128}, budget),
                       doctest::Contains(std::to_string(budget).c_str()), std::invalid_argument);
}

TEST_CASE("max microbatch size never exceeds max_size and ignores the given batch size") {
  const MemoryModel model = quadratic_model();
  CHECK(model.max_microbatch_size({999, 128}, std::int64_t{1} << 50, 37) == 37);
  CHECK(model.max_microbatch_size({999, 128}, std::int64_t{1} << 50, 1) == 1);
  CHECK_THROWS_AS(model.max_microbatch_size({1, 128}, 1 << 30, 0), std::invalid_argument);
}

TEST_CASE("max microbatch size agrees with a linear scan for many budgets") {
  const MemoryModel model = quadratic_model(/*floor_bytes=*/20000);
  for (std::int64_t budget = 20000; budget < 400000; budget += 7919) {
    std::int64_t expected = 0;
    for (std::int64_t m = 1; m <= 1000; ++m) {
      if (model.predict_bytes({static_cast<double>(m), 30}) <= static_cast<double>(budget)) {
        expected = m;
      }
    }
    CAPTURE(budget);
    CHECK(model.max_microbatch_size({0, 30}, budget) == expected);
  }
}

TEST_CASE("max microbatch size returns a size predicted within budget for a non-monotone model") {
  // b < 0: the prediction dips then rises in bs; the answer must still be a fitting size.
  const MemoryModel model(CostFormula("a*bs^2 + b*bs + c", {"a", "b", "c"}, {"bs"}),
                          {1.0, -100.0, 3000.0}, 0, "bs");
  for (std::int64_t budget : {2950, 3000, 5000, 12000}) {
    const std::int64_t m = model.max_microbatch_size({0}, budget);
    CAPTURE(budget);
    CHECK(m >= 1);
    CHECK(model.predict_bytes({static_cast<double>(m)}) <= static_cast<double>(budget));
  }
}

TEST_CASE("model rejects a batch-size variable that is not declared") {
  CHECK_THROWS_WITH_AS(MemoryModel(CostFormula("a*bs", {"a"}, {"bs"}), {1.0}, 0, "n"),
                       doctest::Contains("'n'"), std::invalid_argument);
}

TEST_CASE("model rejects a coefficient count that does not match the formula") {
  CHECK_THROWS_AS(MemoryModel(CostFormula("a*bs", {"a"}, {"bs"}), {1.0, 2.0}, 0, "bs"),
                  std::invalid_argument);
}

TEST_CASE("model rejects a batch-size variable aggregated by anything but count") {
  CHECK_THROWS_AS(MemoryModel(CostFormula("a*bs*l", {"a"}, {"bs", "l"}), {1.0}, 0, "bs",
                              {{"bs", DimAggregation::kMax}}),
                  std::invalid_argument);
}

TEST_CASE("model aggregates variables by max unless told otherwise") {
  const MemoryModel model(CostFormula("a*bs*l + b*t", {"a", "b"}, {"bs", "l", "t"}), {1, 1}, 0,
                          "bs", {{"t", DimAggregation::kSum}});
  CHECK(model.batch_size_index() == 0);
  CHECK(model.aggregation()[0] == DimAggregation::kCount);
  CHECK(model.aggregation()[1] == DimAggregation::kMax);
  CHECK(model.aggregation()[2] == DimAggregation::kSum);
}

TEST_CASE("dim aggregations convert to and from their names") {
  for (DimAggregation a : {DimAggregation::kCount, DimAggregation::kMax, DimAggregation::kSum}) {
    CHECK(xpm::parse_dim_aggregation(xpm::to_string(a), "aggregation") == a);
  }
  CHECK_THROWS_WITH_AS(xpm::parse_dim_aggregation("mean", "aggregation of 'l'"),
                       "aggregation of 'l' must be 'count', 'max' or 'sum', got 'mean'", std::invalid_argument);
}

TEST_CASE("model round-trips through JSON") {
  MemoryModel model = quadratic_model(/*floor_bytes=*/1234.5);
  model.metadata()["device"] = "cpu";
  const nlohmann::json j = model.to_json();
  CHECK(j["format_version"] == 1);
  CHECK(j["coefficients"]["b"] == 10.0);
  CHECK(j["aggregation"]["bs"] == "count");
  CHECK(j["formula"]["canonical"] == model.formula().canonical());

  const MemoryModel back = MemoryModel::from_json(j);
  CHECK(back.coefficients() == model.coefficients());
  CHECK(back.floor_bytes() == 1234.5);
  CHECK(back.batch_size_variable() == "bs");
  CHECK(back.aggregation() == model.aggregation());
  CHECK(back.formula().canonical() == model.formula().canonical());
  CHECK(back.metadata()["device"] == "cpu");
  CHECK(back.to_json() == j);
}

TEST_CASE("a refitted model predicts its own formula inside its region and the outside model's beyond") {
  // The refit halves the quadratic term; it was fitted on bs in [2, 8] and l in [16, 64].
  MemoryModel refitted(CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}), {1.0, 10.0, 1000.0}, 0,
                       "bs", {{"l", DimAggregation::kMax}});
  refitted.set_refit_region({{{2, 8}, {16, 64}}, std::make_shared<const MemoryModel>(quadratic_model())});
  CHECK(refitted.predict_bytes({4, 64}) == doctest::Approx(1 * 4 * 64 * 64 + 10 * 4 * 64 + 1000));  // inside
  CHECK(refitted.predict_bytes({1, 64}) == doctest::Approx(cost(1, 64)));    // bs below its range
  CHECK(refitted.predict_bytes({4, 128}) == doctest::Approx(cost(4, 128)));  // l above its range
  // A refit above the outside model raises it beyond the region by the smaller of its excess
  // there and its excess at the nearest shape inside: here its constant is 50,000 bytes higher
  // and its linear term half, so its own excess shrinks as l grows.
  MemoryModel higher(CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}), {2.0, 5.0, 51000.0}, 0, "bs",
                     {{"l", DimAggregation::kMax}});
  higher.set_refit_region({{{2, 8}, {16, 64}}, std::make_shared<const MemoryModel>(quadratic_model())});
  const auto own = [](double bs, double l) { return 2 * bs * l * l + 5 * bs * l + 51000.0; };
  CHECK(higher.predict_bytes({4, 128}) == doctest::Approx(own(4, 128)));  // its own excess the smaller
  CHECK(own(4, 128) - cost(4, 128) < own(4, 64) - cost(4, 64));
  CHECK(higher.predict_bytes({1, 8}) == doctest::Approx(cost(1, 8) + own(2, 16) - cost(2, 16)));  // the edge's
  CHECK(own(2, 16) - cost(2, 16) < own(1, 8) - cost(1, 8));
  // Never below the outside model: a refit far below it beyond the region.
  CHECK(higher.predict_bytes({8, 4096}) == doctest::Approx(cost(8, 4096)));
  // The region travels with the model's JSON, its outside model inside it.
  const nlohmann::json j = refitted.to_json();
  CHECK(j["refit_region"]["training_ranges"]["l"] == nlohmann::json{16.0, 64.0});
  const MemoryModel back = MemoryModel::from_json(j);
  REQUIRE(back.refit_region() != nullptr);
  CHECK(back.predict_bytes({1, 64}) == refitted.predict_bytes({1, 64}));
  CHECK(back.to_json() == j);
  // Bad regions are refused, naming the field.
  nlohmann::json bad = j;
  bad["refit_region"]["training_ranges"].erase("l");
  CHECK_THROWS_WITH_AS(MemoryModel::from_json(bad), doctest::Contains("refit_region.training_ranges.l"),
                       std::invalid_argument);
  bad = j;
  bad["refit_region"]["outside"]["coefficients"].erase("b");
  CHECK_THROWS_WITH_AS(MemoryModel::from_json(bad), "memory model: field 'refit_region.outside.coefficients.b': missing",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(refitted.set_refit_region({{{8, 2}, {16, 64}}, std::make_shared<const MemoryModel>(quadratic_model())}),
                       doctest::Contains("refit region range of bs [8, 2]"), std::invalid_argument);
  CHECK_THROWS_AS(refitted.set_refit_region({{{2, 8}, {16, 64}}, nullptr}), std::invalid_argument);
}

TEST_CASE("model from JSON names a missing or bad field") {
  const nlohmann::json good = quadratic_model().to_json();
  nlohmann::json j = good;
  j["coefficients"].erase("b");
  CHECK_THROWS_WITH_AS(MemoryModel::from_json(j), doctest::Contains("coefficients.b"),
                       std::invalid_argument);
  j = good;
  j["floor_bytes"] = "lots";
  CHECK_THROWS_WITH_AS(MemoryModel::from_json(j), doctest::Contains("floor_bytes"),
                       std::invalid_argument);
  j = good;
  j["format_version"] = 2;
  CHECK_THROWS_WITH_AS(MemoryModel::from_json(j), doctest::Contains("format_version"),
                       std::invalid_argument);
  j = good;
  j["aggregation"]["l"] = "mean";
  CHECK_THROWS_WITH_AS(MemoryModel::from_json(j), doctest::Contains("aggregation.l"),
                       std::invalid_argument);
  j = good;
  j["formula"]["text"] = "a*bs*zz";
  CHECK_THROWS_WITH_AS(MemoryModel::from_json(j), doctest::Contains("formula.text"),
                       std::invalid_argument);
}

TEST_CASE("save writes atomically and leaves no temporary file") {
  const fs::path dir = scratch_dir("memory_model_save");
  const fs::path path = dir / "model.json";
  write_text(path, "old contents");
  const MemoryModel model = quadratic_model(/*floor_bytes=*/42);
  model.save(path.string());

  std::size_t files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    CHECK(entry.path().filename() == "model.json");
    ++files;
  }
  CHECK(files == 1);
  const MemoryModel back = MemoryModel::load(path.string());
  CHECK(back.coefficients() == model.coefficients());
  CHECK(back.floor_bytes() == 42);
}

TEST_CASE("save to a folder that does not exist fails naming the path and writes nothing") {
  const fs::path dir = scratch_dir("memory_model_save_missing");
  const fs::path path = dir / "missing" / "model.json";
  CHECK_THROWS_WITH_AS(quadratic_model().save(path.string()),
                       doctest::Contains(path.string().c_str()), std::runtime_error);
  CHECK(fs::is_empty(dir));
}

TEST_CASE("load of a bad file names the path") {
  const fs::path dir = scratch_dir("memory_model_load");
  const fs::path not_json = dir / "not_json.json";
  write_text(not_json, "{ this is not json");
  CHECK(error_of_load(not_json).find(not_json.string()) != std::string::npos);

  const fs::path bad_field = dir / "bad_field.json";
  nlohmann::json j = quadratic_model().to_json();
  j.erase("batch_size_variable");
  write_text(bad_field, j.dump());
  const std::string msg = error_of_load(bad_field);
  CHECK(msg.find(bad_field.string()) != std::string::npos);
  CHECK(msg.find("batch_size_variable") != std::string::npos);
  CHECK_THROWS_AS(MemoryModel::load(bad_field.string()), std::invalid_argument);

  const fs::path missing = dir / "missing.json";
  CHECK(error_of_load(missing).find(missing.string()) != std::string::npos);
  CHECK_THROWS_AS(MemoryModel::load(missing.string()), std::runtime_error);
}

// ---------------------------------------------------------------------------------------------
// Infeasible probes: no answer dominates one.

TEST_CASE("max microbatch size stays below an infeasible probe's bs at its l and above") {
  MemoryModel model = quadratic_model();
  // The model predicts 48 records of l = 128 at about 1.6 MB, but that probe ran out of 10 MB.
  model.set_infeasible_probes({{{48, 128}, 10e6}});
  const std::int64_t budget = 9'000'000;  // usable, below the probe's capacity
  CHECK(model.max_microbatch_size({0, 128}, budget) == 47);
  CHECK(model.max_microbatch_size({0, 200}, budget) == 47);  // longer records: same limit
  const std::int64_t shorter = model.max_microbatch_size({0, 100}, budget);
  CHECK(shorter > 47);  // the probe says nothing about l = 100
  CHECK(model.predict_bytes({static_cast<double>(shorter), 100}) <= budget);
  CHECK_FALSE(model.fits({48, 128}, budget));
  CHECK(model.fits({47, 128}, budget));
  CHECK(model.dominated_infeasible_probe({64, 256}, budget) == &model.infeasible_probes()[0]);
  CHECK(model.dominated_infeasible_probe({64, 100}, budget) == nullptr);
  // A budget above the capacity the probe ran under is not bound by it.
  CHECK(model.max_microbatch_size({0, 128}, 20'000'000) > 47);
}

TEST_CASE("max microbatch size is an error when a probe of one record ran out of memory") {
  MemoryModel model = quadratic_model();
  model.set_infeasible_probes({{{1, 512}, 10e6}});
  CHECK_THROWS_WITH_AS(model.max_microbatch_size({0, 600}, 9'000'000),
                       doctest::Contains("ran out of memory at bs = 1, l = 512"),
                       std::invalid_argument);
}

TEST_CASE("infeasible probes round-trip through JSON; a file without them has none") {
  MemoryModel model = quadratic_model();
  model.set_infeasible_probes({{{48, 128}, 10e6}, {{4, 1024}, 10e6}});
  const nlohmann::json j = model.to_json();
  CHECK(j["infeasible_probes"].size() == 2);
  CHECK(j["infeasible_probes"][1]["dims"] == nlohmann::json({4, 1024}));
  CHECK(j["infeasible_probes"][1]["exceeds_bytes"] == 10e6);
  const MemoryModel back = MemoryModel::from_json(j);
  REQUIRE(back.infeasible_probes().size() == 2);
  CHECK(back.infeasible_probes()[0].dims == std::vector<double>{48, 128});
  CHECK(back.infeasible_probes()[0].exceeds_bytes == 10e6);
  CHECK(back.to_json() == j);

  nlohmann::json old = j;
  old.erase("infeasible_probes");  // written before the field existed
  CHECK(MemoryModel::from_json(old).infeasible_probes().empty());
}

TEST_CASE("model from JSON names a bad infeasible probe") {
  nlohmann::json j = quadratic_model().to_json();
  const auto error_of = [](const nlohmann::json& file) {
    try {
      MemoryModel::from_json(file);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  j["infeasible_probes"] = {{{"dims", {48}}, {"exceeds_bytes", 1e6}}};
  CHECK(error_of(j).find("infeasible_probes[0].dims") != std::string::npos);
  j["infeasible_probes"] = {{{"dims", {48, 128}}}};
  CHECK(error_of(j).find("infeasible_probes[0].exceeds_bytes") != std::string::npos);
  j["infeasible_probes"] = {{{"dims", {48, 128}}, {"exceeds_bytes", 0}}};
  CHECK(error_of(j).find("must be > 0") != std::string::npos);
  j["infeasible_probes"] = "none";
  CHECK(error_of(j).find("infeasible_probes") != std::string::npos);
}

TEST_CASE("a model says which dims lie beyond its probed range, and by how much") {
  xpm::MemoryModel model(xpm::CostFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"}), {10, 1e6}, 0, "bs");
  CHECK(model.extrapolation({20, 64}).empty());  // no range recorded: nothing to say
  model.set_probed_ranges(xpm::MemoryModel::ranges_of({{1, 16}, {8, 128}, {4, 64}}));
  REQUIRE(model.probed_ranges().size() == 2);
  CHECK(model.probed_ranges()[0].max == 8);
  CHECK(model.probed_ranges()[1].min == 16);
  CHECK(model.extrapolation({8, 128}).empty());
  const auto beyond = model.extrapolation({20, 8});
  REQUIRE(beyond.size() == 2);
  CHECK(beyond[0].describe() == "bs = 20 is 2.5x the largest probed bs (8)");
  CHECK(beyond[1].describe() == "l = 8 is below the smallest probed l (16)");
  const xpm::MemoryModel read = xpm::MemoryModel::from_json(model.to_json());
  CHECK(read.extrapolation({20, 8}).size() == 2);
  CHECK_THROWS_AS(model.set_probed_ranges({{1, 0}}), std::invalid_argument);
}

TEST_CASE("a model file without probed_ranges takes them from its feasible probes") {
  xpm::MemoryModel model(xpm::CostFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"}), {10, 1e6}, 0, "bs");
  nlohmann::json j = model.to_json();
  j["metadata"]["probes"] = {{{"dims", {1, 16}}, {"feasible", true}},
                             {{"dims", {8, 128}}, {"feasible", true}},
                             {{"dims", {64, 512}}, {"feasible", false}}};
  const xpm::MemoryModel read = xpm::MemoryModel::from_json(j);
  REQUIRE(read.probed_ranges().size() == 2);
  CHECK(read.probed_ranges()[0].max == 8);
  CHECK(read.probed_ranges()[1].max == 128);
}
