// The Learner loop: epochs, steps, online corrections of the memory model, validation and votes.
#include "xpm/trainer/loop/learner.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <stdexcept>

#include "learner_impl.hpp"
#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner/dims_text.hpp"
#include "xpm/planner/enum_names.hpp"
#include "xpm/trainer/loop/error_context.hpp"

namespace xpm {
namespace {

constexpr EnumNames<OptimizerCheckpointLayout, 2> kLayoutNames{
    {{OptimizerCheckpointLayout::kPerRankShards, "sharded"}, {OptimizerCheckpointLayout::kConsolidated, "full"}}};

// Steps in a row skipped by out-of-memory errors after which the run stops: it trains nothing.
constexpr std::int64_t kMaxConsecutiveOomSteps = 10;

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
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

// A metric as JSON: integral values as integers (counts), the others as doubles.
nlohmann::json metric_json(double value) {
  if (std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 9e15) {
    return static_cast<std::int64_t>(value);
  }
  return value;
}

}  // namespace

std::string to_string(OptimizerCheckpointLayout layout) { return enum_name(kLayoutNames, layout); }

OptimizerCheckpointLayout parse_optimizer_checkpoint_layout(const std::string& text, const std::string& source) {
  return parse_enum(kLayoutNames, text, source);
}

void LearnerOptions::validate() const {
  const auto fail = [](const std::string& what) { throw std::invalid_argument("LearnerOptions." + what); };
  if (run_dir.empty()) fail("run_dir is empty");
  if (epochs < 1) fail("epochs must be >= 1, got " + std::to_string(epochs));
  if (max_steps < 0) fail("max_steps must be >= 0, got " + std::to_string(max_steps));
  if (outer_batch_size < 1) fail("outer_batch_size must be >= 1, got " + std::to_string(outer_batch_size));
  if (stop_after_steps < 0) fail("stop_after_steps must be >= 0, got " + std::to_string(stop_after_steps));
  if (memory_plan) memory_plan->validate();
  if (log_every < 1) fail("log_every must be >= 1, got " + std::to_string(log_every));
  if (!(underprediction_tolerance >= 0)) {
    fail("underprediction_tolerance must be >= 0, got " + std::to_string(underprediction_tolerance));
  }
  validation.validate();
  checkpoints.validate();
  try {
    if (default_metric_mode(validation.metric) != validation.mode) {
      fail("validation.mode is " + to_string(validation.mode) + " but the metric '" + validation.metric +
           "' is better when " + (validation.mode == MetricMode::kMax ? "lower" : "higher") +
           ": set validation.mode to MetricMode::" + (validation.mode == MetricMode::kMax ? "kMin" : "kMax"));
    }
  } catch (const std::invalid_argument& error) {
    if (std::string(error.what()).rfind("LearnerOptions.", 0) == 0) throw;  // a name without a direction: any mode
  }
  LrScheduleOptions schedule = lr_schedule;
  schedule.total_steps = 1;
  schedule.validate();
}

nlohmann::json LearnerOptions::resume_settings() const {
  return {{"epochs", epochs},
          {"max_steps", max_steps},
          {"outer_batch_size", outer_batch_size},
          {"sampler_seed", sampler_seed},
          {"lr_schedule",
           {{"kind", static_cast<int>(lr_schedule.kind)},
            {"peak_learning_rate", lr_schedule.peak_learning_rate},
            {"warmup_steps", lr_schedule.warmup_steps},
            {"final_fraction", lr_schedule.final_fraction}}},
          {"validation",
           {{"every_steps", validation.every_steps},
            {"every_epochs", validation.every_epochs},
            {"metric", validation.metric},
            {"mode", to_string(validation.mode)},
            {"warmup_validations", validation.warmup_validations},
            {"patience", validation.patience}}},
          {"underprediction_tolerance", underprediction_tolerance}};
}

std::int64_t LearnerOptions::total_steps(std::size_t records) const {
  const auto outer = static_cast<std::size_t>(std::max<std::int64_t>(1, outer_batch_size));
  const auto per_epoch = static_cast<std::int64_t>((records + outer - 1) / outer);
  return max_steps > 0 ? std::min(per_epoch * epochs, max_steps) : per_epoch * epochs;
}

Learner::Learner(TrainingTask& task, torch::optim::Optimizer& optimizer, LearnerOptions options,
                 LearnerComponents components)
    : impl_(std::make_unique<Impl>(task, optimizer, std::move(options), std::move(components))),
      state_(&impl_->state) {}

Learner::~Learner() = default;

LearnerOutcome Learner::run() { return impl_->run(); }

std::string TrainingTask::describe(const NamedMetrics& metrics) const {
  std::string text;
  char value[64];
  for (const auto& [name, metric] : metrics) {
    std::snprintf(value, sizeof value, metric == std::floor(metric) && std::fabs(metric) < 1e15 ? "%.0f" : "%.4f", metric);
    text += (text.empty() ? "" : ", ") + name + " " + value;
  }
  return text;
}

std::vector<double> dims_by_name(const std::vector<std::string>& variable_names,
                                 const std::map<std::string, double>& fields) {
  for (const auto& [name, value] : fields) {
    if (std::find(variable_names.begin(), variable_names.end(), name) == variable_names.end()) {
      throw std::invalid_argument("dims_by_name: field '" + name + "' is not a variable of the formula");
    }
  }
  std::vector<double> dims;
  for (const std::string& name : variable_names) {
    const auto it = fields.find(name);
    if (it == fields.end()) throw std::invalid_argument("dims_by_name: variable '" + name + "' is missing");
    dims.push_back(it->second);
  }
  return dims;
}

void Learner::Impl::log(const std::string& line) const {
  if (!dist.is_main()) return;
  if (options.log) {
    options.log(line);
  } else {
    std::cout << line << std::endl;
  }
}

void Learner::Impl::write_metrics_line(const nlohmann::json& line) {
  if (!dist.is_main()) return;
  std::ofstream metrics(options.run_dir + "/metrics.jsonl", std::ios::app);
  metrics << line.dump() << '\n';
  if (!metrics.flush()) throw std::runtime_error("cannot write '" + options.run_dir + "/metrics.jsonl'");
}

EngineLog Learner::Impl::engine_log() const {
  EngineLog engine;
  engine.prefix = options.log_prefix;
  engine.line = [this](const std::string& line) { log(line); };
  engine.underprediction_tolerance = options.underprediction_tolerance;
  engine.capacity_bytes = capacity_bytes();
  engine.out_of_memory_advice = options.oom_advice;
  return engine;
}

nlohmann::json Learner::Impl::step_line(const GlobalStepResult& result, double lr, std::size_t records,
                                        double step_size, std::int64_t underpredictions,
                                        double prediction_error) const {
  // A step skipped by an out-of-memory error trained nothing: no loss, no size.
  nlohmann::json line = {{"step", state.step},
                         {"epoch", state.epoch},
                         {"loss", result.oom ? nlohmann::json(nullptr) : nlohmann::json(result.loss)},
                         {"lr", lr},
                         {"records", records},
                         {"real_" + options.size_name, step_size},
                         {"microbatches", result.microbatches},
                         {"skipped_records", result.skipped_records},
                         {"oom", result.oom},
                         {"peak_allocated_bytes", result.peak_allocated_bytes},
                         {"predicted_peak_bytes", result.max_predicted_bytes},
                         {"prediction_rel_error", prediction_error},
                         {"underpredictions", underpredictions},
                         {"capacity_bytes", capacity_bytes()},
                         {"duration_s", result.duration_s},
                         {options.size_name + "_per_s", result.oom ? 0.0 : step_size / std::max(1e-9, result.duration_s)},
                         {"records_per_rank", result.records_per_rank},
                         {"microbatches_per_rank", result.microbatches_per_rank},
                         {"rank_imbalance", result.imbalance},
                         {"oom_ranks", result.oom_ranks}};
  engine->add_step_metrics(result, line);
  if (result.gradient_norm >= 0) line["grad_norm"] = result.gradient_norm;  // ShardedAdamW's clipping
  if (loss_scaler) {
    line["loss_scale"] = result.loss_scale;
    line["loss_scale_overflow"] = result.loss_scale_overflow;
  }
  for (const auto& [name, value] : context.metrics()) line[name] = value;  // hooks' (grad_norm, ...)
  if (result.microbatch_size > 0) {  // a fixed-size engine
    line["microbatch_size"] = result.microbatch_size;
    line["ooms"] = result.oom_errors;
    line["attempts"] = result.attempts;
  }
  return line;
}

void Learner::Impl::log_progress(const GlobalStepResult& result) {
  const std::int64_t step = state.step;
  if (step % options.log_every != 0 && step != state.total_steps && !result.oom) return;
  // ETA: steps left x mean step time so far (validation and checkpoints not included).
  const RunCounters& counters = outcome.counters;
  const double eta_s = static_cast<double>(state.total_steps - step) * counters.mean_step_s(step);
  char text[320];
  std::snprintf(text, sizeof text,
                "step %5lld/%lld  epoch %lld  loss %.4f  %7.0f %s/s  %2lld microbatches  "
                "peak %.1f/%.1f MiB  ETA %s%s",
                static_cast<long long>(step), static_cast<long long>(state.total_steps),
                static_cast<long long>(state.epoch + 1), result.loss,
                counters.trained_size / std::max(1e-9, counters.train_s), options.size_name.c_str(),
                static_cast<long long>(result.microbatches),
                static_cast<double>(result.peak_allocated_bytes) / (1 << 20),
                static_cast<double>(capacity_bytes()) / (1 << 20), format_duration(eta_s).c_str(),
                result.oom ? "  OOM" : "");
  log(text);
}

Learner::Impl::OuterBatchRecords Learner::Impl::read_outer_batch(const std::vector<std::size_t>& records) const {
  OuterBatchRecords batch;
  double units = 0;
  for (std::size_t index : records) {
    TrainingRecord record = task.train_record(index);
    if (!(record.units >= 0) || !std::isfinite(record.units)) {
      throw std::invalid_argument("TrainingTask::train_record(" + std::to_string(index) + ").units is " +
                                  std::to_string(record.units) + ": units must be finite and >= 0");
    }
    units += record.units;
    batch.record_dims.push_back(std::move(record.dims));
    batch.record_units.push_back(record.units);
    batch.size += record.size;
  }
  if (units <= 0) {
    throw std::invalid_argument("the outer batch of step " + std::to_string(state.step + 1) + " has 0 units (" +
                                std::to_string(records.size()) + " records): TrainingTask::train_record's units " +
                                "are what the loss is summed over and must add up to more than 0");
  }
  return batch;
}

void Learner::Impl::train_one_step(const std::vector<std::size_t>& records) {
  const OuterBatchRecords batch = read_outer_batch(records);
  const double step_size = batch.size;
  LrScheduleOptions schedule = options.lr_schedule;
  schedule.total_steps = std::max<std::int64_t>(1, state.total_steps);
  const double lr = learning_rate_at(schedule, state.step);
  set_learning_rate(optimizer, lr);
  context.clear_metrics();
  hooks.before_step(context);
  const MicrobatchLossFn loss_sum_fn = [&](const std::vector<std::size_t>& microbatch) {
    std::vector<std::size_t> ids;
    ids.reserve(microbatch.size());
    for (std::size_t i : microbatch) ids.push_back(records[i]);  // global batch -> task records
    return task.loss_sum(ids);
  };
  const BeforeOptimizerStepFn before_optimizer_step = [&] { hooks.before_optimizer_step(context); };
  const EngineLog engine_lines = engine_log();
  engine->begin_step(engine_lines);
  const GlobalStepResult result =
      engine->train_step(batch.record_dims, batch.record_units, loss_sum_fn, before_optimizer_step);
  stop_agreed = result.stop_requested;  // data parallel: agreed in the step's status
  ++state.step;
  ++state.epoch_position;
  const std::int64_t step = state.step;
  if (result.oom_errors > 0 && !result.oom) {
    log(options.log_prefix + ": step " + std::to_string(step) + ": " + std::to_string(result.oom_errors) +
        " out-of-memory error(s), redone with microbatch size " + std::to_string(result.microbatch_size));
  }
  const std::int64_t underpredictions = engine->learn_from_step(result, step, engine_lines);
  consecutive_oom_steps = result.oom ? consecutive_oom_steps + 1 : 0;
  const double prediction_error =
      result.oom || result.max_predicted_bytes <= 0
          ? 0.0
          : (static_cast<double>(result.peak_allocated_bytes) - result.max_predicted_bytes) /
                static_cast<double>(result.peak_allocated_bytes);
  outcome.counters.add_step(result, step_size, result.oom_errors, result.attempts, underpredictions,
                            prediction_error);
  write_metrics_line(step_line(result, lr, records.size(), step_size, underpredictions, prediction_error));
  check_consecutive_ooms();
  log_progress(result);
  if (result.oom) return;
  {
    auto scope = context.scope("train");
    context.add_metric("loss", result.loss);
    context.add_metric("lr", lr);
    context.add_metric("real_" + options.size_name, step_size);
    context.add_metric("microbatches", static_cast<double>(result.microbatches));
  }
  hooks.after_step(context);
}

void Learner::Impl::check_consecutive_ooms() const {
  if (consecutive_oom_steps < kMaxConsecutiveOomSteps) return;
  throw std::runtime_error(
      std::to_string(consecutive_oom_steps) + " consecutive steps ran out of memory under the capacity of " +
      std::to_string(capacity_bytes()) + " bytes: " +
      engine->out_of_memory_cause(engine_log()));
}

bool Learner::Impl::validate(std::int64_t epoch) {
  return with_error_context("validation after step " + std::to_string(state.step),
                            [&] { return run_validation(epoch); });
}

bool Learner::Impl::run_validation(std::int64_t epoch) {
  context.clear_metrics();
  hooks.before_validation(context);
  // Its own plan: a snapshot of the engine's (the memory model, or the fixed/power size);
  // nothing measured here goes back into training's.
  const ValidationPlanFn plan_of = engine->validation_planner();
  const auto start = std::chrono::steady_clock::now();
  const NamedMetrics metrics =
      task.validation_record_count() > 0 ? validate_records(task, plan_of, dist) : task.validate(plan_of);
  outcome.last_validation_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  outcome.last_validation = metrics;
  last_validation_step = state.step;
  {
    auto scope = context.scope("validation");
    for (const auto& [name, value] : metrics) context.add_metric(name, value);
  }
  hooks.after_validation(context);
  std::vector<LearnerVote> votes = {early_stopping.on_validation(context)};
  for (const auto& listener : parts.listeners) votes.push_back(listener->on_validation(context));
  const LearnerVote vote = combine_votes(votes);
  const bool is_best = early_stopping.last_was_best();
  const char* vote_name = vote == LearnerVote::kStop ? "stop" : vote == LearnerVote::kContinue ? "continue" : "no_decision";
  nlohmann::json recorded = {{"step", state.step}, {"best", is_best}};
  nlohmann::json line_metrics = nlohmann::json::object();
  for (const auto& [name, value] : metrics) {
    recorded["val_" + name] = metric_json(value);
    line_metrics[name] = metric_json(value);
  }
  line_metrics["duration_s"] = outcome.last_validation_s;
  outcome.counters.validations.push_back(recorded);
  const auto& best_value = early_stopping.state().best_value;
  write_metrics_line({{"step", state.step},
                      {"epoch", epoch},
                      {"validation", line_metrics},
                      {"metric", options.validation.metric},
                      {"best", is_best},
                      {"best_value", best_value ? nlohmann::json(*best_value) : nlohmann::json()},
                      {"vote", vote_name}});
  if (is_best && dist.is_main()) save_parameters_atomically(task.module(), options.run_dir + "/best_parameters.pt");
  log("validation at step " + std::to_string(state.step) + ": " + task.describe(metrics) +
      (is_best ? "  (best)" : "") + (vote == LearnerVote::kStop ? "  -> early stopping" : ""));
  return vote == LearnerVote::kStop;
}

void Learner::Impl::run_epochs() {
  bool stop = outcome.early_stopped;
  bool interrupted = false;
  bool resumed_mid_epoch = outcome.resumed_from_step >= 0;
  const auto outer = static_cast<std::size_t>(options.outer_batch_size);
  for (; state.epoch < options.epochs && state.step < state.total_steps && !stop && !interrupted;) {
    if (!resumed_mid_epoch) {
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), sampler);
    }
    resumed_mid_epoch = false;
    while (state.epoch_position < steps_per_epoch && state.step < state.total_steps) {
      const std::size_t begin = static_cast<std::size_t>(state.epoch_position) * outer;
      const std::size_t end = std::min(order.size(), begin + outer);
      const std::vector<std::size_t> records(order.begin() + static_cast<std::ptrdiff_t>(begin),
                                             order.begin() + static_cast<std::ptrdiff_t>(end));
      with_error_context("step " + std::to_string(state.step + 1), [&] { train_one_step(records); });
      const std::int64_t epoch_completed = state.epoch_position == steps_per_epoch ? state.epoch + 1 : 0;
      bool is_best = false;
      if (options.validation.due(state.step, epoch_completed) && state.step < state.total_steps) {
        stop = validate(state.epoch);
        is_best = early_stopping.last_was_best();
        outcome.early_stopped = stop;
      }
      // Exactly at stop_after_steps: a run resumed from that step's checkpoint goes on.
      interrupted = ((options.stop_after_steps > 0 && state.step == options.stop_after_steps) || stop_agreed) &&
                    state.step < state.total_steps;
      // The last step's checkpoint waits for the final validation (finish()).
      const bool last_step = state.step == state.total_steps;
      if (store && !last_step &&
          (store->due(state.step, epoch_completed) || (is_best && options.checkpointing()) || interrupted)) {
        checkpoint(is_best);
      }
      if (stop || interrupted) break;
    }
    if (stop || interrupted) break;
    ++state.epoch;
    state.epoch_position = 0;
  }
  outcome.finished = !interrupted;
  outcome.stopped_by_signal = interrupted && stop_agreed;
  outcome.stop_signal = stop_signals ? stop_signals->signal() : 0;
}

