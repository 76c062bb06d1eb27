// unseen_models_test.cpp — the planner on models it has never seen (test_models.hpp): exact CPU
// peaks on a 10 x 10 grid of shapes, 16 of them probed (bs 1, 4, 12, 32 x l 8, 32, 96, 192),
// the other 84 held out, by both routes a user takes:
//  - whole step: one peak per step (what a single meter reading or
//    torch.cuda.max_memory_allocated gives), the floor written into the formula,
//    max(f + d*bs*l, a*bs*l^2 + b*bs*l + c), fitted by fit_coefficients;
//  - per phase: PredictiveBatcher::probe_and_fit with the same 16 probe points, forward/backward
//    peaks fitted above a floor fitted to the optimizer-step peaks (constant or moving), formula
//    max(a1*bs*l^2 + b1*bs*l + c1, a2*bs*l^2 + b2*bs*l + c2) (the peak moves between operations).
// Goal: every held-out microbatch of 2 or more records within 1 % of its measured step peak.
// Microbatches of one record often peak below the trend of larger ones (other kernels; copies of
// a size-1 batch dimension skipped): the fits leave those probes out and over-predict them, so
// at bs = 1 the test asks for the safe side: at most 1 % under, at most 3 % over.
#include "../torch_doctest.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "test_models.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"

namespace {

using xpm::test::TestModelKind;

const std::vector<double> kBatchSizes = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32};
const std::vector<double> kLengths = {8, 16, 24, 32, 48, 64, 96, 128, 160, 192};
const std::vector<double> kProbedBatchSizes = {1, 4, 12, 32};
const std::vector<double> kProbedLengths = {8, 32, 96, 192};

bool probed(const std::vector<double>& dims) {
  const auto in = [](const std::vector<double>& list, double v) {
    return std::find(list.begin(), list.end(), v) != list.end();
  };
  return in(kProbedBatchSizes, dims[0]) && in(kProbedLengths, dims[1]);
}

struct Grid {
  std::vector<xpm::ProbeResult> probes;  // the 16 probed shapes
  std::vector<xpm::ProbeResult> held_out;
};

Grid measure_grid(xpm::TorchProbeExecutor& executor) {
  Grid grid;
  for (double bs : kBatchSizes) {
    for (double l : kLengths) {
      xpm::ProbeResult r = executor.run_probe({bs, l});
      REQUIRE(r.feasible);
      (probed(r.dims) ? grid.probes : grid.held_out).push_back(std::move(r));
    }
  }
  return grid;
}

// Replays measured probes (so both routes see exactly the same peaks).
class ReplayExecutor final : public xpm::ProbeExecutor {
 public:
  ReplayExecutor(const std::vector<xpm::ProbeResult>& probes, double static_bytes)
      : probes_(probes), static_bytes_(static_bytes) {}
  xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
    for (const xpm::ProbeResult& p : probes_) {
      if (p.dims == dims) return p;
    }
    FAIL("no measured probe at the asked dims");
    return {};
  }
  double static_bytes() override { return static_bytes_; }

 private:
  const std::vector<xpm::ProbeResult>& probes_;
  double static_bytes_;
};

struct HeldOutError {
  double max_abs_multi = 0;      // |rel error| over held-out shapes with bs >= 2
  double worst_under_single = 0;  // most negative rel error at bs = 1 (0 when none)
  double worst_over_single = 0;   // largest rel error at bs = 1
  std::string report;
};

HeldOutError held_out_error(const xpm::MemoryModel& model, const std::vector<xpm::ProbeResult>& held) {
  HeldOutError out;
  std::ostringstream report;
  for (const xpm::ProbeResult& p : held) {
    const double e = (model.predict_bytes(p.dims) - p.step_peak_bytes()) / p.step_peak_bytes();
    if (p.dims[0] >= 2) {
      out.max_abs_multi = std::max(out.max_abs_multi, std::abs(e));
    } else {
      out.worst_under_single = std::min(out.worst_under_single, e);
      out.worst_over_single = std::max(out.worst_over_single, e);
    }
    report << "bs=" << p.dims[0] << " l=" << p.dims[1] << ": " << e * 100 << " %\n";
  }
  out.report = report.str();
  return out;
}

