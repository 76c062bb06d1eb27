// The generic Learner on a task of its own (a linear regression over variable-size records,
// nothing of the tagging job): steps, validation, the task's extra state, exact resume, errors.
#include "torch_doctest.hpp"
#include "scratch_folders.hpp"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/loop/learner.hpp"
#include "xpm/trainer/steps/fixed_step_engines.hpp"
#include "xpm/trainer/steps/predictive_step_engine.hpp"
#include "xpm/trainer/loop/stop_signals.hpp"

namespace {

// Run folders under the build tree's scratch folder, not the working directory.
const std::string kWork = std::string(XPM_BINARY_DIR) + "/test_scratch/learner_test";

// Records are rows of x [n, 4] with a target; each record also has a "length" (1..5) that only
// the dims see, and the loss counts a record `length` times (its units).
class RegressionTask : public xpm::TrainingTask {
 public:
  RegressionTask() {
    torch::manual_seed(3);  // the same data and initial weights in every run
    linear_ = torch::nn::Linear(4, 1);
    x_ = torch::randn({40, 4});
    y_ = x_.matmul(torch::tensor({1.0f, -2.0f, 0.5f, 3.0f})) + 0.01 * torch::randn({40});
    for (int i = 0; i < 40; ++i) lengths_.push_back(1 + i % 5);
  }
  torch::nn::Module& module() override { return *linear_; }
  std::size_t train_record_count() const override { return 32; }  // the last 8 are held out
  xpm::TrainingRecord train_record(std::size_t i) const override {
    const auto l = static_cast<double>(lengths_.at(i));
    return {{1.0, l}, l, l};
  }
  torch::Tensor loss_sum(const std::vector<std::size_t>& records) override {
    ++loss_calls_;
    std::vector<std::int64_t> ids(records.begin(), records.end());
    const torch::Tensor index = torch::tensor(ids);
    torch::Tensor weights = torch::tensor(std::vector<float>(records.size()));
    for (std::size_t k = 0; k < records.size(); ++k) weights[std::int64_t(k)] = float(lengths_[records[k]]);
    const torch::Tensor error = linear_->forward(x_.index_select(0, index)).squeeze(1) - y_.index_select(0, index);
    return (weights * error * error).sum();
  }
  xpm::NamedMetrics validate(const xpm::ValidationPlanFn& plan_of) override {
    torch::NoGradGuard no_grad;
    std::vector<std::vector<double>> dims(8, {1.0, 1.0});
    double sum = 0;
    for (const xpm::Microbatch& mb : plan_of(dims).microbatches) {
      for (std::size_t j : mb.record_indices) {
        const auto i = static_cast<std::int64_t>(32 + j);
        sum += (linear_->forward(x_[i].unsqueeze(0)).squeeze() - y_[i]).pow(2).item<double>();
      }
    }
    return {{"loss", sum / 8}, {"records", 8}};
  }
  torch::Tensor probe_loss_sum(const std::vector<double>& dims) override {
    const auto bs = static_cast<std::int64_t>(dims.at(0));
    return linear_->forward(torch::randn({bs, 4})).pow(2).sum();
  }
  nlohmann::json extra_state() const override { return {{"loss_calls", loss_calls_}}; }
  void restore_extra_state(const nlohmann::json& state) override {
    restored_loss_calls_ = state.at("loss_calls").get<std::int64_t>();
  }

  torch::nn::Linear linear_{nullptr};
  torch::Tensor x_, y_;
  std::vector<int> lengths_;
  std::int64_t loss_calls_ = 0;
  std::int64_t restored_loss_calls_ = -1;
};

// Options of a run in kWork/RUN_DIR ("case/run"); kWork/case is removed when the test case passes.
xpm::LearnerOptions options_in(const std::string& run_dir) {
  xpm::LearnerOptions options;
  options.run_dir = kWork + "/" + run_dir;
  xpm_test::remove_when_passed(std::filesystem::path(kWork) / *std::filesystem::path(run_dir).begin());
  options.epochs = 3;
  options.outer_batch_size = 8;  // 4 steps per epoch, 12 in all
  options.lr_schedule.peak_learning_rate = 0.05;
  options.validation.every_steps = 4;
  options.validation.metric = "loss";
  options.validation.mode = xpm::MetricMode::kMin;
  options.checkpoints.every_steps = 4;
  options.log = [](const std::string&) {};
  return options;
}

struct Trained {
  xpm::LearnerOutcome outcome;
  torch::Tensor weight;
  std::int64_t restored_loss_calls = -1;
};

// The regression task that sends itself SIGUSR2 in the middle of step 5 (its 13th microbatch).
struct SignalledTask : RegressionTask {
  torch::Tensor loss_sum(const std::vector<std::size_t>& records) override {
    if (loss_calls_ == 12) std::raise(SIGUSR2);
    return RegressionTask::loss_sum(records);
  }
};

template <class Task = RegressionTask>
Trained train(xpm::LearnerOptions options) {
  Task task;
  torch::optim::SGD optimizer(task.module().parameters(), torch::optim::SGDOptions(0.05));
  xpm::LearnerComponents parts;
  parts.engine = std::make_shared<xpm::FixedStepEngine>(optimizer, nullptr, /*microbatch_size=*/3);
  xpm::Learner learner(task, optimizer, std::move(options), parts);
  Trained trained{learner.run(), task.linear_->weight.detach().clone(), -1};
  trained.restored_loss_calls = task.restored_loss_calls_;
  return trained;
}

}  // namespace

