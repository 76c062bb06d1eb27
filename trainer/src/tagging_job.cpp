#include "xpm/trainer/tagging_job.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include <torch/torch.h>

#include "xpm/planner/memory_model_cache.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/trainer/brown_corpus.hpp"
#include "xpm/trainer/data_parallel_trainer.hpp"
#include "xpm/trainer/distributed.hpp"
#include "xpm/trainer/fixed_batchers.hpp"
#include "xpm/trainer/gradient_buckets.hpp"
#include "xpm/trainer/loss_trainer.hpp"
#include "xpm/planner/atomic_file.hpp"
#include "xpm/trainer/tagging_batch.hpp"
#include "xpm/trainer/tagging_task.hpp"

namespace xpm {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::int64_t physical_memory_bytes() {
  return static_cast<std::int64_t>(::sysconf(_SC_PHYS_PAGES)) *
         static_cast<std::int64_t>(::sysconf(_SC_PAGE_SIZE));
}

// Intra-op threads per worker when --threads is 0: the host's hardware threads shared among the
// workers on this host, so N workers do not oversubscribe the cores.
int default_worker_threads(int local_world_size) {
  const int hardware = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  return std::max(1, hardware / std::max(1, local_world_size));
}

// Test hook: XPM_FAULT_EXIT_AT=R:S makes rank R exit (code 17) at the start of step S;
// XPM_FAULT_EXIT_AT=R:S:kill makes it kill itself with SIGKILL there instead.
struct FaultInjection {
  int rank = -1;
  std::int64_t step = -1;
  bool kill = false;
};

FaultInjection fault_injection_from_environment() {
  FaultInjection fault;
  const char* text = std::getenv("XPM_FAULT_EXIT_AT");
  if (text == nullptr) return fault;
  long long rank = -1, step = -1;
  char mode[8] = {0}, tail = 0;
  const int fields = std::sscanf(text, "%lld:%lld:%7[a-z]%c", &rank, &step, mode, &tail);
  if (fields < 2 || fields > 3 || rank < 0 || step < 1 ||
      (fields == 3 && std::string(mode) != "kill")) {
    throw std::invalid_argument("environment variable XPM_FAULT_EXIT_AT='" + std::string(text) +
                                "' must be RANK:STEP or RANK:STEP:kill with RANK >= 0 and STEP >= 1");
  }
  fault.rank = static_cast<int>(rank);
  fault.step = step;
  fault.kill = fields == 3;
  return fault;
}

// Parameters by name (torch::serialize archive), written to a temporary file and renamed.
void save_parameters_atomically(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& item : module.named_parameters()) archive.write(item.key(), item.value());
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  archive.save_to(temporary);
  std::filesystem::rename(temporary, path);
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

// Linear warmup to the peak, then linear decay to 10 % of it at the last step.
double scheduled_learning_rate(const TaggingJobConfig& config, std::int64_t step,
                               std::int64_t total_steps) {
  const double peak = config.learning_rate;
  if (step < config.warmup_steps) return peak * static_cast<double>(step + 1) / config.warmup_steps;
  const double span = std::max<std::int64_t>(1, total_steps - config.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - config.warmup_steps) / span);
  return peak * (1.0 - 0.9 * progress);
}

// What the memory model depends on: a change of any field probes again (DESIGN.md section 3).
nlohmann::json memory_model_identity(const TaggingJobConfig& config,
                                     const PredictiveBatcherOptions& batcher_options,
                                     const nlohmann::json& model_signature,
                                     std::int64_t capacity_bytes, int world_size) {
  nlohmann::json probe_points = nlohmann::json::array();
  for (const ProbePoint& point : batcher_options.probe_points) probe_points.push_back(point.values);
  const CostFormula formula(batcher_options.formula, batcher_options.coefficient_names,
                            batcher_options.variable_names);
  return {{"xpm_memory_model_format", 1},
          {"formula", formula.canonical()},
          {"coefficient_names", formula.coefficient_names()},
          {"variable_names", formula.variable_names()},
          {"model_signature", model_signature},
          {"architecture", config.architecture},
          {"model", config.architecture == "bilstm"
                        ? nlohmann::json{{"dropout", config.bilstm.dropout}}
                        : nlohmann::json{{"nhead", config.model.nhead}, {"dropout", config.model.dropout}}},
          {"optimizer", {{"name", "adamw"}, {"weight_decay", config.weight_decay}}},
          {"precision", "32-true"},
          {"device", "cpu"},
          {"world_size", world_size},
          {"torch_version", TORCH_VERSION},
          {"capacity_bytes", capacity_bytes},
          {"memory_fraction", batcher_options.budget.memory_fraction},
          {"extra_overhead_bytes", batcher_options.budget.extra_overhead_bytes},
          {"probe_points", probe_points},
          {"variable_max", batcher_options.variable_max},
          {"design_fractions", batcher_options.design_fractions}};
}