void check(const HeldOutError& e, const std::string& route) {
  MESSAGE(route << ": held-out max |error| at bs >= 2 " << e.max_abs_multi * 100 << " %, at bs = 1 "
                << e.worst_under_single * 100 << " % to +" << e.worst_over_single * 100 << " %");
  INFO(e.report);
  CHECK(e.max_abs_multi <= 0.01);
  CHECK(e.worst_under_single >= -0.01);
  CHECK(e.worst_over_single <= 0.03);
}

xpm::MemoryModel whole_step_model(const Grid& grid) {
  const xpm::CostFormula formula("max(f + d*bs*l, a*bs*l^2 + b*bs*l + c)",
                                 {"a", "b", "c", "d", "f"}, {"bs", "l"});
  std::vector<xpm::Measurement> peaks;
  for (const xpm::ProbeResult& p : grid.probes) peaks.push_back({p.dims, p.step_peak_bytes()});
  xpm::FitOptions options;
  options.batch_size_variable = "bs";
  const xpm::FitResult fit = xpm::fit_coefficients(formula, peaks, options);
  INFO(fit.summary.full_report());
  REQUIRE(fit.summary.usable);
  CHECK(fit.summary.start.find("max() resolved globally") != std::string::npos);
  return xpm::MemoryModel(formula, fit.coefficients, 0.0, "bs");
}

xpm::MemoryModel per_phase_model(const Grid& grid, double static_bytes) {
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula("max(a1*bs*l^2 + b1*bs*l + c1, a2*bs*l^2 + b2*bs*l + c2)",
                                     {"a1", "b1", "c1", "a2", "b2", "c2"}, {"bs", "l"});
  options.budget.capacity_bytes = std::int64_t{1} << 40;  // no cap: the probes all fit
  for (const xpm::ProbeResult& p : grid.probes) {
    options.probe_points.push_back({{{"bs", p.dims[0]}, {"l", p.dims[1]}}});
  }
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  ReplayExecutor replay(grid.probes, static_bytes);
  const xpm::MemoryModel& model = batcher.probe_and_fit(replay);
  INFO(batcher.fit_summary().full_report());
  INFO(batcher.floor_fit().report);
  CHECK(batcher.fit_summary().usable);
  return model;
}

void check_both_routes(TestModelKind kind) {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  xpm::ScopedMemoryCap no_cap(0);
  torch::set_num_threads(1);  // peaks of some kernels depend on the thread count
  const std::unique_ptr<xpm::test::TestModel> model = xpm::test::make_test_model(kind);
  xpm::TorchProbeExecutor executor(model->probe_steps(), meter);
  const double static_bytes = executor.static_bytes();
  const Grid grid = measure_grid(executor);
  REQUIRE(grid.probes.size() == 16);
  REQUIRE(grid.held_out.size() == 84);
  INFO(model->name());
  {
    INFO("whole step: max(f + d*bs*l, a*bs*l^2 + b*bs*l + c) on the step peaks");
    check(held_out_error(whole_step_model(grid), grid.held_out), model->name() + ", whole step");
  }
  {
    INFO("per phase: PredictiveBatcher, floor from the optimizer-step peaks");
    check(held_out_error(per_phase_model(grid, static_bytes), grid.held_out), model->name() + ", per phase");
  }
}

}  // namespace

TEST_CASE("held-out peaks of an unseen Transformer tagger (Adam) are predicted within 1 % by both routes") {
  check_both_routes(TestModelKind::kTransformerTagger);
}

TEST_CASE("held-out peaks of an unseen GRU tagger (SGD momentum) are predicted within 1 % by both routes") {
  check_both_routes(TestModelKind::kGruTagger);
}

TEST_CASE("held-out peaks of an unseen convolution classifier (RMSprop) are predicted within 1 % by both routes") {
  check_both_routes(TestModelKind::kConvClassifier);
}

TEST_CASE("held-out peaks of an unseen pre-norm Transformer with a moving floor are predicted within 1 % by both routes") {
  check_both_routes(TestModelKind::kPreNormTransformer);
}
