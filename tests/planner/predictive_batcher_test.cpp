#include <doctest/doctest.h>

#include <algorithm>
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
