// model_suite_test.cpp — the planner as a user meets it, on test models it has never seen
// (test_models.hpp): PredictiveBatcher::probe_and_fit with the automatic design (variable_max
// for every variable, no probe points) and a formula written for the model (and, in the cases
// "with no formula written", the formula chosen from the probes), then 16 held-out
// shapes measured with the same executor, each variable drawn independently (seeded) inside
// the probed range, bs >= 2. measure_model() returns the figures (probes, probe seconds, fit
// and leave-one-out errors, held-out max and mean error, or the planner's refusal), so the same
// models can be run again under another fit configuration (SuiteCase::base).
// Goal: every held-out shape within 1 % of its measured step peak. A case the planner does not
// meet is marked may_fail, with the figure measured. One more case fits the
// checkpointed char LM with the max() of pieces its fit suggests. A model of summed real tokens
// (packed) is probed with a sample of record lengths (record_dims_sample: mixes of records) and
// held out on random mixes of another sample.
#include "../torch_doctest.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "test_models.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"

namespace {

using xpm::test::TestModelKind;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// What to run on one model.
struct SuiteCase {
  SuiteCase(xpm::CostFormula formula, std::map<std::string, double> variable_max)
      : formula(std::move(formula)), variable_max(std::move(variable_max)) {}
  xpm::CostFormula formula;                     // the user's formula, variables in model order
  std::map<std::string, double> variable_max;   // every variable: the automatic design's range
  xpm::PredictiveBatcherOptions base;           // fit configuration; formula, variable_max,
                                                // probe points and budget are set from above
  int held_out_count = 16;                      // shapes measured after the fit
  unsigned seed = 20261202;                     // of the held-out shapes' generator
  /// Records like the training data's (base.record_dims_sample is set from it): the design
  /// probes mixes of them, and the held-out shapes are random mixes of another such sample.
  std::function<std::vector<std::vector<double>>(unsigned seed)> record_sample;
};

/// One held-out shape: predicted and measured step peak (bytes), signed relative error.
struct HeldOutShape {
  std::vector<double> dims;
  double predicted = 0;
  double measured = 0;
  double rel_error = 0;  // (predicted - measured) / measured
};

/// The figures of one model under one SuiteCase.
struct SuiteFigures {
  std::size_t probes = 0;               // probes run by probe_and_fit
  double probe_seconds = 0;             // sum of the probes' step times
  double probe_and_fit_seconds = 0;     // wall time of probe_and_fit
  double fit_max_rel_error = kNaN;      // FitSummary::max_rel_error
  double loo_max_rel_error = kNaN;      // FitSummary::leave_one_out_max_rel_error
  double held_out_max = kNaN;           // max |rel error| over the held-out shapes
  double held_out_mean = kNaN;          // mean |rel error|
  double held_out_worst_signed = kNaN;  // signed rel error of the worst shape (< 0: under)
  std::string refusal;                  // the planner's exception message; "" when it fitted
  std::string fit_report;               // the probes' peaks, then the fit's and the floor's
                                        // reports (only the probes when refused)
  std::vector<HeldOutShape> held_out;
  std::string chosen_formula;           // the fitted model's formula (chosen when automatic)
  std::string adaptive;                 // the adaptive design's report
};

std::string percent(double fraction) {
  std::ostringstream out;
  out.precision(3);
  out << fraction * 100 << " %";
  return out.str();
}

std::string dims_text(const std::vector<std::string>& names, const std::vector<double>& dims) {
  std::ostringstream out;
  for (std::size_t v = 0; v < dims.size(); ++v) out << (v ? " " : "") << names[v] << "=" << dims[v];
  return out.str();
}

std::string summary_line(const std::string& name, const SuiteFigures& f) {
  std::ostringstream out;
  out.precision(3);
  out << name << ": " << f.probes << " probes, " << f.probe_seconds << " s probing ("
      << f.probe_and_fit_seconds << " s probe_and_fit); ";
  if (!f.refusal.empty()) return out.str() + "refused: " + f.refusal;
  out << "fit max " << percent(f.fit_max_rel_error) << ", leave-one-out " << percent(f.loo_max_rel_error)
      << "; held-out max " << percent(f.held_out_max) << " ("
      << (f.held_out_worst_signed < 0 ? "under" : "over") << "), mean " << percent(f.held_out_mean);
  return out.str();
}

std::string probes_report(const std::vector<std::string>& names, const xpm::PredictiveBatcher& batcher) {
  std::ostringstream out;
  for (const xpm::ProbeResult& p : batcher.probes()) {
    out << "probe " << dims_text(names, p.dims) << ": forward/backward " << p.forward_backward_peak_bytes
        << " bytes, optimizer step " << p.optimizer_step_peak_bytes << " bytes"
        << (p.feasible ? "" : ", infeasible") << "\n";
  }
  return out.str();
}

std::string held_out_report(const std::vector<std::string>& names, const SuiteFigures& f) {
  std::ostringstream out;
  for (const HeldOutShape& s : f.held_out) {
    out << dims_text(names, s.dims) << ": predicted " << s.predicted / 1e6 << " MB, measured "
        << s.measured / 1e6 << " MB, " << (s.rel_error >= 0 ? "+" : "") << percent(s.rel_error) << "\n";
  }
  return out.str();
}

// Held-out dims: every variable uniform over the integers of its probed range, bs >= 2.
std::vector<std::vector<double>> draw_held_out(const xpm::MemoryModel& model, const SuiteCase& c) {
  std::mt19937 rng(c.seed);
  const std::vector<xpm::ProbedRange>& ranges = model.probed_ranges();
  std::vector<std::vector<double>> shapes;
  for (int i = 0; i < c.held_out_count; ++i) {
    std::vector<double> dims;
    for (std::size_t v = 0; v < ranges.size(); ++v) {
      const double low = v == model.batch_size_index() ? std::max(2.0, ranges[v].min) : ranges[v].min;
      std::uniform_int_distribution<std::int64_t> draw(static_cast<std::int64_t>(low),
                                                       static_cast<std::int64_t>(ranges[v].max));
      dims.push_back(static_cast<double>(draw(rng)));
    }
    shapes.push_back(dims);
  }
  return shapes;
}

// Held-out mixes: 1 to variable_max[bs] records drawn at random (unsorted) from another sample.
std::vector<std::vector<std::vector<double>>> draw_held_out_mixes(const SuiteCase& c) {
  const std::vector<std::vector<double>> sample = c.record_sample(c.seed + 1000);
  std::mt19937 rng(c.seed);
  std::uniform_int_distribution<std::size_t> size(1, static_cast<std::size_t>(c.variable_max.at("bs")));
  std::uniform_int_distribution<std::size_t> record(0, sample.size() - 1);
  std::vector<std::vector<std::vector<double>>> mixes(static_cast<std::size_t>(c.held_out_count));
  for (auto& mix : mixes) {
    for (std::size_t n = size(rng); n > 0; --n) mix.push_back(sample[record(rng)]);
  }
  return mixes;
}

void measure_held_out(const xpm::MemoryModel& model, xpm::ProbeExecutor& executor, const SuiteCase& c,
                      SuiteFigures& f) {
  double sum = 0;
  f.held_out_max = 0;
  std::vector<std::vector<std::vector<double>>> mixes;
  std::vector<std::vector<double>> shapes;
  if (c.record_sample) {
    mixes = draw_held_out_mixes(c);
    std::vector<std::size_t> all;
    for (const auto& mix : mixes) {
      all.resize(mix.size());
      std::iota(all.begin(), all.end(), std::size_t{0});
      shapes.push_back(xpm::aggregate_dims(mix, all, model));
    }
  } else {
    shapes = draw_held_out(model, c);
  }
  for (std::size_t k = 0; k < shapes.size(); ++k) {
    const std::vector<double>& dims = shapes[k];
    const xpm::ProbeResult measured = c.record_sample ? executor.run_probe_records(mixes[k]) : executor.run_probe(dims);
    REQUIRE(measured.feasible);
    HeldOutShape s{dims, model.predict_bytes(dims), measured.step_peak_bytes(), 0};
    s.rel_error = (s.predicted - s.measured) / s.measured;
    if (std::abs(s.rel_error) >= f.held_out_max) {
      f.held_out_max = std::abs(s.rel_error);
      f.held_out_worst_signed = s.rel_error;
    }
    sum += std::abs(s.rel_error);
    f.held_out.push_back(s);
  }
  f.held_out_mean = sum / static_cast<double>(f.held_out.size());
}

xpm::PredictiveBatcherOptions batcher_options(const SuiteCase& c) {
  xpm::PredictiveBatcherOptions options = c.base;
  options.formula = c.formula;
  options.variable_max = c.variable_max;
  if (c.record_sample) options.record_dims_sample = c.record_sample(c.seed);
  options.probe_points.clear();                            // the automatic design
  options.budget.capacity_bytes = std::int64_t{1} << 40;  // never binds within variable_max
  return options;
}

/// Probes and fits `model` under `c`, then measures the held-out shapes with the same executor
/// (CpuMemoryMeter, no cap, one thread). A fit the planner refuses is recorded, not thrown.
/// Build `model` after CpuMemoryMeter::install(): storages allocated before it (weights,
/// gradients, optimizer state) are not counted.
SuiteFigures measure_model(xpm::test::TestModel& model, const SuiteCase& c) {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::instance();
  xpm::ScopedMemoryCap no_cap(0);
  torch::set_num_threads(1);  // peaks of some kernels depend on the thread count
  xpm::TorchProbeExecutor executor(model.probe_steps(), meter);
  xpm::PredictiveBatcher batcher(batcher_options(c), std::make_shared<xpm::AdaptivePacker>());
  SuiteFigures f;
  const auto start = std::chrono::steady_clock::now();
  try {
    batcher.probe_and_fit(executor);
  } catch (const std::exception& e) {
    f.refusal = e.what();
  }
  f.probe_and_fit_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  f.probes = batcher.probes().size();
  for (const xpm::ProbeResult& p : batcher.probes()) f.probe_seconds += p.duration_s;
  f.fit_report = probes_report(c.formula.variable_names(), batcher);
  if (!f.refusal.empty()) return f;
  f.fit_report += batcher.fit_summary().full_report() + "\n" + batcher.floor_fit().report + "\n" +
                  batcher.selection_report() + batcher.adaptive_report().describe(batcher.model().formula());
  f.chosen_formula = batcher.model().formula().canonical();
  f.adaptive = batcher.adaptive_report().describe(batcher.model().formula());
  f.fit_max_rel_error = batcher.fit_summary().max_rel_error;
  f.loo_max_rel_error = batcher.fit_summary().leave_one_out_max_rel_error;
  measure_held_out(batcher.model(), executor, c, f);
  return f;
}

// Runs `kind` under `c`, prints its figures and checks the goal: fitted, held-out within 1 %.
void check_held_out_within_one_percent(TestModelKind kind, const SuiteCase& c) {
  xpm::CpuMemoryMeter::install();  // first: the model's static memory is counted
  const std::unique_ptr<xpm::test::TestModel> model = xpm::test::make_test_model(kind);
  const SuiteFigures f = measure_model(*model, c);
  const std::string line = summary_line(model->name() + ", " + c.formula.text(), f) + "; formula " +
                           f.chosen_formula + "; " + f.adaptive;
  MESSAGE(line);
  INFO(f.fit_report);
  INFO(held_out_report(model->variable_names(), f));
  CHECK_MESSAGE(f.refusal.empty(), f.refusal);
  CHECK(f.held_out_max <= 0.01);
}

SuiteCase suite_case(const std::string& formula, const std::vector<std::string>& variables,
                     std::map<std::string, double> variable_max) {
  return SuiteCase(xpm::CostFormula::with_variables(formula, variables), std::move(variable_max));
}

// No formula written: the planner chooses it from the probes (FormulaChoice::kAutomatic).
SuiteCase auto_case(const std::vector<std::string>& variables, std::map<std::string, double> variable_max) {
  SuiteCase c(xpm::CostFormula::with_variables("xpm_constant", variables), std::move(variable_max));
  c.base.formula_choice = xpm::FormulaChoice::kAutomatic;
  return c;
}

}  // namespace

