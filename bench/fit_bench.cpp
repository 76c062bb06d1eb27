// fit_bench.cpp — the memory model's own costs: canonicalizing a formula, fitting it to probes
// (time vs number of probes), predicting and sizing a microbatch.
//
//   BM_Formula_Canonicalize/<formula>     parse + expand + canonical string + identity hash
//   BM_Fit_Linear/<probes>                fit_coefficients, default options (leave-one-out on:
//                                         one refit per probe, as xpm-train fits)
//   BM_Fit_LinearNoLeaveOneOut/<probes>   the same without leave-one-out
//   BM_Fit_Nonlinear/<probes>             max(c, a*bs*l^p) with the automatic start
//   BM_Fit_MaxFloor/<probes>/<noise>      max(f, a*bs*l^2 + b*bs*l + c), about a quarter of the
//                                         probes at the floor: the global fit over max()
//                                         assignments (branch and bound up to 16 probes,
//                                         multi-start beyond); noise 0 or 50 (0.5 % relative)
//   BM_Fit_MaxThreePieces/<probes>/<noise> max(p1, p2, f) with two quadratic pieces of one shape
//   BM_SelectFormula/<variables>          select_formula ("auto") on the probes of an encoder-
//                                         decoder (2: bs, l; 3: bs, ls, lt), about 56 of them
//   BM_ProbePhase/<variables>/<noise>     PredictiveBatcher::probe_and_fit with the formula
//                                         chosen: the design, the adaptive probes, every
//                                         selection (probes cost nothing here: all is fitting);
//                                         noise up to 0.3 % or 2 % (the adaptive design adds
//                                         probes where the candidates then disagree)
//   BM_Calibration_T5Run                  the calibration of a T5's 20 training steps (its real
//                                         peaks, tests/planner/t5_training_peaks.hpp): the
//                                         baseline of the refit's cost per step
//   BM_TrainingRefit_T5Run                those 20 steps through TrainingRefit::end_step (its
//                                         tries: linear candidates with held-out refits)
//   BM_MemoryModel_PredictBytes           one prediction
//   BM_MemoryModel_MaxMicrobatchSize      the largest bs that fits at one length
//
// Probes are synthetic: the Transformer tagger's fitted coefficients (a 96, b 25,811.8,
// c 49,091,683.6 bytes) at bs = 1, 2, 4, ... and l spread over 16..180, measured with a
// deterministic relative noise of 1e-5 (the held-out error of the real model is about that).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/formula_selection.hpp"
#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner/training_refit.hpp"

#include "t5_training_peaks.hpp"

namespace {

const char* const kTransformer = "a*bs*l^2 + b*bs*l + c";
const std::vector<double> kTransformerCoefficients = {96.0, 25811.8, 49091683.6};

// n probes: l cycles over 8 lengths in 16..180, bs doubles 1..64 every 8 probes.
std::vector<xpm::Measurement> synthetic_probes(const xpm::CostFormula& formula,
                                               const std::vector<double>& coefficients, int n) {
  std::mt19937 rng(7);
  std::normal_distribution<double> noise(0.0, 1e-5);
  std::vector<xpm::Measurement> probes;
  for (int i = 0; i < n; ++i) {
    const double l = 16 + (i % 8) * 23.0;
    const double bs = std::pow(2.0, (i / 8) % 7);
    const double bytes = formula.predict(coefficients, {bs, l}) * (1 + noise(rng));
    probes.push_back({{bs, l}, bytes});
  }
  return probes;
}

void BM_Formula_Canonicalize(benchmark::State& state, const std::string& text,
                             const std::vector<std::string>& coefficients, bool nonlinear) {
  xpm::CostFormulaOptions options;
  options.allow_nonlinear = nonlinear;
  for (auto _ : state) {
    const xpm::CostFormula formula(text, coefficients, {"bs", "l"}, options);
    benchmark::DoNotOptimize(formula.identity_hash());
  }
}
BENCHMARK_CAPTURE(BM_Formula_Canonicalize, transformer, std::string(kTransformer),
                  std::vector<std::string>{"a", "b", "c"}, false)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Formula_Canonicalize, bilstm, std::string("a*bs*(l-1) + b*bs + c"),
                  std::vector<std::string>{"a", "b", "c"}, false)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Formula_Canonicalize, nonlinear, std::string("max(c, a*bs*l^p)"),
                  std::vector<std::string>{"a", "c", "p"}, true)->Unit(benchmark::kMicrosecond);