TEST_CASE("dims_by_name orders a record's fields as the formula's variables and names what is wrong") {
  CHECK(xpm::dims_by_name({"bs", "l"}, {{"l", 12}, {"bs", 1}}) == std::vector<double>{1, 12});
  CHECK_THROWS_WITH_AS(xpm::dims_by_name({"bs", "l"}, {{"bs", 1}}), "dims_by_name: variable 'l' is missing",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::dims_by_name({"bs"}, {{"bs", 1}, {"w", 2}}),
                       "dims_by_name: field 'w' is not a variable of the formula", std::invalid_argument);
}

TEST_CASE("the Learner trains a task of its own: steps, validations, metrics lines and a falling loss") {
  std::filesystem::remove_all(kWork + "/trains");
  const Trained whole = train(options_in("trains/whole"));
  CHECK(whole.outcome.steps == 12);
  CHECK(whole.outcome.finished);
  CHECK(whole.outcome.counters.validations.size() == 3);  // steps 4, 8, 12
  const auto& first = whole.outcome.counters.validations.front();
  const auto& last = whole.outcome.counters.validations.back();
  CHECK(last.at("val_records").get<std::int64_t>() == 8);
  CHECK(last.at("val_loss").get<double>() < first.at("val_loss").get<double>());
  CHECK(whole.outcome.last_validation.at("loss") == doctest::Approx(last.at("val_loss").get<double>()));
  std::ifstream metrics(kWork + "/trains/whole/metrics.jsonl");
  int steps = 0, validations = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json entry = nlohmann::json::parse(line);
    if (entry.contains("validation")) {
      ++validations;
    } else {
      ++steps;
      CHECK(entry.at("microbatches").get<std::int64_t>() == 3);  // 8 records, 3 per microbatch
      CHECK(entry.at("records").get<std::int64_t>() == 8);
    }
  }
  CHECK(steps == 12);
  CHECK(validations == 3);
  CHECK(std::filesystem::exists(kWork + "/trains/whole/best_parameters.pt"));
}

TEST_CASE("a Learner run stopped after step 6 and resumed ends with bitwise the weights of an uninterrupted one") {
  std::filesystem::remove_all(kWork + "/stopped");
  const Trained whole = train(options_in("stopped/whole"));
  xpm::LearnerOptions stopped = options_in("stopped/resumed");
  stopped.stop_after_steps = 6;
  const Trained first = train(stopped);
  CHECK_FALSE(first.outcome.finished);
  CHECK(first.outcome.steps == 6);
  xpm::LearnerOptions resumed = options_in("stopped/resumed");
  resumed.resume = true;
  const Trained second = train(resumed);
  CHECK(second.outcome.resumed_from_step == 6);
  CHECK(second.outcome.steps == 12);
  CHECK(second.restored_loss_calls == 6 * 3);  // the task's extra state came back
  CHECK(torch::equal(second.weight, whole.weight));
  CHECK(second.outcome.counters.validations == whole.outcome.counters.validations);
}

TEST_CASE("the Learner refuses records whose units are negative or not a number, and an outer batch of 0 units") {
  std::filesystem::remove_all(kWork + "/units");
  struct BadUnits : RegressionTask {
    double units = -1;
    xpm::TrainingRecord train_record(std::size_t i) const override {
      xpm::TrainingRecord record = RegressionTask::train_record(i);
      record.units = units;
      return record;
    }
  };
  for (const double units : {-1.0, std::nan(""), 0.0}) {
    BadUnits task;
    task.units = units;
    torch::optim::SGD optimizer(task.module().parameters(), torch::optim::SGDOptions(0.05));
    xpm::LearnerComponents parts;
    parts.engine = std::make_shared<xpm::FixedStepEngine>(optimizer, nullptr, 3);
    xpm::Learner learner(task, optimizer, options_in("units/units"), parts);
    CHECK_THROWS_AS(learner.run(), std::invalid_argument);
  }
}

