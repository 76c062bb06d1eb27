#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/memory_model_lookup.hpp"
#include "xpm/planner/predictive_batcher.hpp"

namespace {

// A fake step: forward/backward peak = static + 10*bs*l^2 + 1000*bs*l; optimizer peak = static
// + 5000; out of memory above `limit_bytes`.
class FakeExecutor : public xpm::ProbeExecutor {
 public:
  explicit FakeExecutor(double limit_bytes) : limit_bytes_(limit_bytes) {}
  xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
    xpm::ProbeResult r;
    r.dims = dims;
    r.forward_backward_peak_bytes = kStatic + 10 * dims[0] * dims[1] * dims[1] + 1000 * dims[0] * dims[1];
    r.optimizer_step_peak_bytes = kStatic + 5000;
    if (r.forward_backward_peak_bytes > limit_bytes_) {
      r = xpm::ProbeResult{};
      r.dims = dims;
      r.feasible = false;
      r.error = "out of memory";
    }
    r.capacity_bytes = limit_bytes_;  // what it ran under
    ++calls;
    return r;
  }
  double static_bytes() override { return kStatic; }
  static constexpr double kStatic = 1e6;
  int calls = 0;

 private:
  double limit_bytes_;
};

xpm::PredictiveBatcherOptions options_with_cap(std::int64_t capacity_bytes) {
  xpm::PredictiveBatcherOptions options;
  options.variable_max = {{"bs", 64}, {"l", 128}};
  options.budget = {capacity_bytes, 0.9, 0};
  return options;
}

}  // namespace

