// The tagging job's Learner loop: steps, hooks, validation, votes, checkpoints.
#include "xpm/trainer/tagging_learner.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include <unistd.h>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner/dims_text.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/error_context.hpp"
#include "xpm/trainer/lr_schedule.hpp"
#include "xpm/trainer/tagging_batch.hpp"
#include "xpm/trainer/tagging_memory_plan.hpp"

namespace xpm {
namespace {

// Steps in a row skipped by out-of-memory errors after which the job stops: it trains nothing.
constexpr std::int64_t kMaxConsecutiveOomSteps = 10;

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

// Linear warmup to the peak, then config.lr_schedule (constant, or linear / cosine decay to 10 %
// of the peak at the last step); lr_schedule.hpp has the formulas.
double scheduled_learning_rate(const TaggingJobConfig& config, std::int64_t step,
                               std::int64_t total_steps) {
  LrScheduleOptions schedule;
  schedule.kind = parse_lr_schedule_kind(config.lr_schedule, "TaggingJobConfig.lr_schedule");
  schedule.peak_learning_rate = config.learning_rate;
  schedule.warmup_steps = config.warmup_steps;
  schedule.total_steps = std::max<std::int64_t>(1, total_steps);
  schedule.final_fraction = 0.1;
  return learning_rate_at(schedule, step);
}

// "1h02m", "12m34s", "45s": the ETA of the progress line.
std::string format_duration(double seconds) {
  const auto total = static_cast<long long>(std::llround(std::max(0.0, seconds)));
  char text[32];
  if (total >= 3600) {
    std::snprintf(text, sizeof text, "%lldh%02lldm", total / 3600, (total % 3600) / 60);
  } else if (total >= 60) {
    std::snprintf(text, sizeof text, "%lldm%02llds", total / 60, total % 60);
  } else {
    std::snprintf(text, sizeof text, "%llds", total);
  }
  return text;
}

// Test hook: XPM_FAULT_EXIT_AT=R:S makes rank R exit (code 17) at the start of step S;
// XPM_FAULT_EXIT_AT=R:S:kill makes it kill itself with SIGKILL there instead.
void read_fault_injection(int& rank, std::int64_t& step, bool& kill) {
  const char* text = std::getenv("XPM_FAULT_EXIT_AT");
  if (text == nullptr) return;
  long long r = -1, s = -1;
  char mode[8] = {0}, tail = 0;
  const int fields = std::sscanf(text, "%lld:%lld:%7[a-z]%c", &r, &s, mode, &tail);
  if (fields < 2 || fields > 3 || r < 0 || s < 1 || (fields == 3 && std::string(mode) != "kill")) {
    throw std::invalid_argument("environment variable XPM_FAULT_EXIT_AT='" + std::string(text) +
                                "' must be RANK:STEP or RANK:STEP:kill with RANK >= 0 and STEP >= 1");
  }
  rank = static_cast<int>(r);
  step = s;
  kill = fields == 3;
}

// Keeps the lines of metrics.jsonl up to `step` (a resumed run continues after them), written
// atomically. A line that does not parse (cut by a crash) ends the kept part.
void truncate_metrics_after(const std::string& path, std::int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    const nlohmann::json entry = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (entry.is_discarded() || !entry.contains("step")) break;
    if (entry.at("step").get<std::int64_t>() > step) break;
    kept += line + "\n";
  }
  in.close();
  write_file_atomically(path, kept);
}

}  // namespace