TEST_CASE("the Learner refuses components that cannot work, naming them") {
  RegressionTask task;
  torch::optim::SGD optimizer(task.module().parameters(), torch::optim::SGDOptions(0.05));
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options_in("components/none"), {}),
                       "LearnerComponents: no step engine: give an engine, a batcher (predictive) or "
                       "LearnerOptions.memory_plan",
                       std::invalid_argument);
  xpm::LearnerComponents parts;
  parts.engine = std::make_shared<xpm::FixedStepEngine>(optimizer, nullptr, 3);
  xpm::LearnerOptions options = options_in("components/bad");
  options.outer_batch_size = 0;
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options, parts),
                       "LearnerOptions.outer_batch_size must be >= 1, got 0", std::invalid_argument);
  options = options_in("components/bad");
  options.validation.mode = xpm::MetricMode::kMax;  // a loss is better when lower
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options, parts),
                       "LearnerOptions.validation.mode is max but the metric 'loss' is better when lower: set "
                       "validation.mode to MetricMode::kMin",
                       std::invalid_argument);
  options = options_in("components/bad");
  options.stop_after_steps = 13;
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options, parts),
                       "LearnerOptions.stop_after_steps 13 is beyond the run's 12 steps", std::invalid_argument);
}

namespace {

// A caller's engine: FixedStepEngine's steps and validation slices, counted.
class CountingEngine : public xpm::FixedStepEngine {
 public:
  using FixedStepEngine::FixedStepEngine;
  xpm::GlobalStepResult train_step(const std::vector<std::vector<double>>& record_dims,
                                   const std::vector<double>& record_units, const xpm::MicrobatchLossFn& loss_sum_fn,
                                   const xpm::BeforeOptimizerStepFn& before_optimizer_step) override {
    ++steps;
    return FixedStepEngine::train_step(record_dims, record_units, loss_sum_fn, before_optimizer_step);
  }
  xpm::ValidationPlanFn validation_planner() const override {
    ++validations;
    return FixedStepEngine::validation_planner();
  }
  std::int64_t steps = 0;
  mutable std::int64_t validations = 0;
};

}  // namespace

TEST_CASE("the Learner runs the step engine it is given, refusing one beside a batcher or at a world size it refuses") {
  RegressionTask task;
  torch::optim::SGD optimizer(task.module().parameters(), torch::optim::SGDOptions(0.05));
  auto engine = std::make_shared<CountingEngine>(optimizer, nullptr, 3);
  xpm::LearnerComponents parts;
  parts.engine = engine;
  const xpm::LearnerOutcome outcome =
      xpm::Learner(task, optimizer, options_in("engine/counted").set_size_name("values"), parts).run();
  CHECK(engine->steps == 12);
  CHECK(engine->validations == 3);  // every 4 steps, the last one included
  CHECK(outcome.counters.microbatches == 12 * 3);  // 8 records a step in slices of 3
  CHECK(outcome.memory_formula.empty());
  std::ifstream metrics(kWork + "/engine/counted/metrics.jsonl");
  std::string first_line;
  std::getline(metrics, first_line);
  const nlohmann::json first = nlohmann::json::parse(first_line);
  CHECK(first.at("real_values").get<double>() >= 8);  // 8 records of sizes 1..5
  CHECK(first.contains("values_per_s"));
  CHECK(first.at("microbatch_size") == 3);
  CHECK(first.at("attempts") == 1);
  CHECK_FALSE(first.contains("real_tokens"));

  xpm::PredictiveBatcherOptions planner_options;
  planner_options.formula = xpm::CostFormula("a*bs", {"a"}, {"bs"});
  planner_options.probe_points = {{{{"bs", 1}}}};
  planner_options.budget = {1, 1.0, 0};
  xpm::PredictiveBatcher planner(planner_options, std::make_shared<xpm::UniformPacker>());
  parts.batcher = &planner;
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options_in("engine/both"), parts),
                       "LearnerComponents: give an engine or a batcher (the predictive engine's), not both",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(engine->check_world_size(2),
                       "FixedStepEngine runs in a single process only, got world_size 2: data parallelism needs "
                       "the predictive engine",
                       std::invalid_argument);
  CHECK_NOTHROW(engine->check_world_size(1));
}

TEST_CASE("a signal stops the Learner after the step in progress, with a checkpoint a resume continues bit for bit") {
  std::filesystem::remove_all(kWork + "/signal");
  const Trained whole = train(options_in("signal/whole"));
  xpm::LearnerOptions signalled = options_in("signal/signalled");
  signalled.stop_signals = {SIGUSR2};
  signalled.checkpoints.every_steps = 0;  // the stop writes its checkpoint anyway
  const Trained first = train<SignalledTask>(signalled);
  CHECK_FALSE(first.outcome.finished);
  CHECK(first.outcome.stopped_by_signal);
  CHECK(first.outcome.stop_signal == SIGUSR2);
  CHECK(first.outcome.steps == 5);  // step 5 was finished, not abandoned
  CHECK(std::filesystem::exists(kWork + "/signal/signalled/checkpoints/step-00000005"));
  CHECK((std::signal(SIGUSR2, SIG_DFL) == SIG_DFL));  // run() put the previous handler back
  xpm::LearnerOptions resumed = options_in("signal/signalled");
  resumed.checkpoints.every_steps = 0;
  resumed.resume = true;
  const Trained second = train(resumed);
  CHECK(second.outcome.resumed_from_step == 5);
  CHECK(torch::equal(second.weight, whole.weight));
}