void run_linear_fit(benchmark::State& state, bool leave_one_out) {
  const xpm::CostFormula formula(kTransformer, {"a", "b", "c"}, {"bs", "l"});
  const auto probes = synthetic_probes(formula, kTransformerCoefficients, static_cast<int>(state.range(0)));
  xpm::FitOptions options;
  options.leave_one_out = leave_one_out;
  options.batch_size_variable = "bs";
  double max_error = 0;
  for (auto _ : state) {
    const xpm::FitResult fit = xpm::fit_coefficients(formula, probes, options);
    max_error = fit.summary.max_rel_error;
    benchmark::DoNotOptimize(fit.coefficients.data());
  }
  state.counters["probes"] = static_cast<double>(probes.size());
  state.counters["max_rel_error"] = max_error;
}

void BM_Fit_Linear(benchmark::State& state) { run_linear_fit(state, true); }
void BM_Fit_LinearNoLeaveOneOut(benchmark::State& state) { run_linear_fit(state, false); }
BENCHMARK(BM_Fit_Linear)->Arg(4)->Arg(8)->Arg(16)->Arg(32)->Arg(64)->Arg(128)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Fit_LinearNoLeaveOneOut)->Arg(4)->Arg(8)->Arg(16)->Arg(32)->Arg(64)->Arg(128)
    ->Unit(benchmark::kMillisecond);

void BM_Fit_Nonlinear(benchmark::State& state) {
  xpm::CostFormulaOptions nonlinear;
  nonlinear.allow_nonlinear = true;
  const xpm::CostFormula formula("max(c, a*bs*l^p)", {"a", "c", "p"}, {"bs", "l"}, nonlinear);
  const auto probes = synthetic_probes(formula, {3000.0, 5e6, 1.6}, static_cast<int>(state.range(0)));
  xpm::FitOptions options;
  options.leave_one_out = false;
  double max_error = 0;
  for (auto _ : state) {
    const xpm::FitResult fit = xpm::fit_coefficients(formula, probes, options);
    max_error = fit.summary.max_rel_error;
    benchmark::DoNotOptimize(fit.coefficients.data());
  }
  state.counters["probes"] = static_cast<double>(probes.size());
  state.counters["max_rel_error"] = max_error;
}
BENCHMARK(BM_Fit_Nonlinear)->Arg(16)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond);

// n probes on a bs x l lattice: bs = 1, 2, 4, ... (n / 8 values when n >= 16, else 2), l spread
// over 8..192; a quarter lie below 6e7 bytes for the floor formula below.
std::vector<xpm::Measurement> lattice_probes(const xpm::CostFormula& formula,
                                             const std::vector<double>& coefficients, int n,
                                             double noise) {
  std::mt19937 rng(11);
  std::normal_distribution<double> relative(0.0, noise);
  const int batch_sizes = n >= 16 ? n / 8 : 2;
  const int lengths = n / batch_sizes;
  std::vector<xpm::Measurement> probes;
  for (int b = 0; b < batch_sizes; ++b) {
    for (int j = 0; j < lengths; ++j) {
      const double bs = std::pow(2.0, b + 1);
      const double l = 8 + j * (184.0 / std::max(1, lengths - 1));
      probes.push_back({{bs, l}, formula.predict(coefficients, {bs, l}) * (1 + relative(rng))});
    }
  }
  return probes;
}

// "... (branch and bound over the winning argument at each of 16 points, 62 restricted
// problems)" -> 62; 0 when absent.
double restricted_problems(const std::string& start) {
  const auto end = start.find(" restricted problems");
  if (end == std::string::npos) return 0;
  const auto begin = start.rfind(' ', end - 1);
  return std::stod(start.substr(begin + 1, end - begin - 1));
}

void run_max_fit(benchmark::State& state, const std::string& text,
                 const std::vector<std::string>& names, const std::vector<double>& truth) {
  const xpm::CostFormula formula(text, names, {"bs", "l"});
  // state.range(1): relative noise of the measurements, in units of 1e-4.
  const auto probes = lattice_probes(formula, truth, static_cast<int>(state.range(0)),
                                     static_cast<double>(state.range(1)) * 1e-4);
  xpm::FitOptions options;
  options.leave_one_out = false;
  options.batch_size_variable = "bs";
  xpm::FitResult fit;
  for (auto _ : state) {
    fit = xpm::fit_coefficients(formula, probes, options);
    benchmark::DoNotOptimize(fit.coefficients.data());
  }
  state.counters["probes"] = static_cast<double>(probes.size());
  state.counters["max_rel_error"] = fit.summary.max_rel_error;
  state.counters["exhaustive"] = fit.summary.start.find("globally") != std::string::npos ? 1 : 0;
  state.counters["restricted_problems"] = restricted_problems(fit.summary.start);
}