TaggingLearner::TaggingLearner(TaggingLearnerParts parts, TrainState& state, TrainerContext& context,
                               std::optional<TaggingCheckpoint> resume_from)
    : parts_(std::move(parts)),
      config_(*parts_.config),
      dist_(*parts_.dist),
      state_(state),
      context_(context),
      resume_from_(std::move(resume_from)),
      validation_settings_(config_.validation_settings()),
      early_stopping_(validation_settings_),
      validation_(*parts_.validation, *parts_.dist),
      sampler_(config_.seed),
      order_(parts_.train->size()) {
  read_fault_injection(fault_.rank, fault_.step, fault_.kill);
  if (config_.checkpointing() || config_.stop_after_steps > 0) {
    store_.emplace(config_.run_dir + "/checkpoints", config_.checkpoint_settings());
  }
  if (parts_.fixed_batcher == nullptr) {
    trainer_.emplace(*state_.optimizer, *parts_.batcher, parts_.meter, dist_, parts_.buckets,
                     parts_.setup->sharded_optimizer());
    if (config_.precision == "16-mixed") {  // float16 gradients underflow without it (precision.hpp)
      loss_scaler_.emplace();
      trainer_->set_loss_scaler(&*loss_scaler_);
    }
  }
  outcome_.counters = TaggingRunCounters(dist_.world_size());
  const auto outer = static_cast<std::size_t>(config_.outer_batch_size);
  steps_per_epoch_ = static_cast<std::int64_t>((order_.size() + outer - 1) / outer);
}

std::vector<torch::Tensor> TaggingLearner::gather_generator_states() {
  torch::Tensor mine;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    mine = generator.get_state();
  }
  if (!dist_.distributed()) return {mine};
  // Every rank's bytes in its slot, summed: rank 0 gets all (one all-reduce, same on every rank).
  const auto size = static_cast<std::size_t>(mine.numel());
  std::vector<double> slots(size * static_cast<std::size_t>(dist_.world_size()), 0.0);
  const std::uint8_t* bytes = mine.data_ptr<std::uint8_t>();
  for (std::size_t i = 0; i < size; ++i) slots[static_cast<std::size_t>(dist_.rank()) * size + i] = bytes[i];
  slots = dist_.all_reduce(slots, ReduceOp::kSum);
  std::vector<torch::Tensor> states;
  for (int r = 0; r < dist_.world_size(); ++r) {
    torch::Tensor state = torch::empty_like(mine);
    std::uint8_t* out = state.data_ptr<std::uint8_t>();
    for (std::size_t i = 0; i < size; ++i) {
      out[i] = static_cast<std::uint8_t>(slots[static_cast<std::size_t>(r) * size + i]);
    }
    states.push_back(state);
  }
  return states;
}

TaggingResumeState TaggingLearner::resume_state() const {
  TaggingResumeState saved;
  saved.epoch = state_.epoch;
  saved.step = state_.step;
  saved.epoch_position = state_.epoch_position;
  saved.total_steps = state_.total_steps;
  saved.world_size = dist_.world_size();
  saved.capacity_bytes = parts_.capacity_bytes;
  std::ostringstream sampler;
  sampler << sampler_;
  saved.sampler_state = sampler.str();
  saved.epoch_order.assign(order_.begin(), order_.end());
  saved.memory_model = parts_.fixed_batcher == nullptr ? parts_.batcher->model().to_json() : nlohmann::json();
  if (parts_.fixed_batcher != nullptr) saved.microbatch_size = parts_.fixed_batcher->microbatch_size();
  if (parts_.power_batcher != nullptr) saved.power_divisor = parts_.power_batcher->divisor();
  if (loss_scaler_) saved.loss_scaler = loss_scaler_->state();
  TaggingRunCounters counters = outcome_.counters;
  counters.earlier_online_corrections += parts_.batcher->has_model() ? parts_.batcher->corrections() : 0;
  saved.counters = counters.to_json();
  saved.early_stopping = early_stopping_.to_json();
  saved.early_stopped = outcome_.early_stopped;
  return saved;
}

void TaggingLearner::checkpoint(bool is_best) {
  with_error_context("checkpoint write of step " + std::to_string(state_.step),
                     [&] { write_checkpoint(is_best); });
}