TEST_CASE("StopSignals: one instance at a time, signals that can be caught, names both ways") {
  {
    xpm::StopSignals stop({SIGUSR2});
    CHECK_FALSE(stop.requested());
    std::raise(SIGUSR2);
    CHECK(stop.requested());
    CHECK(stop.signal() == SIGUSR2);
    CHECK_THROWS_AS(xpm::StopSignals({SIGUSR1}), std::logic_error);
  }
  CHECK_THROWS_WITH_AS(xpm::StopSignals({SIGKILL}), "StopSignals: signal 9 cannot be caught", std::invalid_argument);
  CHECK(xpm::parse_signal_name("USR1", "--preemption-signal") == SIGUSR1);
  CHECK(xpm::parse_signal_name("SIGTERM", "--preemption-signal") == SIGTERM);
  CHECK(xpm::parse_signal_name("none", "--preemption-signal") == 0);
  CHECK(xpm::signal_name(SIGUSR2) == "SIGUSR2");
  CHECK_THROWS_WITH_AS(xpm::parse_signal_name("SIGFOO", "--preemption-signal"),
                       "--preemption-signal must be a signal name (SIGUSR1, SIGUSR2, SIGTERM, ...) or none, got 'SIGFOO'",
                       std::invalid_argument);
}

namespace {

// The regression task validated by the Learner itself: the 8 held-out records, one unit each,
// their summed squared error.
struct RecordValidatedTask : RegressionTask {
  std::size_t validation_record_count() const override { return 8; }
  xpm::TrainingRecord validation_record(std::size_t i) const override { return {{1.0, double(lengths_.at(32 + i))}, 1, 1}; }
  xpm::NamedMetrics validation_sums(const std::vector<std::size_t>& records) override {
    CHECK_FALSE(torch::GradMode::is_enabled());
    CHECK_FALSE(linear_->is_training());
    double sum = 0;
    for (std::size_t j : records) {
      const auto i = static_cast<std::int64_t>(32 + j);
      sum += (linear_->forward(x_[i].unsqueeze(0)).squeeze() - y_[i]).pow(2).item<double>();
    }
    return {{"loss", sum}};
  }
};

xpm::MemoryPlanOptions small_memory_plan() {
  return xpm::MemoryPlanOptions(xpm::CostFormula::with_variables("a*bs + c", {"bs", "l"}))
      .set_variable_max({{"bs", 8}, {"l", 5}})
      .set_design_fractions({1.0, 0.5});
}

}  // namespace

TEST_CASE("the Learner builds its plan from MemoryPlanOptions, validates the task's records itself and reports") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();  // before the task's model
  const std::int64_t cap_before = meter.capacity_bytes();
  meter.set_capacity_bytes(64'000'000);
  RecordValidatedTask task;
  torch::optim::SGD optimizer(task.module().parameters(), torch::optim::SGDOptions(0.05));
  std::filesystem::remove_all(kWork + "/memory_plan");
  xpm::LearnerOptions options = options_in("memory_plan/run").set_memory_plan(small_memory_plan()).set_epochs(1);
  xpm::LearnerComponents parts;
  parts.meter = &meter;
  xpm::Learner learner(task, optimizer, options, parts);
  const xpm::LearnerOutcome outcome = learner.run();
  meter.set_capacity_bytes(cap_before);
  CHECK(outcome.probes > 0);
  CHECK(outcome.memory_formula == "a*bs + c");
  CHECK(outcome.counters.ooms == 0);
  double expected = 0;  // the last validation: the mean squared error of the final weights
  {
    torch::NoGradGuard no_grad;
    for (std::int64_t i = 32; i < 40; ++i) expected += (task.linear_->forward(task.x_[i].unsqueeze(0)).squeeze() - task.y_[i]).pow(2).item<double>();
  }
  CHECK(outcome.last_validation.at("loss") == doctest::Approx(expected / 8).epsilon(1e-6));
  CHECK(outcome.last_validation.at("records") == 8);
  CHECK(task.linear_->is_training());
  const std::string brief = outcome.brief_report();
  CHECK(brief.rfind("steps 4 of 4, microbatches ", 0) == 0);
  CHECK(brief.find(", OOM 0, ") != std::string::npos);
  CHECK(brief.find("; validation: loss ") != std::string::npos);
  CHECK(brief.find("; finished") != std::string::npos);
  CHECK(brief.find("not trained") == std::string::npos);
  xpm::LearnerOutcome skipping = outcome;  // records over the budget even alone: said, not only counted
  skipping.counters.skipped_records = 70;
  CHECK(skipping.brief_report().find(", underpredictions 0; 70 record(s) not trained, predicted over the budget "
                                     "even alone; validation: ") != std::string::npos);
  CHECK(outcome.full_report().find("\nmemory model: a*bs + c, floor ") != std::string::npos);
}