struct Accuracy {
  std::int64_t correct = 0;
  std::int64_t total = 0;
  std::int64_t ooms = 0;  // validation microbatches that ran out of memory
  double value() const { return total == 0 ? 0.0 : static_cast<double>(correct) / total; }
};

// Microbatches of a list of records given their dims {bs, l}: the predictive batcher's plan,
// or fixed slices of the fixed/power batcher's current microbatch size.
using PlanFn = std::function<MicrobatchPlan(const std::vector<std::vector<double>>&)>;

// Token accuracy over every token (tags unseen in training count as errors, as in the baseline).
// Under DDP each rank evaluates every world_size-th sentence and the counts are summed.
Accuracy evaluate(TaggingModelSetup& setup, const std::vector<EncodedSentence>& sentences,
                  const PlanFn& plan_of, std::size_t l_index, DistributedContext& dist) {
  torch::NoGradGuard no_grad;
  setup.module().eval();
  std::vector<std::size_t> mine;
  for (std::size_t i = static_cast<std::size_t>(dist.rank()); i < sentences.size();
       i += static_cast<std::size_t>(dist.world_size())) {
    mine.push_back(i);
  }
  std::vector<std::vector<double>> dims(mine.size(), std::vector<double>(2, 1.0));
  for (std::size_t i = 0; i < mine.size(); ++i)
    dims[i][l_index] = static_cast<double>(sentences[mine[i]].token_ids.size());
  Accuracy accuracy;
  const MicrobatchPlan plan = plan_of(dims);
  for (const Microbatch& microbatch : plan.microbatches) {
    std::vector<std::size_t> ids;
    for (std::size_t j : microbatch.record_indices) ids.push_back(mine[j]);
    const TaggingBatch batch = collate(sentences, ids);
    try {
      const torch::Tensor predicted = setup.forward(batch.token_ids, batch.padding_mask).argmax(-1);
      const torch::Tensor real = batch.padding_mask.logical_not();
      accuracy.correct += (predicted.eq(batch.tag_ids).logical_and(real)).sum().item<std::int64_t>();
    } catch (const c10::OutOfMemoryError&) {
      ++accuracy.ooms;  // its tokens count as errors: the accuracy never looks better for an OOM
    }
    accuracy.total += batch.real_tokens;
  }
  setup.module().train();
  const std::vector<double> totals = dist.all_reduce(
      {static_cast<double>(accuracy.correct), static_cast<double>(accuracy.total),
       static_cast<double>(accuracy.ooms)},
      ReduceOp::kSum);
  accuracy.correct = static_cast<std::int64_t>(totals[0]);
  accuracy.total = static_cast<std::int64_t>(totals[1]);
  accuracy.ooms = static_cast<std::int64_t>(totals[2]);
  return accuracy;
}

}  // namespace

nlohmann::json run_tagging_job(const TaggingJobConfig& config) {
  DistributedContext single_process;
  return run_tagging_job(config, single_process);
}

