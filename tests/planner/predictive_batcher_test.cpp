#include <doctest/doctest.h>

#include <cmath>

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

TEST_CASE("a budget below the static memory is an error before any probe") {
  FakeExecutor executor(1e12);
  xpm::PredictiveBatcher batcher(options_with_cap(1'000'000), std::make_shared<xpm::AdaptivePacker>());
  CHECK_THROWS_AS(batcher.probe_and_fit(executor), std::invalid_argument);
  CHECK(executor.calls == 0);
}

TEST_CASE("online correction refits with a measurement above the prediction") {
  xpm::PredictiveBatcherOptions o = options_with_cap(100'000'000);
  xpm::PredictiveBatcher batcher(o, std::make_shared<xpm::AdaptivePacker>());
  xpm::MemoryModel model(xpm::CostFormula(o.formula, o.coefficient_names, o.variable_names),
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
  batcher.set_model(xpm::MemoryModel(xpm::CostFormula(o.formula, o.coefficient_names, o.variable_names),
                                     {10, 1000, 1e6}, 0, "bs"));
  batcher.add_measurement({{4, 100}, 9e6});
  CHECK(batcher.model().predict_bytes({4, 100}) >= 9e6);
}