TEST_CASE("the Learner refuses a memory plan beside a batcher, one without a meter, and a model on another device") {
  RegressionTask task;
  torch::optim::SGD optimizer(task.module().parameters(), torch::optim::SGDOptions(0.05));
  xpm::LearnerComponents with_batcher;
  with_batcher.engine = std::make_shared<xpm::FixedStepEngine>(optimizer, nullptr, 3);
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options_in("refused").set_memory_plan(small_memory_plan()), with_batcher),
                       doctest::Contains("give no engine nor batcher in LearnerComponents with it"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options_in("refused").set_memory_plan(small_memory_plan())),
                       doctest::Contains("memory_plan needs LearnerComponents.meter"), std::invalid_argument);
  // The plan's own options are checked with the Learner's, before any meter is asked.
  CHECK_THROWS_WITH_AS(small_memory_plan().set_packer(xpm::PackerKind::kUniform).set_sort_by("l").validate(),
                       "MemoryPlanOptions.sort_by 'l' applies to the adaptive packer only, not 'uniform'",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(options_in("refused").set_memory_plan(small_memory_plan().set_memory_fraction(1.5)).validate(),
                       "MemoryBudget: memory_fraction must be in (0, 1], got 1.5", std::invalid_argument);
  CHECK_THROWS_WITH_AS(small_memory_plan().set_batch_size_variable("n").validate(),
                       "PredictiveBatcherOptions.batch_size_variable 'n' is not one of the formula's variables",
                       std::invalid_argument);
  CHECK_NOTHROW(small_memory_plan().validate());
  CHECK_THROWS_WITH_AS(xpm::Learner(task, optimizer, options_in("refused").set_device(torch::Device("cuda:0")), with_batcher),
                       "LearnerOptions.device is cuda:0 but the model's parameter 'weight' is on cpu: build the model "
                       "on the device (module.to(device))",
                       std::invalid_argument);
}

namespace {

// A task whose microbatches allocate tens of megabytes (a two-layer MLP, 4,096 wide, over `l`
// rows of 256 features per record), so that a caching allocator's segments differ from the
// bytes allocated.
struct WideTask : xpm::TrainingTask {
  WideTask() {
    torch::manual_seed(5);
    net_ = torch::nn::Sequential(torch::nn::Linear(256, 4096), torch::nn::GELU(), torch::nn::Linear(4096, 256));
    for (int i = 0; i < 96; ++i) lengths_.push_back(16 + (i * 37) % 241);  // 16 to 256 rows
  }
  torch::nn::Module& module() override { return *net_; }
  std::size_t train_record_count() const override { return lengths_.size(); }
  xpm::TrainingRecord train_record(std::size_t i) const override {
    const auto l = static_cast<double>(lengths_.at(i));
    return {{1.0, l}, l, l};
  }
  torch::Tensor rows_loss(std::int64_t records, std::int64_t rows) {
    return net_->forward(torch::ones({records * rows, 256}) * 0.01).pow(2).sum();
  }
  torch::Tensor loss_sum(const std::vector<std::size_t>& records) override {
    std::int64_t longest = 0;
    for (std::size_t i : records) longest = std::max<std::int64_t>(longest, lengths_[i]);
    return rows_loss(static_cast<std::int64_t>(records.size()), longest);  // padded to the longest
  }
  xpm::NamedMetrics validate(const xpm::ValidationPlanFn&) override { return {{"loss", 0.0}}; }
  torch::Tensor probe_loss_sum(const std::vector<double>& dims) override {
    return rows_loss(static_cast<std::int64_t>(dims.at(0)), static_cast<std::int64_t>(dims.at(1)));
  }

  torch::nn::Sequential net_{nullptr};
  std::vector<int> lengths_;
};

}  // namespace