void BM_Fit_MaxFloor(benchmark::State& state) {
  run_max_fit(state, "max(f, a*bs*l^2 + b*bs*l + c)", {"a", "b", "c", "f"},
              {100.0, 20000.0, 4e7, 6e7});
}
BENCHMARK(BM_Fit_MaxFloor)->ArgsProduct({{8, 16, 64}, {0, 50}})->Unit(benchmark::kMillisecond);

void BM_Fit_MaxThreePieces(benchmark::State& state) {
  run_max_fit(state, "max(a1*bs*l^2 + b1*bs*l + c1, a2*bs*l^2 + b2*bs*l + c2, f)",
              {"a1", "b1", "c1", "a2", "b2", "c2", "f"},
              {300.0, 10000.0, 3e7, 20.0, 90000.0, 2.5e7, 3.3e7});
}
BENCHMARK(BM_Fit_MaxThreePieces)->ArgsProduct({{8, 16, 64}, {0, 50}})->Unit(benchmark::kMillisecond);

// An encoder-decoder's peak at dims (bs, ls[, lt]), bytes: attention over the source and the
// target and across them, activations per token, per-record buffers and 150 MB of weights and
// optimizer state; times a deterministic relative noise of up to `noise` (0.003: 0.3 %, the
// allocator's rounding).
double encoder_decoder_peak_bytes(const std::vector<double>& d, double noise = 0.003) {
  const double bs = d[0], ls = d[1], lt = d.size() > 2 ? d[2] : d[1] / 2;
  const double bytes = 40000 * bs * ls + 25000 * bs * lt + 30 * bs * ls * ls + 45 * bs * ls * lt +
                       20 * bs * lt * lt + 600000 * bs + 150e6;
  const double phase = std::sin(bs * 12.9898 + ls * 78.233 + lt * 37.719) * 43758.5453;
  return bytes * (1 + noise * (2 * (phase - std::floor(phase)) - 1));
}

std::vector<std::string> encoder_decoder_variables(int variables) {
  return variables == 3 ? std::vector<std::string>{"bs", "ls", "lt"} : std::vector<std::string>{"bs", "l"};
}

// 56 probes: bs in 1..16, lengths up to 256 (source) and 128 (target).
std::vector<xpm::Measurement> encoder_decoder_probes(int variables) {
  std::vector<xpm::Measurement> probes;
  const std::vector<double> batch_sizes = {1, 2, 3, 4, 6, 8, 12, 16};
  const std::vector<double> lengths = {32, 64, 96, 128, 160, 192, 256};
  for (std::size_t i = 0; i < batch_sizes.size() * lengths.size(); ++i) {
    const double bs = batch_sizes[i % batch_sizes.size()];
    const double ls = lengths[(i / batch_sizes.size() + i) % lengths.size()];
    std::vector<double> dims = {bs, ls};
    if (variables == 3) dims.push_back(16 + static_cast<double>((i * 37) % 113));
    probes.push_back({dims, encoder_decoder_peak_bytes(dims)});
  }
  return probes;
}

void BM_SelectFormula(benchmark::State& state) {
  const int variables = static_cast<int>(state.range(0));
  const auto probes = encoder_decoder_probes(variables);
  xpm::FormulaSelectionOptions options;
  options.floor = false;  // as the predictive batcher selects (its floor is its own)
  std::string chosen;
  for (auto _ : state) {
    const xpm::FormulaSelection selection =
        xpm::select_formula(encoder_decoder_variables(variables), probes, {}, options);
    chosen = selection.formula.canonical();
    state.counters["candidates"] = static_cast<double>(selection.candidates.size());
    state.counters["held_out_max_rel_error"] = selection.fit.summary.leave_one_out_max_rel_error;
  }
  state.SetLabel(chosen);
}
BENCHMARK(BM_SelectFormula)->Arg(2)->Arg(3)->Unit(benchmark::kMillisecond)->Iterations(1);