void Learner::Impl::finish() {
  if (!outcome.finished) {
    const std::string why = !outcome.stopped_by_signal ? "stop after steps"
                            : outcome.stop_signal != 0 ? signal_name(outcome.stop_signal)
                                                       : "a signal to another rank";
    log(options.log_prefix + ": stopped after step " + std::to_string(state.step) + " (" + why +
        "); a resume continues from the checkpoint");
  } else {
    bool final_best = false;
    if (last_validation_step != state.step || outcome.counters.validations.empty()) {
      outcome.early_stopped = validate(state.epoch) || outcome.early_stopped;
      final_best = early_stopping.last_was_best();
    }
    if (options.checkpointing() && (last_checkpoint_step != state.step || final_best)) checkpoint(final_best);
  }
  outcome.best = early_stopping.state();
  outcome.loss_scale_skipped_steps = loss_scaler ? loss_scaler->skipped_steps() : 0;
  const EngineMemorySummary memory = engine->memory_summary();
  outcome.counters.earlier_online_corrections += memory.corrections;
  outcome.steps = state.step;
  outcome.total_steps = state.total_steps;
  if (memory.has_model) {
    outcome.memory_formula = memory.formula;
    outcome.floor_bytes = memory.floor_bytes;
  }
}

LearnerOutcome Learner::Impl::run() {
  // From the start: a signal while probing or resuming stops the run after its first step.
  if (!options.stop_signals.empty()) stop_signals.emplace(options.stop_signals);
  if (!parts.resume_from && options.resume) find_checkpoint_to_resume();
  if (parts.resume_from) restore(*parts.resume_from);
  obtain_memory_model();
  if (dist.is_main()) {
    const std::string metrics_path = options.run_dir + "/metrics.jsonl";
    if (parts.resume_from) {
      truncate_metrics_after(metrics_path, state.step);
    } else {
      write_file_atomically(metrics_path, "");
    }
  }
  set_learning_rate(optimizer, 0.0);
  if (stop_signals) engine->set_stop_flag(&stop_signals->flag());
  run_epochs();
  finish();
  outcome.memory_model_from_checkpoint = memory_model_from_checkpoint;
  engine->set_stop_flag(nullptr);  // the flag goes with stop_signals
  stop_signals.reset();  // the handlers that were there before
  return outcome;
}

}  // namespace xpm