namespace {

constexpr std::int64_t kReservedCap = 200'000'000;

xpm::MemoryPlanOptions wide_memory_plan() {
  return xpm::MemoryPlanOptions(xpm::CostFormula::with_variables("a*bs*l + c", {"bs", "l"}))
      .set_variable_max({{"bs", 16}, {"l", 256}})
      .set_design_fractions({1.0, 0.5, 0.25})
      .set_memory_fraction(1.0);  // the cap itself binds: no reserve hides the allocator's gap
}

struct ReservedRun {
  xpm::LearnerOutcome outcome;
  std::vector<nlohmann::json> steps;  // the metrics lines of the steps
  std::vector<std::string> log;
  std::vector<float> weight;  // the first layer's, after the run
};

// One epoch of WideTask under the CPU meter emulating CUDA's caching allocator, capped at
// kReservedCap reserved bytes; `batcher`: a planner given (else the Learner's own, probed).
ReservedRun run_under_caching(const std::string& run_dir, xpm::PredictiveBatcher* batcher,
                              const std::function<void(xpm::LearnerOptions&)>& adjust = {}) {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t cap_before = meter.capacity_bytes();
  meter.set_caching(xpm::CachingAllocatorOptions{});
  ReservedRun run;
  WideTask task;
  {
    torch::optim::Adam optimizer(task.module().parameters(), torch::optim::AdamOptions(1e-3));
    meter.set_capacity_bytes(kReservedCap);
    xpm::LearnerOptions options = options_in(run_dir).set_epochs(1).set_outer_batch_size(16);
    if (batcher == nullptr) options.set_memory_plan(wide_memory_plan());
    options.log = [&run](const std::string& line) { run.log.push_back(line); };
    if (adjust) adjust(options);
    xpm::LearnerComponents parts;
    parts.meter = &meter;
    parts.batcher = batcher;
    run.outcome = xpm::Learner(task, optimizer, options, parts).run();
  }
  meter.set_capacity_bytes(cap_before);
  meter.set_caching(std::nullopt);
  // Copied out of tensors: a tensor kept alive would count in the next run's bytes.
  const torch::Tensor weight = task.net_[0]->as<torch::nn::Linear>()->weight.detach().contiguous();
  run.weight.assign(weight.data_ptr<float>(), weight.data_ptr<float>() + weight.numel());
  std::ifstream metrics(kWork + "/" + run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    nlohmann::json entry = nlohmann::json::parse(line);
    if (!entry.contains("validation")) run.steps.push_back(std::move(entry));
  }
  return run;
}

}  // namespace

TEST_CASE("under a caching allocator the Learner plans reserved bytes and calibrates their gap") {
  std::filesystem::remove_all(kWork + "/reserved");
  const ReservedRun planned = run_under_caching("reserved/run", nullptr);
  CHECK(planned.outcome.counters.ooms == 0);
  double highest_reserved = 0, highest_optimizer_reserved = 0, worst_under = 0, worst_over = 0;
  int measured = 0;
  for (const nlohmann::json& entry : planned.steps) {
    REQUIRE(entry.contains("peak_reserved_bytes"));
    highest_reserved = std::max(highest_reserved, entry.at("peak_reserved_bytes").get<double>());
    // The optimizer step's reserved peak is measured too (and bounds the floor when above it).
    const double optimizer_reserved = entry.at("optimizer_step_peak_reserved_bytes").get<double>();
    CHECK(optimizer_reserved > 0);
    highest_optimizer_reserved = std::max(highest_optimizer_reserved, optimizer_reserved);
    const auto& errors = entry.at("microbatch_planned_rel_errors");
    for (std::size_t k = 0; k < errors.size() && entry.at("step").get<int>() >= 3; ++k) {
      worst_under = std::min(worst_under, errors[k].get<double>());
      worst_over = std::max(worst_over, errors[k].get<double>());
      ++measured;
    }
  }
  MESSAGE("reserved bytes planned: " << planned.steps.size() << " steps, highest reserved peak "
          << highest_reserved / kReservedCap * 100 << " % of the cap; from step 3, " << measured
          << " microbatches planned vs measured reserved " << worst_under * 100 << " % to " << worst_over * 100
          << " %; optimizer steps reserved at most " << highest_optimizer_reserved / kReservedCap * 100 << " %");
  CHECK(planned.steps.size() == 6);
  CHECK(highest_reserved <= kReservedCap);
  CHECK(highest_optimizer_reserved <= kReservedCap);
  // From step 3 within 2 % under what it reserved (measured: -1.34 %; a reserved peak is a step
  // function of the shapes, which the calibration's line follows from above once it has seen it).
  CHECK(worst_under >= -0.02);
  const auto calibrated = std::count_if(planned.log.begin(), planned.log.end(), [](const std::string& line) {
    return line.rfind("xpm: calibration: step ", 0) == 0;
  });
  CHECK(calibrated >= 1);  // the gap from the probes, corrected by what training reserved
  CHECK(std::any_of(planned.log.begin(), planned.log.end(), [](const std::string& line) {
    return line.rfind("xpm: reserved bytes planned: the probes reserved ", 0) == 0;
  }));

  // The same model without its reserved gap plans allocated bytes: over the cap at once.
  std::ifstream state_file(kWork + "/reserved/run/checkpoints/step-00000006/state.json");
  nlohmann::json model_json = nlohmann::json::parse(state_file).at("memory_model");
  REQUIRE(model_json.at("metadata").contains("reserved_gap"));
  model_json["metadata"].erase("reserved_gap");
  const xpm::MemoryPlanOptions plan = wide_memory_plan();
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t cap_before = meter.capacity_bytes();
  meter.set_capacity_bytes(kReservedCap);
  xpm::PredictiveBatcher allocated(plan.batcher_options(meter), xpm::make_packer(plan.packer, plan.sort_by));
  meter.set_capacity_bytes(cap_before);
  allocated.set_model(xpm::MemoryModel::from_json(model_json));
  CHECK(allocated.correction() == xpm::Correction{});
  const ReservedRun unplanned = run_under_caching("reserved/allocated", &allocated);
  MESSAGE("allocated bytes planned: " << unplanned.outcome.counters.ooms << " step(s) out of memory of "
          << unplanned.steps.size());
  CHECK(unplanned.outcome.counters.ooms > 0);
}