// Each length moved on its own by the automatic design: measured held-out max 0.0013 % (42
// probes; when ls and lt moved together, the fit was refused: their terms could not be told apart).
TEST_CASE("an encoder-decoder Transformer's held-out peaks are predicted within 1 % from the automatic design") {
  check_held_out_within_one_percent(
      TestModelKind::kEncoderDecoder,
      suite_case("a*bs*ls^2 + b*bs*lt^2 + d*bs*ls*lt + e*bs*ls + f*bs*lt + c", {"bs", "ls", "lt"},
                 {{"bs", 32}, {"ls", 96}, {"lt", 64}}));
}

// Not met, measured: held-out max 3.99 % (over, the safe side), mean 2.0 % (50 probes). The 15
// probes at bs = 1 lie up to 16 % above the trend of larger microbatches (another convolution
// path at batch 1): left out, and bs = 1 scaled by 1.19. The rest: max_pool2d floors h/2 and h/4,
// so the odd sizes of the held-out shapes take less than the multiples of 4 the design probes,
// and no polynomial in h and w follows floor(h/4).
TEST_CASE("a variable-size image CNN's held-out peaks are predicted within 1 % from the automatic design" *
          doctest::may_fail()) {
  check_held_out_within_one_percent(
      TestModelKind::kVariableImageCnn,
      suite_case("a*bs*h*w + b*bs + c", {"bs", "h", "w"}, {{"bs", 32}, {"h", 64}, {"w", 96}}));
}