TEST_CASE("the automatic design grows toward the budget, keeps infeasible probes and fits exactly") {
  FakeExecutor executor(4e6);  // a hard limit below the usable budget of 0.9 * 5e6
  xpm::PredictiveBatcher batcher(options_with_cap(5'000'000),
                                 std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  std::size_t infeasible = 0;
  for (const auto& probe : batcher.probes()) infeasible += probe.feasible ? 0 : 1;
  CHECK(infeasible >= 1);  // kept, not dropped
  CHECK(model.coefficients()[0] == doctest::Approx(10).epsilon(1e-6));
  CHECK(model.coefficients()[1] == doctest::Approx(1000).epsilon(1e-6));
  CHECK(model.floor_bytes() == doctest::Approx(FakeExecutor::kStatic + 5000));
  // Held-out shape, not probed: exact by construction of the fake.
  const double truth = FakeExecutor::kStatic + 10 * 3 * 100.0 * 100 + 1000 * 3 * 100;
  CHECK(model.predict_bytes({3, 100}) == doctest::Approx(truth).epsilon(1e-6));
}

TEST_CASE("a forward/backward plateau above the optimizer peak becomes the floor and stays out of the fit") {
  // The shape of a sharded rank at world 3 (measured): small probes all peak at the same
  // shape-independent moment of backward (static + 200000 here, a dense gradient temporary),
  // above the optimizer step (static + 5000); larger ones follow the activations.
  class PlateauExecutor : public FakeExecutor {
   public:
    PlateauExecutor() : FakeExecutor(1e9) {}
    xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
      xpm::ProbeResult r = FakeExecutor::run_probe(dims);
      r.forward_backward_peak_bytes = std::max(r.forward_backward_peak_bytes, kStatic + 200000 + dims[0] * dims[1]);
      return r;
    }
  } executor;
  xpm::PredictiveBatcher batcher(options_with_cap(5'000'000), std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  std::size_t plateau_probes = 0;
  for (const auto& probe : batcher.probes()) {
    plateau_probes += probe.forward_backward_peak_bytes < FakeExecutor::kStatic + 202000 ? 1 : 0;
  }
  REQUIRE(plateau_probes >= 2);
  // The activation curve is fitted exactly, the plateau is the floor, every probe is predicted
  // within 1 % (the plateau's own spread).
  CHECK(model.coefficients()[0] == doctest::Approx(10).epsilon(1e-6));
  CHECK(model.coefficients()[1] == doctest::Approx(1000).epsilon(1e-6));
  CHECK(model.floor_bytes() >= FakeExecutor::kStatic + 200000);
  CHECK(model.floor_bytes() <= FakeExecutor::kStatic + 202000);
  CHECK(model.metadata()["floor"]["plateau"] == true);
  CHECK(model.metadata()["floor"]["report"].get<std::string>().rfind(
            "floor: the plateau of the forward/backward peaks, ", 0) == 0);
  for (const auto& probe : batcher.probes()) {
    const double predicted = model.predict_bytes(probe.dims);
    CHECK(std::abs(predicted - probe.forward_backward_peak_bytes) / probe.forward_backward_peak_bytes < 0.01);
  }
}

TEST_CASE("a budget below the static memory is an error before any probe") {
  FakeExecutor executor(1e12);
  xpm::PredictiveBatcher batcher(options_with_cap(1'000'000), std::make_shared<xpm::AdaptivePacker>());
  CHECK_THROWS_AS(batcher.probe_and_fit(executor), std::invalid_argument);
  CHECK(executor.calls == 0);
}

TEST_CASE("a plan before probe_and_fit says there is no model yet") {
  xpm::PredictiveBatcher batcher(options_with_cap(5'000'000), std::make_shared<xpm::AdaptivePacker>());
  CHECK_THROWS_WITH_AS(batcher.plan({{1, 8}}), "PredictiveBatcher: no model yet; call probe_and_fit first",
                       std::logic_error);
}

TEST_CASE("probe options a newcomer got wrong are named, not blamed on the capacity") {
  const auto packer = std::make_shared<xpm::AdaptivePacker>();
  xpm::PredictiveBatcherOptions no_fractions = options_with_cap(5'000'000);
  no_fractions.design_fractions.clear();
  CHECK_THROWS_WITH_AS(xpm::PredictiveBatcher(no_fractions, packer),
                       doctest::Contains("PredictiveBatcherOptions.design_fractions is empty"), std::invalid_argument);
  xpm::PredictiveBatcherOptions nan_point = options_with_cap(5'000'000);
  nan_point.probe_points = {{{{"bs", 1}, {"l", 8}}}, {{{"bs", 2}, {"l", std::nan("")}}}};
  CHECK_THROWS_WITH_AS(xpm::PredictiveBatcher(nan_point, packer),
                       "PredictiveBatcherOptions.probe_points[1] has l = nan; dims must be finite and >= 0",
                       std::invalid_argument);
  // One probe point for three coefficients, none out of memory: more points, not more capacity.
  xpm::PredictiveBatcherOptions one_point = options_with_cap(5'000'000);
  one_point.probe_points = {{{{"bs", 2}, {"l", 16}}}};
  xpm::PredictiveBatcher batcher(one_point, packer);
  FakeExecutor executor(1e12);
  CHECK_THROWS_WITH_AS(batcher.probe_and_fit(executor),
                       "PredictiveBatcher: 1 probe(s) for 3 coefficients: give more probe points, at least 3 shapes, "
                       "or let the automatic design choose them",
                       std::invalid_argument);
}

TEST_CASE("a capacity that leaves too few probes for any formula of auto is named, not the selection") {
  // Three probes fit, all of one shape (no formula's terms can be told apart there), the large one not.
  FakeExecutor executor(1'010'000);
  xpm::PredictiveBatcherOptions options = options_with_cap(1'010'000);
  options.budget.memory_fraction = 1.0;
  options.formula_choice = xpm::FormulaChoice::kAutomatic;
  options.formula = xpm::CostFormula::with_variables("c", {"bs", "l", "lt"});  // the variables
  options.variable_max["lt"] = 64;
  options.probe_points = {{{{"bs", 1}, {"l", 4}, {"lt", 4}}}, {{{"bs", 1}, {"l", 4}, {"lt", 4}}},
                          {{{"bs", 1}, {"l", 4}, {"lt", 4}}}, {{{"bs", 8}, {"l", 128}, {"lt", 64}}}};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  CHECK_THROWS_WITH_AS(batcher.probe_and_fit(executor),
                       doctest::Contains("PredictiveBatcher: only 3 of 4 probes fit under the capacity of 1010000 "
                                         "bytes (the others ran out of memory), too few for any formula (select_formula"),
                       std::invalid_argument);
}

TEST_CASE("online correction refits with a measurement above the prediction") {
  xpm::PredictiveBatcherOptions o = options_with_cap(100'000'000);
  xpm::PredictiveBatcher batcher(o, std::make_shared<xpm::AdaptivePacker>());
  xpm::MemoryModel model(o.formula,
                         {10, 1000, 1e6}, 0, "bs");
  const auto truth = [](double bs, double l) { return 10 * bs * l * l + 1000 * bs * l + 1e6; };
  model.metadata()["fit_measurements"] = {{{"dims", {1, 50}}, {"bytes", truth(1, 50)}},
                                          {{"dims", {4, 100}}, {"bytes", truth(4, 100)}},
                                          {{"dims", {8, 30}}, {"bytes", truth(8, 30)}}};
  batcher.set_model(model);
  const double before = batcher.model().predict_bytes({16, 120});
  batcher.add_measurement({{16, 120}, 1.2 * truth(16, 120)});
  CHECK(batcher.corrections() == 1);
  CHECK(batcher.model().predict_bytes({16, 120}) > before);
  CHECK(batcher.model().metadata()["fit_measurements"].size() == 4);
  batcher.raise_floor_bytes(5e6);
  CHECK(batcher.model().floor_bytes() == 5e6);
  CHECK(batcher.corrections() == 2);
}

TEST_CASE("online correction without fit data raises the floor to the measurement") {
  xpm::PredictiveBatcherOptions o = options_with_cap(100'000'000);
  xpm::PredictiveBatcher batcher(o, std::make_shared<xpm::AdaptivePacker>());
  batcher.set_model(xpm::MemoryModel(o.formula,
                                     {10, 1000, 1e6}, 0, "bs"));
  batcher.add_measurement({{4, 100}, 9e6});
  CHECK(batcher.model().predict_bytes({4, 100}) >= 9e6);
}

TEST_CASE("an out-of-memory microbatch in training becomes a bound: refit above it, no plan dominates it") {
  xpm::PredictiveBatcherOptions o = options_with_cap(100'000'000);
  xpm::PredictiveBatcher batcher(o, std::make_shared<xpm::AdaptivePacker>());
  // The model under-predicts the true cost 10*bs*l^2 + 1000*bs*l + 1e6 by half in the l^2 term.
  xpm::MemoryModel model(o.formula,
                         {5, 1000, 1e6}, 0, "bs");
  const auto truth = [](double bs, double l) { return 10 * bs * l * l + 1000 * bs * l + 1e6; };
  model.metadata()["fit_measurements"] = {{{"dims", {1, 50}}, {"bytes", truth(1, 50)}},
                                          {{"dims", {4, 100}}, {"bytes", truth(4, 100)}},
                                          {{"dims", {8, 30}}, {"bytes", truth(8, 30)}}};
  batcher.set_model(model);
  const double capacity_bytes = 5e6;
  REQUIRE(batcher.model().predict_bytes({16, 120}) < capacity_bytes);  // planned, then ran out
  REQUIRE(truth(16, 120) > capacity_bytes);
  batcher.add_infeasible_bound({{16, 120}, capacity_bytes});
  CHECK(batcher.corrections() == 1);
  CHECK(batcher.model().infeasible_probes().size() == 1);
  CHECK(batcher.model().predict_bytes({16, 120}) >= capacity_bytes);
  CHECK(batcher.model().dominated_infeasible_probe({16, 120}, capacity_bytes) != nullptr);
  CHECK(batcher.model().dominated_infeasible_probe({17, 128}, capacity_bytes) != nullptr);
  CHECK(batcher.model().dominated_infeasible_probe({8, 120}, capacity_bytes) == nullptr);
  // No microbatch of the next plan holds the shape that ran out of memory, or a larger one.
  std::vector<std::vector<double>> records(64, std::vector<double>{1, 120});
  const xpm::MicrobatchPlan plan = batcher.packer().pack(records, batcher.model(), capacity_bytes);
  for (const auto& mb : plan.microbatches) CHECK(mb.dims[0] < 16);
  CHECK_THROWS_AS(batcher.add_infeasible_bound({{16}, capacity_bytes}), std::invalid_argument);
}

TEST_CASE("infeasible probes bound the fit and limit every plan") {
  FakeExecutor executor(4e6);  // a hard limit below the usable budget of 0.9 * 5e6
  xpm::PredictiveBatcher batcher(options_with_cap(5'000'000),
                                 std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  std::vector<std::vector<double>> infeasible;
  for (const auto& probe : batcher.probes()) {
    if (!probe.feasible) infeasible.push_back(probe.dims);
  }
  REQUIRE_FALSE(infeasible.empty());
  CHECK(batcher.fit_summary().infeasible_bound_count == infeasible.size());
  REQUIRE(model.infeasible_probes().size() == infeasible.size());
  for (std::size_t i = 0; i < infeasible.size(); ++i) {
    CHECK(model.infeasible_probes()[i].dims == infeasible[i]);
    CHECK(model.infeasible_probes()[i].exceeds_bytes == 4e6);  // ProbeResult::capacity_bytes
    CHECK(batcher.fit_summary().infeasible_bound_satisfied[i]);
  }
  CHECK(model.to_json()["infeasible_probes"].size() == infeasible.size());

  // Under a budget at the probes' limit, no microbatch dominates an infeasible probe.
  std::vector<std::vector<double>> records(200, std::vector<double>{1, 128});
  const xpm::MicrobatchPlan plan = batcher.packer().pack(records, model, 4'000'000);
  for (const auto& mb : plan.microbatches) {
    CHECK(model.dominated_infeasible_probe(mb.dims, 4e6) == nullptr);
    CHECK_FALSE(mb.over_budget);
  }
}

TEST_CASE("a probe without a recorded capacity is bounded by the budget's capacity") {
  class NoCapacity : public FakeExecutor {
   public:
    using FakeExecutor::FakeExecutor;
    xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
      xpm::ProbeResult r = FakeExecutor::run_probe(dims);
      r.capacity_bytes = 0;
      return r;
    }
  };
  NoCapacity executor(5e6);  // runs out exactly at the capacity, like a capped allocator
  xpm::PredictiveBatcher batcher(options_with_cap(5'000'000),
                                 std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  for (const auto& probe : model.infeasible_probes()) CHECK(probe.exceeds_bytes == 5e6);
}

namespace {

// A step whose forward/backward peak is any function of the dims; the optimizer step peaks at
// the static bytes plus 5000. Never out of memory.
class FunctionExecutor : public xpm::ProbeExecutor {
 public:
  explicit FunctionExecutor(std::function<double(const std::vector<double>&)> activations)
      : activations_(std::move(activations)) {}
  xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
    xpm::ProbeResult r;
    r.dims = dims;
    r.forward_backward_peak_bytes = kStatic + activations_(dims);
    r.optimizer_step_peak_bytes = kStatic + 5000;
    probed.push_back(dims);
    return r;
  }
  double static_bytes() override { return kStatic; }
  static constexpr double kStatic = 1e6;
  std::vector<std::vector<double>> probed;

 private:
  std::function<double(const std::vector<double>&)> activations_;
};

double max_held_out_error(const xpm::MemoryModel& model, FunctionExecutor& executor,
                          const std::vector<std::vector<double>>& shapes) {
  double worst = 0;
  for (const auto& dims : shapes) {
    const double measured = std::max(executor.run_probe(dims).step_peak_bytes(), 0.0);
    worst = std::max(worst, std::abs(model.predict_bytes(dims) - measured) / measured);
  }
  return worst;
}

}  // namespace

TEST_CASE("the automatic design moves each length variable on its own, so their terms separate") {
  // Encoder-decoder-like: self-attention over the source and the target, cross-attention.
  FunctionExecutor executor([](const std::vector<double>& d) {
    return 30 * d[0] * d[1] * d[1] + 20 * d[0] * d[2] * d[2] + 10 * d[0] * d[1] * d[2] + 500 * d[0] * d[1];
  });
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula::with_variables(
      "a*bs*ls^2 + b*bs*lt^2 + d*bs*ls*lt + e*bs*ls + f*bs*lt + c", {"bs", "ls", "lt"});
  options.variable_max = {{"bs", 16}, {"ls", 64}, {"lt", 48}};
  options.budget = {4'000'000'000, 0.9, 0};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  CHECK(model.coefficients()[0] == doctest::Approx(30).epsilon(1e-6));
  CHECK(model.coefficients()[1] == doctest::Approx(20).epsilon(1e-6));
  CHECK(model.coefficients()[2] == doctest::Approx(10).epsilon(1e-6));
  CHECK(batcher.fit_summary().leave_one_out_max_rel_error < 1e-6);
  CHECK(batcher.adaptive_report().stop == xpm::AdaptiveStop::kAgreed);
  CHECK(batcher.adaptive_report().added_probes == 0);
  CHECK(max_held_out_error(model, executor, {{3, 40, 25}, {11, 33, 47}, {7, 64, 30}}) < 1e-6);
}

TEST_CASE("the adaptive design probes where the candidate models disagree until they agree") {
  // The peak moves between two operations: the attention scores (bs*l^2) win only at the
  // largest probe of the initial design (bs = 32, l = 256, and bs = 24 between probes); without
  // it, the held-out refits
  // can put that piece anywhere below, so they disagree until probes around it pin it down.
  FunctionExecutor executor([](const std::vector<double>& d) {
    return std::max(40 * d[0] * d[1] * d[1] + 2e5, 9000 * d[0] * d[1] + 6.2e6);
  });
  xpm::PredictiveBatcherOptions options;
  xpm::CostFormulaOptions nonlinear;
  nonlinear.allow_nonlinear = true;
  options.formula = xpm::CostFormula("max(a*bs*l^2 + c, b*bs*l + d)", {"a", "b", "c", "d"},
                                     {"bs", "l"}, nonlinear);
  options.variable_max = {{"bs", 32}, {"l", 256}};
  options.design_fractions = {1.0, 0.5};
  options.budget = {8'000'000'000, 0.9, 0};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  const xpm::AdaptiveDesignReport& report = batcher.adaptive_report();
  MESSAGE(report.describe(options.formula));
  CHECK(report.stop == xpm::AdaptiveStop::kAgreed);
  CHECK(report.added_probes >= 1);
  CHECK(report.disagreement <= options.adaptive.tolerance);
  CHECK(model.metadata().at("adaptive_design").at("stop") == "agreed");
  std::vector<std::vector<double>> held_out;
  for (double bs : {2.0, 5.0, 9.0, 17.0, 30.0}) {
    for (double l : {130.0, 170.0, 200.0, 230.0, 250.0}) held_out.push_back({bs, l});
  }
  CHECK(max_held_out_error(model, executor, held_out) < 0.01);
}

TEST_CASE("the adaptive design stops at its probe count and says so") {
  FunctionExecutor executor([](const std::vector<double>& d) {
    return 40 * d[0] * d[1] * d[1] * (1 + 0.3 * std::sin(d[1] / 9)) + 3000 * d[0];  // no formula fits
  });
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula::with_variables("a*bs*l^2 + b*bs + c", {"bs", "l"});
  options.variable_max = {{"bs", 16}, {"l", 200}};
  options.budget = {8'000'000'000, 0.9, 0};
  options.fit.usable_max_rel_error = 1.0;  // keep the fit, to watch the design
  options.adaptive.max_probes = 3;
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  batcher.probe_and_fit(executor);
  CHECK(batcher.adaptive_report().stop == xpm::AdaptiveStop::kProbeCount);
  CHECK(batcher.adaptive_report().added_probes == 3);
  CHECK(batcher.adaptive_report().describe(options.formula).find("probe count budget") != std::string::npos);
}

TEST_CASE("variable_max with a name that is not a variable of the formula is refused") {
  xpm::PredictiveBatcherOptions options;
  options.variable_max = {{"bs", 16}, {"l", 64}, {"lenght", 64}};
  options.budget = {1'000'000'000, 0.9, 0};
  CHECK_THROWS_WITH_AS(xpm::PredictiveBatcher(options, std::make_shared<xpm::AdaptivePacker>()),
                       doctest::Contains("variable_max names 'lenght', which is not a variable of the formula (bs, l)"),
                       std::invalid_argument);
}

TEST_CASE("with the formula chosen from the probes, an encoder-decoder's peaks are predicted on held-out shapes") {
  FunctionExecutor executor([](const std::vector<double>& d) {
    return 30 * d[0] * d[1] * d[1] + 20 * d[0] * d[2] * d[2] + 10 * d[0] * d[1] * d[2] + 500 * d[0] * d[1];
  });
  xpm::PredictiveBatcherOptions options;
  options.formula_choice = xpm::FormulaChoice::kAutomatic;
  options.formula = xpm::CostFormula::with_variables("c", {"bs", "ls", "lt"});  // the variables
  options.variable_max = {{"bs", 16}, {"ls", 64}, {"lt", 48}};
  options.budget = {4'000'000'000, 0.9, 0};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  INFO(batcher.selection_report());
  CHECK(batcher.fit_summary().usable);
  CHECK(batcher.selection_report().find("formula chosen from the probes") != std::string::npos);
  CHECK(model.metadata().at("formula_selection").at("chosen") == model.formula().canonical());
  CHECK(max_held_out_error(model, executor, {{3, 40, 25}, {11, 33, 47}, {7, 64, 30}, {16, 50, 40}}) < 1e-4);
}

TEST_CASE("with the formula chosen from the probes, a peak that moves between operations is predicted") {
  FunctionExecutor executor([](const std::vector<double>& d) {
    return std::max(40 * d[0] * d[1] * d[1] + 2e5, 9000 * d[0] * d[1] + 2e6);
  });
  xpm::PredictiveBatcherOptions options;
  options.formula_choice = xpm::FormulaChoice::kAutomatic;
  options.formula = xpm::CostFormula::with_variables("c", {"bs", "l"});
  options.variable_max = {{"bs", 32}, {"l", 256}};
  options.budget = {8'000'000'000, 0.9, 0};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  INFO(batcher.selection_report());
  MESSAGE(batcher.adaptive_report().describe(model.formula()));
  std::vector<std::vector<double>> held_out;
  for (double bs : {2.0, 5.0, 9.0, 17.0, 30.0}) {
    for (double l : {130.0, 170.0, 200.0, 230.0, 250.0}) held_out.push_back({bs, l});
  }
  CHECK(max_held_out_error(model, executor, held_out) < 0.01);
}

TEST_CASE("look_up_or_probe probes and stores once, then sets the cached model without probing") {
  const auto folder = std::filesystem::temp_directory_path() / "xpm_look_up_or_probe";
  std::filesystem::remove_all(folder);
  xpm::ModelLookup lookup;
  lookup.cache_dir = folder.string();
  lookup.identity = {{"model", "fake"}, {"capacity_bytes", 5'000'000}};
  lookup.metadata = {{"optimizer", "sgd"}};
  std::vector<std::string> lines;
  lookup.log = [&](const std::string& line) { lines.push_back(line); };
  FakeExecutor executor(4e6);
  const auto probe = [&](xpm::PredictiveBatcher& batcher) { batcher.probe_and_fit(executor); };

  xpm::PredictiveBatcher first(options_with_cap(5'000'000), std::make_shared<xpm::AdaptivePacker>());
  const xpm::LookedUpModel probed = xpm::look_up_or_probe(first, lookup, probe);
  CHECK_FALSE(probed.from_cache);
  CHECK(probed.probes.size() == static_cast<std::size_t>(executor.calls));
  CHECK(probed.infeasible_probes() >= 1);
  CHECK(first.model().metadata().at("optimizer") == "sgd");
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].rfind("xpm: " + std::to_string(executor.calls) + " probes (", 0) == 0);

  const int calls = executor.calls;
  xpm::PredictiveBatcher second(options_with_cap(5'000'000), std::make_shared<xpm::AdaptivePacker>());
  const xpm::LookedUpModel cached = xpm::look_up_or_probe(second, lookup, probe);
  CHECK(cached.from_cache);
  CHECK(cached.probes.empty());
  CHECK(cached.probe_s == 0);
  CHECK(executor.calls == calls);
  CHECK(second.model().coefficients() == first.model().coefficients());
  CHECK(second.model().metadata().at("optimizer") == "sgd");
  CHECK(lines.back().find("memory model from the cache (") != std::string::npos);

  lookup.needs_time_model = true;  // the fake probes are untimed: the cached model has none
  lookup.log_prefix = "job";
  xpm::PredictiveBatcher third(options_with_cap(5'000'000), std::make_shared<xpm::AdaptivePacker>());
  CHECK_FALSE(xpm::look_up_or_probe(third, lookup, probe).from_cache);
  CHECK(executor.calls > calls);
  CHECK(std::find(lines.begin(), lines.end(),
                  "job: the cached memory model has no time model, which the fastest packer needs: probing again") !=
        lines.end());
  CHECK_THROWS_AS(xpm::look_up_or_probe(third, lookup, {}), std::invalid_argument);
  std::filesystem::remove_all(folder);
}

TEST_CASE("an out-of-memory bound keeps batch size 1's own fit when the refit does, drops it when not") {
  // 5000 bytes per token and 2e6 bytes; a record alone skips a copy of 1000 bytes per token.
  xpm::PredictiveBatcherOptions o = options_with_cap(100'000'000);
  o.formula = xpm::CostFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"});
  const auto truth = [](double bs, double l) { return (bs == 1 ? 4000 : 5000) * bs * l + 2e6; };
  std::vector<xpm::Measurement> measurements;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 32.0, 64.0, 128.0, 256.0}) measurements.push_back({{bs, l}, truth(bs, l)});
  }
  const xpm::FitResult fit = xpm::fit_coefficients(o.formula, measurements, {}, [] {
    xpm::FitOptions options;
    options.batch_size_variable = "bs";
    return options;
  }());
  REQUIRE(fit.summary.single_record_coefficients.size() == 2);
  xpm::MemoryModel model(o.formula, fit.coefficients, 0, "bs");
  model.set_single_record_coefficients(fit.summary.single_record_coefficients);
  REQUIRE(model.predict_bytes({1, 200}) == doctest::Approx(truth(1, 200)));

  SUBCASE("with the fit data: the refit's own fit of batch size 1") {
    for (const auto& m : measurements) model.metadata()["fit_measurements"].push_back({{"dims", m.dims}, {"bytes", m.bytes}});
    xpm::PredictiveBatcher batcher(o, std::make_shared<xpm::AdaptivePacker>());
    batcher.set_model(model);
    batcher.add_infeasible_bound({{64, 128}, 5e6});  // far above: the refit is the fit
    REQUIRE(batcher.corrections() == 1);
    CHECK(batcher.model().single_record_coefficients().size() == 2);
    CHECK(batcher.model().predict_bytes({1, 200}) == doctest::Approx(truth(1, 200)).epsilon(1e-6));
    CHECK(batcher.model().predict_bytes({2, 200}) == doctest::Approx(truth(2, 200)).epsilon(1e-6));
  }
  SUBCASE("without it, a bound at batch size 1 drops that fit: the trend's safe side") {
    xpm::PredictiveBatcher batcher(o, std::make_shared<xpm::AdaptivePacker>());
    batcher.set_model(model);
    batcher.add_infeasible_bound({{1, 512}, truth(1, 512) - 1});
    CHECK(batcher.model().single_record_coefficients().empty());
    CHECK(batcher.model().predict_bytes({1, 200}) == doctest::Approx(truth(2, 100)).epsilon(1e-6));
    CHECK(batcher.model().predict_bytes({1, 512}) >= truth(1, 512) - 1);
  }
}