nlohmann::json run_tagging_job(const TaggingJobConfig& config, DistributedContext& dist) {
  config.validate();
  // The batchers without a memory model run in a single process: every rank refuses, now.
  if (config.batcher == "power") PowerAdaptativeBatcher::check_single_process(dist.world_size());
  if (config.batcher == "fixed" && dist.world_size() > 1) {
    throw std::invalid_argument(
        "TaggingJobConfig.batcher 'fixed' runs in a single process only, got world_size " +
        std::to_string(dist.world_size()) + ": the data-parallel step exists for the predictive "
        "batcher (TaggingJobConfig.batcher predictive, the default)");
  }
  const bool predictive = config.batcher == "predictive";
  const auto job_start = Clock::now();
  const bool main_rank = dist.is_main();
  const auto log = [&](const std::string& line) {
    if (!config.quiet && main_rank) std::cout << line << std::endl;
  };
  if (main_rank) std::filesystem::create_directories(config.run_dir);
  const int threads = config.threads > 0 ? config.threads
                                         : default_worker_threads(dist.environment().local_world_size);
  torch::set_num_threads(threads);
  torch::manual_seed(config.seed);
  const FaultInjection fault = fault_injection_from_environment();

  // Data.
  const TaggingData data = [&] {
    try {
      return load_tagging_data(config);
    } catch (const std::runtime_error& error) {  // missing or malformed corpus: bad input
      throw std::invalid_argument(std::string("--data-dir: ") + error.what());
    }
  }();
  for (const ProbePoint& point : config.probe_points) {
    const double l = point.values.at("l");
    const std::int64_t max_length = max_sequence_length(config, data);
    if (l > static_cast<double>(max_length)) {
      throw std::invalid_argument("--probe-points: l = " + std::to_string(static_cast<long long>(l)) +
                                  " is longer than the model's max length " + std::to_string(max_length));
    }
  }
  const std::vector<EncodedSentence>& train = data.train;
  const std::vector<EncodedSentence>& validation = data.validation;
  const double baseline_accuracy =
      most_frequent_tag_accuracy(data.train_sentences, data.validation_sentences);
  log("xpm-train: " + std::to_string(data.file_count) + " files, " +
      std::to_string(train.size()) + " train / " + std::to_string(validation.size()) +
      " validation sentences, vocabulary " + std::to_string(data.vocab.size()) + ", " +
      std::to_string(data.tags.size()) + " tags, longest sentence " +
      std::to_string(data.max_length) + " tokens");

  // Model, optimizer, static memory: everything from here is counted by the meter.
  CpuMemoryMeter& meter = CpuMemoryMeter::install();
  meter.set_capacity_bytes(0);
  TaggingModelSetup setup(config, data);
  torch::optim::AdamW& optimizer = setup.optimizer();
  const std::int64_t static_bytes = meter.current_allocated_bytes();

  std::int64_t capacity_bytes = config.memory_cap_bytes;
  if (capacity_bytes == 0 && config.memory_cap_factor > 0) {
    capacity_bytes = static_cast<std::int64_t>(config.memory_cap_factor * static_bytes);
  }
  const bool capped = capacity_bytes > 0;
  if (!capped) capacity_bytes = physical_memory_bytes();
  meter.set_capacity_bytes(capped ? capacity_bytes : 0);
  log("xpm-train: static memory " + std::to_string(static_bytes) + " bytes, capacity " +
      std::to_string(capacity_bytes) + " bytes" + (capped ? " (CPU cap)" : " (physical memory)") +
      (dist.distributed() ? " per rank; world size " + std::to_string(dist.world_size()) + ", backend " +
                                dist.backend() + ", " + std::to_string(threads) + " threads per rank"
                          : ""));

  // Probe and fit (rank 0, before any wrapping), unless the cache has this setup's model.
  PredictiveBatcherOptions batcher_options;
  batcher_options.formula = config.formula;
  batcher_options.coefficient_names = config.coefficients;
  batcher_options.variable_names = config.variables;
  batcher_options.batch_size_variable = "bs";
  batcher_options.aggregation = {{"l", DimAggregation::kMax}};
  batcher_options.probe_points = config.probe_points;
  batcher_options.variable_max = {{"bs", static_cast<double>(config.outer_batch_size)},
                                  {"l", static_cast<double>(data.max_length)}};
  batcher_options.budget = {capacity_bytes, config.memory_fraction, config.extra_overhead_bytes};
  std::shared_ptr<const MicrobatchPacker> packer;
  if (config.packer == "uniform") {
    packer = std::make_shared<UniformPacker>();
  } else {
    packer = std::make_shared<AdaptivePacker>(AdaptivePackerOptions{config.sort_by});
  }
  PredictiveBatcher batcher(batcher_options, packer);
  const std::size_t l_index = 1;

  // Predictive batcher: rank 0 alone looks the model up or probes and fits it, before any
  // gradient synchronization; it then publishes the model, or its error, to every rank through
  // the store. The fixed and power batchers (single process) have no memory model.
  std::optional<MemoryModel> cached;
  double probe_s = 0;
  std::int64_t infeasible_probes = 0, probes_run = 0;
  if (predictive) {
    const nlohmann::json identity = memory_model_identity(config, batcher_options, setup.signature(),
                                                         capacity_bytes, dist.world_size());
    nlohmann::json shared_model;
    if (main_rank) {
      try {
        std::optional<MemoryModelCache> cache;
        if (!config.memory_model_cache.empty()) cache.emplace(config.memory_model_cache);
        std::string cache_warning;
        cached = cache ? cache->lookup(identity, &cache_warning) : std::nullopt;
        if (!cache_warning.empty()) log("xpm-train: warning: " + cache_warning);
        if (cached) {
          batcher.set_model(*cached);
          log("xpm-train: memory model from the cache (" + cache->path_for(identity) + "), no probing");
        } else {
          TorchProbeExecutor executor(setup.probe_steps(), meter);
          const auto probe_start = Clock::now();
          batcher.probe_and_fit(executor);
          probe_s = seconds_since(probe_start);
          setup.reset_optimizer_state();    // probes fed synthetic gradients into the AdamW moments
          probes_run = static_cast<std::int64_t>(batcher.probes().size());
          for (const ProbeResult& probe : batcher.probes()) infeasible_probes += probe.feasible ? 0 : 1;
          log("xpm-train: " + std::to_string(probes_run) + " probes (" +
              std::to_string(infeasible_probes) + " out of memory) in " + std::to_string(probe_s) +
              " s; " + batcher.fit_summary().brief_report());
          MemoryModel fitted = batcher.model();
          fitted.metadata()["device"] = "cpu";
          fitted.metadata()["capacity_bytes"] = capacity_bytes;
          fitted.metadata()["precision"] = "32-true";
          fitted.metadata()["optimizer"] = "adamw";
          fitted.metadata()["torch_version"] = TORCH_VERSION;
          fitted.metadata()["model_signature"] = setup.signature();
          batcher.set_model(fitted);
          if (cache) cache->store(identity, fitted);
        }
        shared_model = {{"model", batcher.model().to_json()}, {"from_cache", cached.has_value()}};
      } catch (const std::invalid_argument& error) {
        shared_model = {{"error", error.what()}, {"kind", "invalid_argument"}};
      } catch (const std::exception& error) {
        shared_model = {{"error", error.what()}, {"kind", "runtime_error"}};
      }
    }
    shared_model =
        nlohmann::json::parse(dist.share_from(0, shared_model.dump(), config.rendezvous_timeout()));
    if (shared_model.contains("error")) {
      const std::string message = shared_model.at("error").get<std::string>();
      if (shared_model.at("kind") == "invalid_argument") throw std::invalid_argument(message);
      throw std::runtime_error(message);
    }
    // Every rank, rank 0 included, takes the model from the same JSON, so all start identical.
    batcher.set_model(MemoryModel::from_json(shared_model.at("model")));
    if (shared_model.at("from_cache").get<bool>()) cached = batcher.model();
  } else {
    log("xpm-train: batcher " + config.batcher + ", microbatch size " +
        std::to_string(config.microbatch_size > 0 ? config.microbatch_size : config.outer_batch_size) +
        (config.batcher == "power" ? " at first, shrunk on out-of-memory errors" : "") +
        "; no probing, no memory model");
  }
  // Same parameters everywhere (rank 0's), gradients in all-reduce buckets, then per-rank
  // dropout streams; world size 1 keeps the single-process seed.
  std::vector<torch::Tensor> parameters = setup.module().parameters();
  {
    torch::NoGradGuard no_grad;
    dist.broadcast_(parameters, 0);
  }
  std::optional<GradientBuckets> buckets;
  if (dist.distributed()) buckets.emplace(parameters, config.bucket_cap_bytes);
  torch::manual_seed(config.seed + static_cast<std::uint64_t>(dist.rank()));  // same whether probed or cached
  const double initial_fit_max_rel_error =
      predictive
          ? batcher.model().metadata().value("fit", nlohmann::json::object()).value("max_rel_error", 0.0)
          : 0.0;
  if (predictive) {
    log("xpm-train: memory model " + batcher.model().formula().canonical() + ", floor " +
        std::to_string(static_cast<std::int64_t>(batcher.model().floor_bytes())) + " bytes");
  }
  if (main_rank) {
    if (predictive) batcher.model().save(config.run_dir + "/memory_model.json");
    write_file_atomically(config.run_dir + "/config.json", config.to_json().dump(2) + "\n");
  }

  // Train.
  const auto steps_per_epoch = static_cast<std::int64_t>(
      (train.size() + static_cast<std::size_t>(config.outer_batch_size) - 1) /
      static_cast<std::size_t>(config.outer_batch_size));
  std::int64_t total_steps = steps_per_epoch * config.epochs;
  if (config.max_steps > 0) total_steps = std::min(total_steps, config.max_steps);
  set_learning_rate(optimizer, 0.0);
  DataParallelTrainer trainer(optimizer, batcher, &meter, dist, buckets ? &*buckets : nullptr);
  // Or a batcher without a memory model (world size 1, checked above).
  std::unique_ptr<FixedBatcher> fixed_batcher;
  const PowerAdaptativeBatcher* power_batcher = nullptr;
  if (config.batcher == "fixed") {
    fixed_batcher = std::make_unique<FixedBatcher>(
        optimizer, &meter, config.microbatch_size > 0 ? config.microbatch_size : config.outer_batch_size);
  } else if (config.batcher == "power") {
    auto power = std::make_unique<PowerAdaptativeBatcher>(
        optimizer, &meter, PowerAdaptativeBatcherOptions{config.outer_batch_size, config.microbatch_size},
        dist.world_size());
    power_batcher = power.get();
    fixed_batcher = std::move(power);
  }
  const PlanFn plan_validation = [&](const std::vector<std::vector<double>>& dims) {
    return fixed_batcher ? fixed_size_plan(dims.size(), fixed_batcher->microbatch_size())
                         : batcher.plan(dims);
  };
  std::ofstream metrics;
  if (main_rank) {
    metrics.open(config.run_dir + "/metrics.jsonl", std::ios::trunc);
    if (!metrics) throw std::runtime_error("cannot write '" + config.run_dir + "/metrics.jsonl'");
  }
  std::vector<std::int64_t> rank_microbatches(static_cast<std::size_t>(dist.world_size()), 0);
  double max_rank_imbalance = 1, sum_rank_imbalance = 0;

  std::mt19937_64 sampler(config.seed);
  std::vector<std::size_t> order(train.size());
  std::int64_t step = 0, ooms = 0, oom_skipped_steps = 0, total_microbatches = 0, skipped_records = 0;
  std::int64_t underpredictions = 0;
  std::int64_t peak_allocated_bytes = 0;
  double train_time_s = 0, real_tokens = 0, max_prediction_error = 0, last_loss = 0;
  nlohmann::json validations = nlohmann::json::array();
  for (std::int64_t epoch = 0; epoch < config.epochs && step < total_steps; ++epoch) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), sampler);
    for (std::size_t begin = 0; begin < order.size() && step < total_steps;
         begin += static_cast<std::size_t>(config.outer_batch_size)) {
      const std::size_t end =
          std::min(order.size(), begin + static_cast<std::size_t>(config.outer_batch_size));
      std::vector<std::size_t> records(order.begin() + static_cast<std::ptrdiff_t>(begin),
                                       order.begin() + static_cast<std::ptrdiff_t>(end));
      std::vector<std::vector<double>> record_dims;
      std::vector<double> record_units;
      double step_tokens = 0;
      for (std::size_t record : records) {
        const auto& sentence = train[record];
        record_dims.push_back({1.0, static_cast<double>(sentence.token_ids.size())});
        record_units.push_back(static_cast<double>(std::count_if(
            sentence.tag_ids.begin(), sentence.tag_ids.end(), [](std::int64_t t) { return t >= 0; })));
        step_tokens += static_cast<double>(sentence.token_ids.size());
      }
      if (fault.rank == dist.rank() && fault.step == step + 1) {
        std::cerr << "xpm-train: rank " << dist.rank() << ": XPM_FAULT_EXIT_AT: "
                  << (fault.kill ? "killing myself" : "exiting") << " at step " << step + 1
                  << " (test hook)" << std::endl;
        if (fault.kill) ::kill(::getpid(), SIGKILL);
        std::_Exit(17);
      }
      const double lr = scheduled_learning_rate(config, step, total_steps);
      set_learning_rate(optimizer, lr);
      const MicrobatchLossFn loss_sum_fn = [&](const std::vector<std::size_t>& microbatch) {
        std::vector<std::size_t> ids;
        ids.reserve(microbatch.size());
        for (std::size_t i : microbatch) ids.push_back(records[i]);  // global batch -> corpus
        const TaggingBatch batch = collate(train, ids);
        return token_cross_entropy_sum(setup.forward(batch.token_ids, batch.padding_mask),
                                       batch.tag_ids);
      };
      BatcherStepResult fixed_step;
      if (fixed_batcher) fixed_step = fixed_batcher->train_step(record_units, loss_sum_fn);
      const GlobalStepResult result =
          fixed_batcher ? fixed_step.step : trainer.train_step(record_dims, record_units, loss_sum_fn);
      ++step;
      ooms += fixed_batcher ? fixed_step.ooms : (result.oom ? 1 : 0);
      oom_skipped_steps += result.oom ? 1 : 0;
      if (fixed_batcher && fixed_step.ooms > 0 && !result.oom) {
        log("xpm-train: step " + std::to_string(step) + ": " + std::to_string(fixed_step.ooms) +
            " out-of-memory error(s), redone with microbatch size " +
            std::to_string(fixed_step.microbatch_size));
      }
      // Online correction: a microbatch (or the optimizer step) that needed more than predicted
      // joins the fit data (or raises the floor), so later plans take it into account.
      std::int64_t step_underpredictions = 0;
      for (const MicrobatchPeak& peak : result.microbatch_peaks) {
        if (predictive && peak.forward_backward_peak_bytes >
                              (1 + config.underprediction_tolerance) * peak.predicted_bytes) {
          ++step_underpredictions;
          batcher.add_measurement({peak.dims, peak.forward_backward_peak_bytes});
          log("xpm-train: underprediction at step " + std::to_string(step) + ": measured " +
              std::to_string(static_cast<std::int64_t>(peak.forward_backward_peak_bytes)) +
              " bytes, predicted " + std::to_string(static_cast<std::int64_t>(peak.predicted_bytes)) +
              " at bs=" + std::to_string(peak.dims[0]) + " l=" + std::to_string(peak.dims[1]) +
              "; refitted");
        }
      }
      if (predictive && result.optimizer_step_peak_bytes >
                            (1 + config.underprediction_tolerance) * batcher.model().floor_bytes()) {
        ++step_underpredictions;
        batcher.raise_floor_bytes(result.optimizer_step_peak_bytes);
        log("xpm-train: optimizer step at step " + std::to_string(step) + " peaked above the floor; "
            "floor raised to " + std::to_string(static_cast<std::int64_t>(result.optimizer_step_peak_bytes)));
      }
      underpredictions += step_underpredictions;
      total_microbatches += result.microbatches;
      for (std::size_t r = 0; r < rank_microbatches.size(); ++r) {
        rank_microbatches[r] += result.microbatches_per_rank[r];
      }
      max_rank_imbalance = std::max(max_rank_imbalance, result.imbalance);
      sum_rank_imbalance += result.imbalance;
      skipped_records += result.skipped_records;
      peak_allocated_bytes = std::max(peak_allocated_bytes, result.peak_allocated_bytes);
      train_time_s += result.duration_s;
      if (!result.oom) real_tokens += step_tokens;
      last_loss = result.oom ? last_loss : result.loss;
      const double prediction_error =
          result.oom || !predictive ? 0.0
                     : (static_cast<double>(result.peak_allocated_bytes) - result.max_predicted_bytes) /
                           static_cast<double>(result.peak_allocated_bytes);
      max_prediction_error = std::max(max_prediction_error, std::abs(prediction_error));
      nlohmann::json line = {{"step", step},
                             {"epoch", epoch},
                             {"loss", result.loss},
                             {"lr", lr},
                             {"records", records.size()},
                             {"real_tokens", step_tokens},
                             {"microbatches", result.microbatches},
                             {"skipped_records", result.skipped_records},
                             {"oom", result.oom},
                             {"peak_allocated_bytes", result.peak_allocated_bytes},
                             {"predicted_peak_bytes", result.max_predicted_bytes},
                             {"prediction_rel_error", prediction_error},
                             {"underpredictions", step_underpredictions},
                             {"capacity_bytes", capacity_bytes},
                             {"duration_s", result.duration_s},
                             {"tokens_per_s", step_tokens / std::max(1e-9, result.duration_s)},
                             {"records_per_rank", result.records_per_rank},
                             {"microbatches_per_rank", result.microbatches_per_rank},
                             {"rank_imbalance", result.imbalance},
                             {"oom_ranks", result.oom_ranks}};
      if (fixed_batcher) {
        line["microbatch_size"] = fixed_step.microbatch_size;
        line["ooms"] = fixed_step.ooms;
        line["attempts"] = fixed_step.attempts;
      }
      if (main_rank) metrics << line.dump() << '\n' << std::flush;
      if (step % config.log_every == 0 || step == total_steps || result.oom) {
        char text[256];
        std::snprintf(text, sizeof text,
                      "step %5lld/%lld  loss %.4f  %7.0f tokens/s  %2lld microbatches  "
                      "peak %.1f/%.1f MiB%s",
                      static_cast<long long>(step), static_cast<long long>(total_steps),
                      result.loss, real_tokens / std::max(1e-9, train_time_s),
                      static_cast<long long>(result.microbatches),
                      static_cast<double>(result.peak_allocated_bytes) / (1 << 20),
                      static_cast<double>(capacity_bytes) / (1 << 20), result.oom ? "  OOM" : "");
        log(text);
      }
      if (config.validate_every > 0 && step % config.validate_every == 0 && step < total_steps) {
        const Accuracy accuracy = evaluate(setup, validation, plan_validation, l_index, dist);
        validations.push_back({{"step", step}, {"val_token_accuracy", accuracy.value()}});
        log("validation at step " + std::to_string(step) + ": token accuracy " +
            std::to_string(accuracy.value()));
      }
    }
  }

  const auto validation_start = Clock::now();
  const Accuracy accuracy = evaluate(setup, validation, plan_validation, l_index, dist);
  const double validation_s = seconds_since(validation_start);
  validations.push_back({{"step", step}, {"val_token_accuracy", accuracy.value()}});
  char text[256];
  std::snprintf(text, sizeof text,
                "validation: token accuracy %.4f (most-frequent-tag baseline %.4f) on %lld tokens",
                accuracy.value(), baseline_accuracy, static_cast<long long>(accuracy.total));
  log(text);

  nlohmann::json summary = {
      {"val_token_accuracy", accuracy.value()},
      {"baseline_token_accuracy", baseline_accuracy},
      {"validation_tokens", accuracy.total},
      {"ooms", ooms},
      {"validation_ooms", accuracy.ooms},
      {"peak_allocated_bytes", peak_allocated_bytes},
      {"capacity_bytes", capacity_bytes},
      {"capacity_is_cap", capped},
      {"usable_bytes", predictive ? batcher_options.budget.usable_bytes() : 0},
      {"static_bytes", static_bytes},
      {"tokens_per_s", real_tokens / std::max(1e-9, train_time_s)},
      {"real_tokens", real_tokens},
      {"train_steps", step},
      {"microbatches", total_microbatches},
      {"skipped_records", skipped_records},
      {"final_loss", last_loss},
      {"probes", probes_run},
      {"memory_model_from_cache", cached.has_value()},
      {"underpredictions", underpredictions},
      {"online_corrections", batcher.corrections()},
      {"infeasible_probes", infeasible_probes},
      {"probe_s", probe_s},
      {"fit_max_rel_error", initial_fit_max_rel_error},
      {"max_step_prediction_rel_error", max_prediction_error},
      {"train_s", train_time_s},
      {"validation_s", validation_s},
      {"total_s", seconds_since(job_start)},
      {"validations", validations},
      {"canonical_formula", predictive ? batcher.model().formula().canonical() : std::string()},
      {"batcher", config.batcher},
      {"microbatch_size", fixed_batcher ? fixed_batcher->microbatch_size() : 0},
      {"retried_steps", power_batcher != nullptr ? power_batcher->retried_steps() : 0},
      {"oom_skipped_steps", oom_skipped_steps},
      {"world_size", dist.world_size()},
      {"backend", dist.backend()},
      {"threads_per_rank", threads},
      {"microbatches_per_rank", rank_microbatches},
      {"max_rank_imbalance", max_rank_imbalance},
      {"mean_rank_imbalance", step > 0 ? sum_rank_imbalance / static_cast<double>(step) : 1.0}};
  if (main_rank) {
    save_parameters_atomically(setup.module(), config.run_dir + "/final_parameters.pt");
    write_file_atomically(config.run_dir + "/summary.json", summary.dump(2) + "\n");
  }
  dist.barrier();  // rank 0's store outlives every rank's last use of it
  return summary;
}

}  // namespace xpm