// Not met, measured: fit max 1.63 %, leave-one-out 2.36 %, held-out max 1.4 % (over), mean
// 0.55 % (22 probes, 4 adaptive); the fit's residual note finds the signs grouped by bs and
// suggests a max() of two pieces (the next case).
TEST_CASE("a character LM with activation checkpointing has held-out peaks predicted within 1 % from the automatic design" *
          doctest::may_fail()) {
  check_held_out_within_one_percent(
      TestModelKind::kCheckpointedCharLm,
      suite_case("a*bs*l^2 + b*bs*l + c", {"bs", "l"}, {{"bs", 32}, {"l", 192}}));
}

// The same model with the max() of two pieces that the fit's residual note above suggests.
TEST_CASE("a character LM with activation checkpointing fitted with a max() of two pieces has held-out peaks predicted within 1 %") {
  check_held_out_within_one_percent(
      TestModelKind::kCheckpointedCharLm,
      suite_case("max(a1*bs*l^2 + b1*bs*l + c1, a2*bs*l^2 + b2*bs*l + c2)", {"bs", "l"},
                 {{"bs", 32}, {"l", 192}}));
}

TEST_CASE("an LSTM over packed sequences has held-out peaks predicted within 1 % from the automatic design") {
  check_held_out_within_one_percent(
      TestModelKind::kPackedLstm, suite_case("a*bs*l + b*bs + c", {"bs", "l"}, {{"bs", 32}, {"l", 96}}));
}