void TaggingLearner::write_checkpoint(bool is_best) {
  const std::vector<torch::Tensor> generators = gather_generator_states();  // collective
  // The optimizer's files. Under shard_grad_op every rank first writes its part into a staging
  // folder next to the checkpoints (its own shard, or its share of the consolidated state); once
  // all are there (barrier), rank 0's store moves them into the checkpoint it writes, so the
  // manifest checksums every rank's file and a checkpoint is complete or absent.
  std::map<std::string, CheckpointFileWriter> optimizer_files;
  ShardedAdamW* sharded = parts_.setup->sharded_optimizer();
  std::string staging;
  if (sharded == nullptr) {
    optimizer_files["optimizer.pt"] = [this](const std::string& path) { torch::save(*state_.optimizer, path); };
  } else {
    char name[48];
    std::snprintf(name, sizeof name, ".staging-step-%08lld", static_cast<long long>(state_.step));
    staging = config_.run_dir + "/checkpoints/" + name;
    std::filesystem::create_directories(staging);
    std::vector<std::string> names;
    if (config_.optimizer_checkpoint == "full") {
      // The gather holds the whole state for a moment (2-3 x the parameters' bytes), between
      // steps: outside the plan's budget, so outside the CPU cap too.
      ScopedMemoryCap uncapped(0);
      sharded->save_full_state(staging + "/optimizer.pt");  // collective; rank 0 writes
      names.push_back("optimizer.pt");
    } else {
      const std::string name = "optimizer-rank" + std::to_string(dist_.rank()) + ".pt";
      sharded->save_shard(staging + "/" + name);
      for (int r = 0; r < dist_.world_size(); ++r) names.push_back("optimizer-rank" + std::to_string(r) + ".pt");
    }
    dist_.barrier();
    for (const std::string& name : names) {
      optimizer_files[name] = [source = staging + "/" + name](const std::string& path) {
        std::filesystem::rename(source, path);
      };
    }
  }
  if (dist_.is_main()) {
    const std::string folder = save_tagging_checkpoint(*store_, parts_.setup->module(), optimizer_files,
                                                       generators, resume_state(), config_.to_json(), is_best);
    if (!staging.empty()) std::filesystem::remove_all(staging);
    parts_.log("xpm-train: checkpoint " + folder + (is_best ? " (best)" : ""));
  }
  ++outcome_.checkpoints_written;
  last_checkpoint_step_ = state_.step;
}

void TaggingLearner::restore_optimizer_and_generator(const TaggingCheckpoint& checkpoint) {
  const std::string full_optimizer = checkpoint.info.path + "/optimizer.pt";
  ShardedAdamW* sharded = parts_.setup->sharded_optimizer();
  if (!std::filesystem::exists(full_optimizer)) {
    sharded->load_shard(checkpoint.info.path + "/optimizer-rank" + std::to_string(dist_.rank()) + ".pt");
  } else if (sharded != nullptr) {
    sharded->load_full_state(full_optimizer);
  } else {
    load_optimizer_state(full_optimizer, *state_.optimizer);
  }
  // A rank the checkpoint did not have (a larger world) keeps its fresh seed (seed + rank).
  if (dist_.rank() < checkpoint.state.world_size) {
    const torch::Tensor generator_state = load_generator_state(checkpoint.info.path + "/rng.pt", dist_.rank());
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(generator_state);
  }
}