TEST_CASE("under a caching allocator a Learner run resumed after step 3 plans and trains as the uninterrupted one") {
  std::filesystem::remove_all(kWork + "/reserved_resume");
  const ReservedRun whole = run_under_caching("reserved_resume/whole", nullptr);
  const auto stop_after_3 = [](xpm::LearnerOptions& options) { options.stop_after_steps = 3; };
  const ReservedRun first = run_under_caching("reserved_resume/resumed", nullptr, stop_after_3);
  REQUIRE(first.outcome.steps == 3);
  const ReservedRun second =
      run_under_caching("reserved_resume/resumed", nullptr, [](xpm::LearnerOptions& options) { options.resume = true; });
  CHECK(second.outcome.resumed_from_step == 3);
  REQUIRE(second.steps.size() == whole.steps.size());  // the resumed run's metrics file holds every step
  for (std::size_t k = 3; k < whole.steps.size(); ++k) {
    CAPTURE(k);
    CHECK(second.steps[k].at("microbatches") == whole.steps[k].at("microbatches"));
    CHECK(second.steps[k].at("correction_bytes") == whole.steps[k].at("correction_bytes"));
    // Not the reserved peaks themselves: the restored weights and optimizer state lie elsewhere
    // in the allocator's segments (measured: step 4 reserved 169.9 MB resumed, 190.8 MB whole).
  }
  CHECK(second.weight == whole.weight);
}

TEST_CASE("under a caching allocator an optimizer step reserving above the floor and its correction raises the floor") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t cap_before = meter.capacity_bytes();
  meter.set_caching(xpm::CachingAllocatorOptions{});
  meter.set_capacity_bytes(kReservedCap);
  {
    torch::nn::Linear layer(4, 4);
    torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
    const xpm::MemoryPlanOptions plan = wide_memory_plan();
    xpm::PredictiveBatcher batcher(plan.batcher_options(meter), xpm::make_packer(plan.packer, plan.sort_by));
    // a*bs*l + c with a floor of 10 MB, and a reserved gap of 1 MB + 10 % of a prediction.
    xpm::MemoryModel model(xpm::CostFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"}), {100.0, 5e6}, 10e6, "bs");
    model.metadata()["reserved_gap"] = {{"intercept_bytes", 1e6}, {"slope", 0.1}, {"points", 4}};
    batcher.set_model(model);
    REQUIRE(batcher.correction() == xpm::Correction{1e6, 0.1});
    xpm::DistributedContext dist;
    xpm::PredictiveStepEngine engine(optimizer, batcher, &meter, dist, nullptr);
    REQUIRE(engine.plans_reserved_bytes());
    std::vector<std::string> lines;
    xpm::EngineLog log;
    log.line = [&lines](const std::string& line) { lines.push_back(line); };
    xpm::GlobalStepResult result;
    result.optimizer_step_peak_bytes = 9e6;             // allocated: under the floor
    result.optimizer_step_peak_reserved_bytes = 11.5e6;  // within 10 MB + 1 MB + 1 MB: nothing to do
    CHECK(engine.learn_from_step(result, 1, log) == 0);
    CHECK(batcher.model().floor_bytes() == 10e6);
    result.optimizer_step_peak_reserved_bytes = 14.2e6;  // above: the floor whose correction reaches it
    CHECK(engine.learn_from_step(result, 2, log) == 1);
    CHECK(batcher.model().floor_bytes() == doctest::Approx((14.2e6 - 1e6) / 1.1));
    REQUIRE(!lines.empty());
    CHECK(lines.back().find("xpm: optimizer step at step 2 reserved 14200000 bytes, above the floor and its correction "
                            "(12000000); floor raised to 12000000") == 0);
  }
  meter.set_capacity_bytes(cap_before);
  meter.set_caching(std::nullopt);
}