namespace {

// Records {1, l, t} (t = l, the real tokens) of lengths 2..96, skewed toward short ones as
// sentence lengths are.
std::vector<std::vector<double>> length_sample(unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<std::vector<double>> records;
  for (int i = 0; i < 2000; ++i) {
    const double u = unit(rng), l = std::floor(2 + 94 * u * u);
    records.push_back({1, l, l});
  }
  return records;
}

// Real mixes of lengths: the padded length (max) and the real tokens (summed) apart.
SuiteCase packed_mix_case(SuiteCase c) {
  c.base.aggregation = {{"t", xpm::DimAggregation::kSum}};
  c.record_sample = length_sample;
  return c;
}

}  // namespace

TEST_CASE("a tagger over packed real tokens has held-out mixes of real lengths predicted within 1 % from a record sample") {
  check_held_out_within_one_percent(
      TestModelKind::kPackedTokenTagger,
      packed_mix_case(suite_case("a*bs*l + b*t + d*bs + c", {"bs", "l", "t"}, {{"bs", 32}})));
}

TEST_CASE("with no formula written, a tagger over packed real tokens has held-out mixes predicted within 1 %") {
  check_held_out_within_one_percent(TestModelKind::kPackedTokenTagger,
                                    packed_mix_case(auto_case({"bs", "l", "t"}, {{"bs", 32}})));
}

TEST_CASE("a pre-norm Transformer whose peak moves between operations has held-out peaks predicted within 1 % from the automatic design") {
  check_held_out_within_one_percent(
      TestModelKind::kPreNormTransformer,
      suite_case("max(a1*bs*l^2 + b1*bs*l + c1, a2*bs*l^2 + b2*bs*l + c2)", {"bs", "l"},
                 {{"bs", 32}, {"l", 192}}));
}

// No formula written: the planner chooses it from the probes, for every model of the suite.
TEST_CASE("with no formula written, an encoder-decoder's held-out peaks are predicted within 1 %") {
  check_held_out_within_one_percent(TestModelKind::kEncoderDecoder,
                                    auto_case({"bs", "ls", "lt"}, {{"bs", 32}, {"ls", 96}, {"lt", 64}}));
}

// Not met, measured: chose a1*bs*h*w + c, held-out max 3.95 % (over), mean 2.0 %, the cause as
// above (max_pool2d's floors); the adaptive design spends its 8 probes at bs = 1.
TEST_CASE("with no formula written, a variable-size image CNN's held-out peaks are predicted within 1 %" *
          doctest::may_fail()) {
  check_held_out_within_one_percent(TestModelKind::kVariableImageCnn,
                                    auto_case({"bs", "h", "w"}, {{"bs", 32}, {"h", 64}, {"w", 96}}));
}

TEST_CASE("with no formula written, a checkpointed character LM's held-out peaks are predicted within 1 %") {
  check_held_out_within_one_percent(TestModelKind::kCheckpointedCharLm,
                                    auto_case({"bs", "l"}, {{"bs", 32}, {"l", 192}}));
}

TEST_CASE("with no formula written, a packed-sequence LSTM's held-out peaks are predicted within 1 %") {
  check_held_out_within_one_percent(TestModelKind::kPackedLstm, auto_case({"bs", "l"}, {{"bs", 32}, {"l", 96}}));
}

TEST_CASE("with no formula written, a moving-peak pre-norm Transformer's held-out peaks are predicted within 1 %") {
  check_held_out_within_one_percent(TestModelKind::kPreNormTransformer,
                                    auto_case({"bs", "l"}, {{"bs", 32}, {"l", 192}}));
}