void TaggingLearner::restore(const TaggingCheckpoint& checkpoint) {
  const TaggingResumeState& saved = checkpoint.state;
  // A consolidated optimizer.pt loads at any world size and sharding; per-rank shards only where
  // they were written.
  check_optimizer_loadable(checkpoint, dist_.world_size(), config_.sharding);
  if (saved.total_steps != state_.total_steps ||
      saved.epoch_order.size() != order_.size()) {
    throw std::invalid_argument("--resume: checkpoint '" + checkpoint.info.path + "' belongs to a run of " +
                                std::to_string(saved.total_steps) + " steps over " +
                                std::to_string(saved.epoch_order.size()) + " train sentences; this run has " +
                                std::to_string(state_.total_steps) + " steps over " +
                                std::to_string(order_.size()));
  }
  state_.epoch = saved.epoch;
  state_.step = saved.step;
  state_.epoch_position = saved.epoch_position;
  std::istringstream sampler(saved.sampler_state);
  sampler >> sampler_;
  if (!sampler) {
    throw std::runtime_error("checkpoint '" + checkpoint.info.path + "': unreadable sampler state");
  }
  std::copy(saved.epoch_order.begin(), saved.epoch_order.end(), order_.begin());
  with_error_context("resume", [&] { restore_optimizer_and_generator(checkpoint); });
  if (parts_.power_batcher != nullptr) {
    parts_.power_batcher->restore_size(saved.microbatch_size, saved.power_divisor);
  }
  if (loss_scaler_ && !saved.loss_scaler.empty()) loss_scaler_->load_state(saved.loss_scaler);
  outcome_.counters = TaggingRunCounters::from_json(saved.counters);
  outcome_.counters.microbatches_per_rank.resize(static_cast<std::size_t>(dist_.world_size()), 0);
  early_stopping_.restore(saved.early_stopping);
  outcome_.early_stopped = saved.early_stopped;
  outcome_.resumed_from_step = saved.step;
  last_checkpoint_step_ = saved.step;
  if (!outcome_.counters.validations.empty()) {
    last_validation_step_ = outcome_.counters.validations.back().at("step").get<std::int64_t>();
    const nlohmann::json& last = outcome_.counters.validations.back();
    outcome_.last_validation.token_accuracy = last.at("val_token_accuracy").get<double>();
    outcome_.last_validation.loss = last.at("val_loss").get<double>();
    outcome_.last_validation.tokens = last.at("tokens").get<std::int64_t>();
    outcome_.last_validation.ooms = last.at("ooms").get<std::int64_t>();
  }
}

void TaggingLearner::write_metrics_line(const nlohmann::json& line) {
  if (!dist_.is_main()) return;
  std::ofstream metrics(config_.run_dir + "/metrics.jsonl", std::ios::app);
  metrics << line.dump() << '\n';
  if (!metrics.flush()) throw std::runtime_error("cannot write '" + config_.run_dir + "/metrics.jsonl'");
}

double TaggingLearner::planned_floor_bytes(const GlobalStepResult& result) const {
  // Constant, or a formula of the microbatches' dims (a moving floor).
  const MemoryModel& model = parts_.batcher->model();
  double floor_bytes = model.floor_bytes();
  for (const MicrobatchPeak& peak : result.microbatch_peaks) {
    floor_bytes = std::max(floor_bytes, model.floor_bytes_at(peak.dims));
  }
  return floor_bytes;
}

std::int64_t TaggingLearner::bound_out_of_memory_microbatches(const GlobalStepResult& result,
                                                             std::int64_t step) {
  std::int64_t bounded = 0;
  PredictiveBatcher& batcher = *parts_.batcher;
  for (const std::vector<double>& dims : result.oom_microbatch_dims) {
    if (dims.empty()) continue;
    const double predicted = batcher.model().predict_bytes(dims);
    batcher.add_infeasible_bound({dims, static_cast<double>(parts_.capacity_bytes)});
    ++bounded;
    parts_.log("xpm-train: step " + std::to_string(step) + " ran out of memory in a microbatch at " +
               dims_text(batcher.model().formula().variable_names(), dims) + " predicted at " +
               std::to_string(static_cast<std::int64_t>(predicted)) + " bytes (capacity " +
               std::to_string(parts_.capacity_bytes) + "): it bounds the memory model from now on; refitted");
  }
  return bounded;
}