namespace {

// A step of the engine's: microbatches of 2 to 13 records of 40 to 240 tokens (one rank, in
// order: first, middle..., last), their peaks those of a model with other coefficients than the
// batcher's (6 bytes per bs*l^2, 1,200 per bs*l and 1.05 MB against 4, 2,000 and 1 MB): no line in
// the prediction covers them without over-predicting most.
xpm::GlobalStepResult shape_missed_step(std::int64_t step, const xpm::MemoryModel& model) {
  xpm::GlobalStepResult result;
  for (int k = 0; k < 5; ++k) {
    const double records = 2 + (3 * k + step) % 12, length = 40 + (37 * k + 11 * step) % 200;
    xpm::MicrobatchPeak peak;
    peak.dims = {records, length};
    peak.predicted_bytes = model.predict_bytes(peak.dims);
    peak.forward_backward_peak_bytes = 6 * records * length * length + 1200 * records * length + 1.05e6;
    result.microbatch_peaks.push_back(peak);
    result.microbatch_peak_ranks.push_back(0);
  }
  result.optimizer_step_peak_bytes = 5e5;  // under the floor
  return result;
}

}  // namespace

TEST_CASE("the Learner's engine refits a model that errs by shape, and a restored engine goes on alike") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();  // allocated bytes: no caching
  const std::int64_t cap_before = meter.capacity_bytes();
  meter.set_capacity_bytes(kReservedCap);
  torch::nn::Linear layer(4, 4);
  torch::optim::SGD optimizer(layer->parameters(), torch::optim::SGDOptions(0.1));
  const xpm::MemoryPlanOptions plan = wide_memory_plan();
  const xpm::MemoryModel probed(xpm::CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
                                {4.0, 2000.0, 1e6}, 6e5, "bs");
  const auto run = [&](xpm::PredictiveBatcher& batcher, xpm::PredictiveStepEngine& engine, std::int64_t from,
                       std::int64_t to, std::vector<std::string>& lines) {
    xpm::EngineLog log;
    log.line = [&lines](const std::string& line) { lines.push_back(line); };
    for (std::int64_t step = from; step < to; ++step) {
      engine.begin_step(log);
      CHECK(engine.learn_from_step(shape_missed_step(step, batcher.model()), step, log) >= 0);
    }
  };
  xpm::DistributedContext dist;
  xpm::PredictiveBatcher whole(plan.batcher_options(meter), xpm::make_packer(plan.packer, plan.sort_by));
  whole.set_model(probed);
  xpm::PredictiveStepEngine engine(optimizer, whole, &meter, dist, nullptr);
  REQUIRE_FALSE(engine.plans_reserved_bytes());
  std::vector<std::string> lines;
  run(whole, engine, 0, 10, lines);
  const auto refitted = std::find_if(lines.begin(), lines.end(), [](const std::string& line) {
    return line.find("memory model refitted on") != std::string::npos;
  });
  REQUIRE(refitted != lines.end());
  INFO(*refitted);
  CHECK(refitted->find("xpm: calibration: step 3: memory model refitted on 12 training peaks") == 0);
  const std::vector<double>& coefficients = whole.model().coefficients();
  CHECK(coefficients[0] == doctest::Approx(6.0).epsilon(1e-6));
  CHECK(coefficients[1] == doctest::Approx(1200.0).epsilon(1e-6));
  CHECK(whole.model().floor_bytes() == 6e5);
  // Its plans after it: the next step's microbatches predicted exactly, the correction a headroom.
  const xpm::GlobalStepResult next = shape_missed_step(10, whole.model());
  for (const xpm::MicrobatchPeak& peak : next.microbatch_peaks)
    CHECK(peak.predicted_bytes == doctest::Approx(peak.forward_backward_peak_bytes).epsilon(1e-9));
  // Stopped after step 5 and restored from its memory state: the same model and correction at step 10.
  xpm::PredictiveBatcher first(plan.batcher_options(meter), xpm::make_packer(plan.packer, plan.sort_by));
  first.set_model(probed);
  xpm::PredictiveStepEngine stopped(optimizer, first, &meter, dist, nullptr);
  std::vector<std::string> before, after;
  run(first, stopped, 0, 5, before);
  const nlohmann::json saved_model = first.model().to_json();
  const nlohmann::json saved_calibration = nlohmann::json::parse(stopped.memory_state().calibration.dump());
  xpm::PredictiveBatcher resumed(plan.batcher_options(meter), xpm::make_packer(plan.packer, plan.sort_by));
  xpm::PredictiveStepEngine restored(optimizer, resumed, &meter, dist, nullptr);
  CHECK(restored.restore_memory_state({saved_model, saved_calibration}, true));
  run(resumed, restored, 5, 10, after);
  CHECK(resumed.model().to_json() == whole.model().to_json());
  CHECK(resumed.correction() == whole.correction());
  meter.set_capacity_bytes(cap_before);
}