class EncoderDecoderExecutor : public xpm::ProbeExecutor {
 public:
  EncoderDecoderExecutor(double capacity_bytes, double noise) : capacity_bytes_(capacity_bytes), noise_(noise) {}
  xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
    xpm::ProbeResult r;
    r.dims = dims;
    r.capacity_bytes = capacity_bytes_;
    r.forward_backward_peak_bytes = encoder_decoder_peak_bytes(dims, noise_);
    r.optimizer_step_peak_bytes = 150e6 + 1e6;
    if (r.forward_backward_peak_bytes > capacity_bytes_) {
      r.feasible = false;
      r.forward_backward_peak_bytes = 0;
      r.error = "out of memory";
    }
    return r;
  }
  double static_bytes() override { return 150e6; }

 private:
  double capacity_bytes_;
  double noise_;
};

void BM_ProbePhase(benchmark::State& state) {
  const int variables = static_cast<int>(state.range(0));
  xpm::PredictiveBatcherOptions options;
  options.formula_choice = xpm::FormulaChoice::kAutomatic;
  options.formula = xpm::CostFormula::with_variables("c", encoder_decoder_variables(variables));
  options.variable_max = variables == 3 ? std::map<std::string, double>{{"bs", 16}, {"ls", 256}, {"lt", 128}}
                                        : std::map<std::string, double>{{"bs", 16}, {"l", 256}};
  options.budget = {400'000'000, 0.9, 0};
  std::string chosen;
  for (auto _ : state) {
    EncoderDecoderExecutor executor(400e6, static_cast<double>(state.range(1)) * 1e-3);
    xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
    const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
    chosen = model.formula().canonical();
    state.counters["probes"] = static_cast<double>(batcher.probes().size());
    state.counters["adaptive_probes"] = static_cast<double>(batcher.adaptive_report().added_probes);
    state.counters["held_out_max_rel_error"] = batcher.fit_summary().leave_one_out_max_rel_error;
  }
  state.SetLabel(chosen);
}
BENCHMARK(BM_ProbePhase)->ArgsProduct({{2, 3}, {3, 20}})->Unit(benchmark::kMillisecond)->Iterations(1);

xpm::MemoryModel transformer_model() {
  return xpm::MemoryModel(xpm::CostFormula(kTransformer, {"a", "b", "c"}, {"bs", "l"}),
                          kTransformerCoefficients, 69570620.0, "bs", {{"l", xpm::DimAggregation::kMax}});
}

void BM_Calibration_T5Run(benchmark::State& state) {
  const xpm::MemoryModel model = xpm::MemoryModel::from_json(nlohmann::json::parse(xpm_test::t5_probed_model_json()));
  const auto steps = xpm_test::t5_training_steps();
  for (auto _ : state) {
    xpm::Calibration calibration(21'600'000);
    for (std::size_t s = 0; s < steps.size(); ++s) {
      for (const xpm::TrainingPoint& point : steps[s])
        calibration.record_peak(model.predict_bytes(point.dims), point.peak_bytes, point.position);
      benchmark::DoNotOptimize(calibration.end_step(static_cast<std::int64_t>(s), calibration.step_row(0)));
    }
  }
}
BENCHMARK(BM_Calibration_T5Run)->Unit(benchmark::kMillisecond);

void BM_TrainingRefit_T5Run(benchmark::State& state) {
  const xpm::MemoryModel model = xpm::MemoryModel::from_json(nlohmann::json::parse(xpm_test::t5_probed_model_json()));
  const auto steps = xpm_test::t5_training_steps();
  for (auto _ : state) {
    xpm::TrainingRefit refit(model);
    for (std::size_t s = 0; s < steps.size(); ++s)
      benchmark::DoNotOptimize(refit.end_step(static_cast<std::int64_t>(s), steps[s]));
  }
}
BENCHMARK(BM_TrainingRefit_T5Run)->Unit(benchmark::kMillisecond)->Iterations(3);

void BM_MemoryModel_PredictBytes(benchmark::State& state) {
  const xpm::MemoryModel model = transformer_model();
  std::vector<double> dims = {8, 1};
  for (auto _ : state) {
    dims[1] = dims[1] < 180 ? dims[1] + 1 : 1;
    benchmark::DoNotOptimize(model.predict_bytes(dims));
  }
}
BENCHMARK(BM_MemoryModel_PredictBytes);

void BM_MemoryModel_MaxMicrobatchSize(benchmark::State& state) {
  const xpm::MemoryModel model = transformer_model();
  double l = 1;
  for (auto _ : state) {
    l = l < 180 ? l + 1 : 1;
    benchmark::DoNotOptimize(model.max_microbatch_size({1, l}, 88363094, 1 << 20));
  }
}
BENCHMARK(BM_MemoryModel_MaxMicrobatchSize);

}  // namespace

// BENCHMARK_MAIN(), but a command-line token Google Benchmark does not take is exit code 2.
int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