void TaggingLearner::note_extrapolation(const GlobalStepResult& result) {
  if (extrapolation_noted_) return;
  std::vector<std::vector<double>> planned = result.oom_microbatch_dims;
  for (const MicrobatchPeak& peak : result.microbatch_peaks) planned.push_back(peak.dims);
  for (const std::vector<double>& dims : planned) {
    if (dims.empty()) continue;
    const std::vector<Extrapolation> beyond = parts_.batcher->model().extrapolation(dims);
    if (beyond.empty()) continue;
    std::string what;
    for (const Extrapolation& e : beyond) what += (what.empty() ? "" : ", ") + e.describe();
    parts_.log("xpm-train: note: step " + std::to_string(state_.step) + " planned a microbatch " +
               "beyond the probed range (" + what + "); its prediction is an extrapolation of the " +
               "fit (noted once per run)");
    extrapolation_noted_ = true;
    return;
  }
}

void TaggingLearner::train_one_step(const std::vector<std::size_t>& records) {
  const std::vector<EncodedSentence>& train = *parts_.train;
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
  if (fault_.rank == dist_.rank() && fault_.step == state_.step + 1) {
    std::cerr << "xpm-train: rank " << dist_.rank() << ": XPM_FAULT_EXIT_AT: "
              << (fault_.kill ? "killing myself" : "exiting") << " at step " << state_.step + 1
              << " (test hook)" << std::endl;
    if (fault_.kill) ::kill(::getpid(), SIGKILL);
    std::_Exit(17);
  }
  HookList& hooks = parts_.extensions->hooks;
  const double lr = scheduled_learning_rate(config_, state_.step, state_.total_steps);
  set_learning_rate(*state_.optimizer, lr);
  context_.clear_metrics();
  hooks.before_step(context_);
  TaggingModelSetup& setup = *parts_.setup;
  const MicrobatchLossFn loss_sum_fn = [&](const std::vector<std::size_t>& microbatch) {
    std::vector<std::size_t> ids;
    ids.reserve(microbatch.size());
    for (std::size_t i : microbatch) ids.push_back(records[i]);  // global batch -> corpus
    const TaggingBatch batch = collate(train, ids);
    return token_cross_entropy_sum(setup.forward(batch.token_ids, batch.padding_mask), batch.tag_ids);
  };
  const BeforeOptimizerStepFn before_optimizer_step = [&] { hooks.before_optimizer_step(context_); };
  BatcherStepResult fixed_step;
  GlobalStepResult result;
  if (parts_.fixed_batcher != nullptr) {
    fixed_step = parts_.fixed_batcher->train_step(record_units, loss_sum_fn, before_optimizer_step);
    result = fixed_step.step;
  } else {
    result = trainer_->train_step(record_dims, record_units, loss_sum_fn, before_optimizer_step);
  }
  ++state_.step;
  ++state_.epoch_position;
  const std::int64_t step = state_.step;
  if (parts_.fixed_batcher != nullptr && fixed_step.ooms > 0 && !result.oom) {
    parts_.log("xpm-train: step " + std::to_string(step) + ": " + std::to_string(fixed_step.ooms) +
               " out-of-memory error(s), redone with microbatch size " +
               std::to_string(fixed_step.microbatch_size));
  }
  // Online correction: a microbatch (or the optimizer step) that needed more than predicted
  // joins the fit data (or raises the floor), so later plans take it into account. Every rank
  // sees the same peaks (all-reduced), so plans stay identical.
  const bool predictive = parts_.fixed_batcher == nullptr;
  PredictiveBatcher& batcher = *parts_.batcher;
  std::int64_t step_underpredictions = 0;
  if (predictive) {
    note_extrapolation(result);
    step_underpredictions += bound_out_of_memory_microbatches(result, step);
  }
  consecutive_oom_steps_ = result.oom ? consecutive_oom_steps_ + 1 : 0;
  for (const MicrobatchPeak& peak : result.microbatch_peaks) {
    if (predictive &&
        peak.forward_backward_peak_bytes > (1 + config_.underprediction_tolerance) * peak.predicted_bytes) {
      ++step_underpredictions;
      batcher.add_measurement({peak.dims, peak.forward_backward_peak_bytes});
      parts_.log("xpm-train: underprediction at step " + std::to_string(step) + ": measured " +
                 std::to_string(static_cast<std::int64_t>(peak.forward_backward_peak_bytes)) +
                 " bytes, predicted " + std::to_string(static_cast<std::int64_t>(peak.predicted_bytes)) +
                 " at " + dims_text(batcher.model().formula().variable_names(), peak.dims) + "; refitted");
    }
  }
  if (predictive && result.optimizer_step_peak_bytes >
                        (1 + config_.underprediction_tolerance) * planned_floor_bytes(result)) {
    ++step_underpredictions;
    batcher.raise_floor_bytes(result.optimizer_step_peak_bytes);
    parts_.log("xpm-train: optimizer step at step " + std::to_string(step) +
               " peaked above the floor; floor raised to " +
               std::to_string(static_cast<std::int64_t>(result.optimizer_step_peak_bytes)));
  }
  const double prediction_error =
      result.oom || !predictive
          ? 0.0
          : (static_cast<double>(result.peak_allocated_bytes) - result.max_predicted_bytes) /
                static_cast<double>(result.peak_allocated_bytes);
  TaggingRunCounters& counters = outcome_.counters;
  counters.add_step(result, step_tokens,
                    parts_.fixed_batcher != nullptr ? fixed_step.ooms : (result.oom ? 1 : 0),
                    parts_.fixed_batcher != nullptr ? fixed_step.attempts : 1, step_underpredictions,
                    prediction_error);
  // A step skipped by an out-of-memory error trained nothing: no loss, no tokens.
  nlohmann::json line = {{"step", step},
                         {"epoch", state_.epoch},
                         {"loss", result.oom ? nlohmann::json(nullptr) : nlohmann::json(result.loss)},
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
                         {"capacity_bytes", parts_.capacity_bytes},
                         {"duration_s", result.duration_s},
                         {"tokens_per_s", result.oom ? 0.0 : step_tokens / std::max(1e-9, result.duration_s)},
                         {"records_per_rank", result.records_per_rank},
                         {"microbatches_per_rank", result.microbatches_per_rank},
                         {"rank_imbalance", result.imbalance},
                         {"oom_ranks", result.oom_ranks}};
  if (result.gradient_norm >= 0) line["grad_norm"] = result.gradient_norm;  // ShardedAdamW's clipping
  if (loss_scaler_) {
    line["loss_scale"] = result.loss_scale;
    line["loss_scale_overflow"] = result.loss_scale_overflow;
  }
  for (const auto& [name, value] : context_.metrics()) line[name] = value;  // hooks' (grad_norm, ...)
  if (parts_.fixed_batcher != nullptr) {
    line["microbatch_size"] = fixed_step.microbatch_size;
    line["ooms"] = fixed_step.ooms;
    line["attempts"] = fixed_step.attempts;
  }
  write_metrics_line(line);
  if (consecutive_oom_steps_ >= kMaxConsecutiveOomSteps) {
    throw std::runtime_error(
        std::to_string(consecutive_oom_steps_) + " consecutive steps ran out of memory under the " +
        "capacity of " + std::to_string(parts_.capacity_bytes) + " bytes: " +
        (predictive ? "the memory model keeps under-predicting this job (probe larger shapes with "
                      "--probe-points, or lower --memory-fraction)"
                    : "the microbatch does not fit (a smaller --microbatch-size, or the predictive batcher)"));
  }
  if (step % config_.log_every == 0 || step == state_.total_steps || result.oom) {
    // ETA: steps left x mean step time so far (validation and checkpoints not included).
    const double eta_s = static_cast<double>(state_.total_steps - step) * counters.mean_step_s(step);
    char text[320];
    std::snprintf(text, sizeof text,
                  "step %5lld/%lld  epoch %lld  loss %.4f  %7.0f tokens/s  %2lld microbatches  "
                  "peak %.1f/%.1f MiB  ETA %s%s",
                  static_cast<long long>(step), static_cast<long long>(state_.total_steps),
                  static_cast<long long>(state_.epoch + 1), result.loss,
                  counters.real_tokens / std::max(1e-9, counters.train_s),
                  static_cast<long long>(result.microbatches),
                  static_cast<double>(result.peak_allocated_bytes) / (1 << 20),
                  static_cast<double>(parts_.capacity_bytes) / (1 << 20), format_duration(eta_s).c_str(),
                  result.oom ? "  OOM" : "");
    parts_.log(text);
  }
  if (!result.oom) {
    {
      auto scope = context_.scope("train");
      context_.add_metric("loss", result.loss);
      context_.add_metric("lr", lr);
      context_.add_metric("real_tokens", step_tokens);
      context_.add_metric("microbatches", static_cast<double>(result.microbatches));
    }
    hooks.after_step(context_);
  }
}

bool TaggingLearner::validate(std::int64_t epoch) {
  return with_error_context("validation after step " + std::to_string(state_.step),
                            [&] { return run_validation(epoch); });
}

bool TaggingLearner::run_validation(std::int64_t epoch) {
  HookList& hooks = parts_.extensions->hooks;
  context_.clear_metrics();
  hooks.before_validation(context_);
  // Its own plan: a snapshot of the training memory model (or the fixed/power size); nothing
  // measured here goes back into the training batcher (tagging_validation.hpp).
  std::optional<PredictiveBatcher> validation_planner;
  if (parts_.fixed_batcher == nullptr) {
    validation_planner.emplace(parts_.batcher->options(), tagging_packer(config_));
    validation_planner->set_model(parts_.batcher->model());
  }
  const std::int64_t microbatch_size =
      parts_.fixed_batcher != nullptr ? parts_.fixed_batcher->microbatch_size() : 0;
  const ValidationPlanFn plan_of = [&](const std::vector<std::vector<double>>& dims) {
    return validation_planner ? validation_planner->plan(dims) : fixed_size_plan(dims.size(), microbatch_size);
  };
  const auto start = std::chrono::steady_clock::now();
  const ValidationMetrics metrics = validation_.run(*parts_.setup, plan_of);
  outcome_.last_validation_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  outcome_.last_validation = metrics;
  last_validation_step_ = state_.step;
  {
    auto scope = context_.scope("validation");
    context_.add_metric("token_accuracy", metrics.token_accuracy);
    context_.add_metric("loss", metrics.loss);
  }
  hooks.after_validation(context_);
  std::vector<LearnerVote> votes = {early_stopping_.on_validation(context_)};
  for (const auto& listener : parts_.extensions->listeners) votes.push_back(listener->on_validation(context_));
  const LearnerVote vote = combine_votes(votes);
  const bool is_best = early_stopping_.last_was_best();
  const char* vote_name = vote == LearnerVote::kStop ? "stop"
                          : vote == LearnerVote::kContinue ? "continue" : "no_decision";
  outcome_.counters.validations.push_back({{"step", state_.step},
                                           {"val_token_accuracy", metrics.token_accuracy},
                                           {"val_loss", metrics.loss},
                                           {"tokens", metrics.tokens},
                                           {"ooms", metrics.ooms},
                                           {"best", is_best}});
  write_metrics_line({{"step", state_.step},
                      {"epoch", epoch},
                      {"validation",
                       {{"token_accuracy", metrics.token_accuracy},
                        {"loss", metrics.loss},
                        {"tokens", metrics.tokens},
                        {"scored_tokens", metrics.scored_tokens},
                        {"ooms", metrics.ooms},
                        {"duration_s", outcome_.last_validation_s}}},
                      {"metric", validation_settings_.metric},
                      {"best", is_best},
                      {"best_value", early_stopping_.state().best_value
                                         ? nlohmann::json(*early_stopping_.state().best_value)
                                         : nlohmann::json()},
                      {"vote", vote_name}});
  if (is_best && dist_.is_main()) {
    save_parameters_atomically(parts_.setup->module(), config_.run_dir + "/best_parameters.pt");
  }
  char text[256];
  std::snprintf(text, sizeof text, "validation at step %lld: token accuracy %.4f, loss %.4f%s%s",
                static_cast<long long>(state_.step), metrics.token_accuracy, metrics.loss,
                is_best ? "  (best)" : "",
                vote == LearnerVote::kStop ? "  -> early stopping" : "");
  parts_.log(text);
  return vote == LearnerVote::kStop;
}

TaggingLearnerOutcome TaggingLearner::run() {
  if (resume_from_) restore(*resume_from_);
  if (dist_.is_main()) {
    const std::string metrics_path = config_.run_dir + "/metrics.jsonl";
    if (resume_from_) {
      truncate_metrics_after(metrics_path, state_.step);
    } else {
      write_file_atomically(metrics_path, "");
    }
  }
  set_learning_rate(*state_.optimizer, 0.0);
  bool stop = outcome_.early_stopped;
  bool interrupted = false;
  bool resumed_mid_epoch = resume_from_.has_value();
  const auto outer = static_cast<std::size_t>(config_.outer_batch_size);
  for (; state_.epoch < config_.epochs && state_.step < state_.total_steps && !stop && !interrupted;) {
    if (!resumed_mid_epoch) {
      std::iota(order_.begin(), order_.end(), 0);
      std::shuffle(order_.begin(), order_.end(), sampler_);
    }
    resumed_mid_epoch = false;
    while (state_.epoch_position < steps_per_epoch_ && state_.step < state_.total_steps) {
      const std::size_t begin = static_cast<std::size_t>(state_.epoch_position) * outer;
      const std::size_t end = std::min(order_.size(), begin + outer);
      const std::vector<std::size_t> records(order_.begin() + static_cast<std::ptrdiff_t>(begin),
                                             order_.begin() + static_cast<std::ptrdiff_t>(end));
      with_error_context("step " + std::to_string(state_.step + 1), [&] { train_one_step(records); });
      const std::int64_t epoch_completed =
          state_.epoch_position == steps_per_epoch_ ? state_.epoch + 1 : 0;
      bool is_best = false;
      if (validation_settings_.due(state_.step, epoch_completed) && state_.step < state_.total_steps) {
        stop = validate(state_.epoch);
        is_best = early_stopping_.last_was_best();
        outcome_.early_stopped = stop;
      }
      // Exactly at stop_after_steps: a run resumed from that step's checkpoint goes on.
      interrupted = config_.stop_after_steps > 0 && state_.step == config_.stop_after_steps &&
                    state_.step < state_.total_steps;
      // The last step's checkpoint waits for the final validation (after the loop).
      const bool last_step = state_.step == state_.total_steps;
      if (store_ && !last_step &&
          (store_->due(state_.step, epoch_completed) || (is_best && config_.checkpointing()) || interrupted)) {
        checkpoint(is_best);
      }
      if (stop || interrupted) break;
    }
    if (stop || interrupted) break;
    ++state_.epoch;
    state_.epoch_position = 0;
  }
  outcome_.finished = !interrupted;
  if (interrupted) {
    parts_.log("xpm-train: stopped after step " + std::to_string(state_.step) +
               " (--stop-after-steps); --resume continues from the checkpoint");
  } else {
    bool final_best = false;
    if (last_validation_step_ != state_.step || outcome_.counters.validations.empty()) {
      outcome_.early_stopped = validate(state_.epoch) || outcome_.early_stopped;
      final_best = early_stopping_.last_was_best();
    }
    if (config_.checkpointing() && (last_checkpoint_step_ != state_.step || final_best)) {
      checkpoint(final_best);
    }
  }
  outcome_.best = early_stopping_.state();
  outcome_.loss_scale_skipped_steps = loss_scaler_ ? loss_scaler_->skipped_steps() : 0;
  outcome_.counters.earlier_online_corrections +=
      parts_.batcher->has_model() ? parts_.batcher->corrections() : 0;
  return outcome_;
}

}  // namespace xpm
