// run_tagging_job as a Learner loop on the real corpus, a few steps each: hooks called at the
// documented points and counts, listeners' votes stopping the job, exact resume from a
// checkpoint (torch::equal on every parameter) and the fallback past a corrupt checkpoint.
#include "torch_doctest.hpp"
#include "scratch_folders.hpp"
#include "tools/xpm_train_runs.hpp"

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "xpm/trainer/loop/hooks.hpp"
#include "xpm/trainer/loop/learner_listener.hpp"
#include "xpm/tasks/tagging_job.hpp"
#include "xpm/tasks/tagging_task.hpp"
#include "xpm/trainer/options/weight_decay_groups.hpp"

namespace {

const std::string kData = std::string(XPM_SOURCE_DIR) + "/data/brown";
const std::string kScratch = std::string(XPM_BINARY_DIR) + "/test_scratch/tagging_job_test";

// A short job on the real corpus: 16 sentences per step under a 2 x static-memory cap. Its run
// folder is fresh, and removed when the test case passes.
xpm::TaggingJobConfig short_job(const std::string& name, std::int64_t max_steps) {
  xpm::TaggingJobConfig config;
  config.data_dir = kData;
  config.run_dir = kScratch + "/" + name;
  std::filesystem::remove_all(config.run_dir);
  xpm_test::remove_when_passed(config.run_dir);
  config.max_steps = max_steps;
  config.outer_batch_size = 16;
  config.threads = 1;
  config.memory_cap_factor = 2.0;
  config.max_validation_sentences = 60;
  config.memory_model_cache = kScratch + "/memory-models";  // the runs share one fit
  config.warmup_steps = 2;
  config.quiet = true;
  return config;
}

// Records every hook call with the step it saw.
class RecordingHook : public xpm::InitializationTrainingHook,
                      public xpm::StepTrainingHook,
                      public xpm::ValidationHook {
 public:
  std::string name() const override { return "recording"; }
  void before_initialization(xpm::TrainerContext& c) override { record("before_initialization", c); }
  void after_initialization(xpm::TrainerContext& c) override { record("after_initialization", c); }
  void before_step(xpm::TrainerContext& c) override { record("before_step", c); }
  void before_optimizer_step(xpm::TrainerContext& c) override {
    // Gradients of the whole outer batch are there, the optimizer has not stepped yet.
    bool any_gradient = false;
    for (const auto& p : c.state().model->parameters()) {
      any_gradient = any_gradient || (p.grad().defined() && p.grad().abs().sum().item<double>() > 0);
    }
    gradients_seen = gradients_seen && any_gradient;
    record("before_optimizer_step", c);
  }
  void after_step(xpm::TrainerContext& c) override { record("after_step", c); }
  void before_validation(xpm::TrainerContext& c) override { record("before_validation", c); }
  void after_validation(xpm::TrainerContext& c) override {
    accuracies.push_back(c.metrics().at("validation/token_accuracy"));
    losses.push_back(c.metrics().at("validation/loss"));
    record("after_validation", c);
  }

  std::vector<std::string> calls;
  std::vector<std::int64_t> steps;
  std::vector<bool> had_optimizer;
  std::vector<double> accuracies, losses;
  bool gradients_seen = true;

 private:
  void record(const std::string& what, const xpm::TrainerContext& c) {
    calls.push_back(what);
    steps.push_back(c.state().step);
    had_optimizer.push_back(c.state().optimizer != nullptr);
  }
};

class VoteAt : public xpm::LearnerListener {
 public:
  VoteAt(int validation, xpm::LearnerVote vote) : validation_(validation), vote_(vote) {}
  std::string name() const override { return "vote-at"; }
  xpm::LearnerVote on_validation(const xpm::TrainerContext&) override {
    return ++seen_ == validation_ ? vote_ : xpm::LearnerVote::kNoDecision;
  }

 private:
  int validation_;
  xpm::LearnerVote vote_;
  int seen_ = 0;
};

using xpm_train_runs::load_parameters;

// Same names and bitwise-equal tensors.
bool identical(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  if (a.size() != b.size() || a.empty()) return false;
  for (const auto& [name, tensor] : a) {
    const auto it = b.find(name);
    if (it == b.end() || !torch::equal(tensor, it->second)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("every hook is called at its documented point on each step and validation in order") {
  xpm::TaggingJobConfig config = short_job("hooks", 4);
  config.validate_every = 2;  // validations after step 2 and at the end (step 4)
  auto hook = std::make_shared<RecordingHook>();
  xpm::TaggingJobExtensions extensions;
  extensions.hooks.add(hook);
  xpm::DistributedContext single_process;
  const nlohmann::json summary = xpm::run_tagging_job(config, single_process, extensions);
  REQUIRE(summary.at("ooms") == 0);

  const std::vector<std::string> step = {"before_step", "before_optimizer_step", "after_step"};
  std::vector<std::string> expected = {"before_initialization", "after_initialization"};
  std::vector<std::int64_t> expected_steps = {0, 0};
  for (int s = 0; s < 4; ++s) {
    expected.insert(expected.end(), step.begin(), step.end());
    expected_steps.insert(expected_steps.end(), {s, s, s + 1});  // after_step counts the step
    if (s == 1 || s == 3) {
      expected.insert(expected.end(), {"before_validation", "after_validation"});
      expected_steps.insert(expected_steps.end(), {s + 1, s + 1});
    }
  }
  CHECK(hook->calls == expected);
  CHECK(hook->steps == expected_steps);
  // No optimizer during initialization (freezing acts before it exists), one afterwards.
  CHECK_FALSE(hook->had_optimizer[0]);
  CHECK_FALSE(hook->had_optimizer[1]);
  CHECK(hook->had_optimizer[2]);
  CHECK(hook->gradients_seen);
  // after_validation saw the validation metrics the summary reports.
  REQUIRE(hook->accuracies.size() == 2);
  CHECK(hook->accuracies.back() == doctest::Approx(summary.at("val_token_accuracy").get<double>()));
  CHECK(hook->losses.back() == doctest::Approx(summary.at("val_loss").get<double>()));
  CHECK(hook->losses.back() > 0);
  CHECK(summary.at("validations").size() == 2);
}

TEST_CASE("the config's freezer and clipper run in the job: frozen embedding unchanged and grad_norm logged") {
  xpm::TaggingJobConfig config = short_job("freeze-clip", 3);
  config.freeze = "^token_embedding\\.";
  config.clip_grad_norm = 0.5;
  const nlohmann::json summary = xpm::run_tagging_job(config);
  REQUIRE(summary.at("train_steps") == 3);
  // The initial parameters: the job seeds torch with config.seed before building the model.
  torch::manual_seed(config.seed);
  const xpm::TaggingData data = xpm::load_tagging_data(config);
  xpm::TaggingModel initial = xpm::make_tagging_model(config, data);
  const auto final_parameters = load_parameters(config.run_dir + "/final_parameters.pt");
  int frozen = 0, changed = 0;
  for (const auto& item : initial.module->named_parameters()) {
    const bool same = torch::equal(item.value(), final_parameters.at(item.key()));
    if (item.key().rfind("token_embedding.", 0) == 0) {
      CHECK(same);
      ++frozen;
    } else {
      changed += same ? 0 : 1;
    }
  }
  CHECK(frozen == 1);
  CHECK(changed > 0);
  std::ifstream metrics(config.run_dir + "/metrics.jsonl");
  std::string line;
  int steps_with_norm = 0;
  while (std::getline(metrics, line)) {
    const nlohmann::json entry = nlohmann::json::parse(line);
    if (entry.contains("validation")) continue;
    REQUIRE(entry.contains("grad_norm"));
    CHECK(entry.at("grad_norm").get<double>() > 0);
    ++steps_with_norm;
  }
  CHECK(steps_with_norm == 3);
}

TEST_CASE("a listener voting stop ends the job after that validation and early stopping is reported") {
  xpm::TaggingJobConfig config = short_job("listener-stop", 6);
  config.validate_every = 2;
  xpm::TaggingJobExtensions extensions;
  extensions.listeners.push_back(std::make_shared<VoteAt>(1, xpm::LearnerVote::kStop));
  xpm::DistributedContext single_process;
  const nlohmann::json summary = xpm::run_tagging_job(config, single_process, extensions);
  CHECK(summary.at("train_steps") == 2);
  CHECK(summary.at("early_stopped") == true);
  CHECK(summary.at("validations").size() == 1);  // no second validation at the same step
  CHECK(std::filesystem::exists(config.run_dir + "/best_parameters.pt"));
  CHECK(std::filesystem::exists(config.run_dir + "/final_parameters.pt"));
}

TEST_CASE("a job stopped after step 4 and resumed ends with bitwise the parameters of an uninterrupted one") {
  xpm::TaggingJobConfig uninterrupted = short_job("resume-a", 8);
  uninterrupted.validate_every = 3;
  uninterrupted.checkpoint_every_steps = 2;
  const nlohmann::json a = xpm::run_tagging_job(uninterrupted);

  xpm::TaggingJobConfig stopped = short_job("resume-b", 8);
  stopped.validate_every = 3;
  stopped.checkpoint_every_steps = 2;
  stopped.stop_after_steps = 5;  // not a checkpoint step: stopping writes one
  const nlohmann::json b1 = xpm::run_tagging_job(stopped);
  CHECK(b1.at("finished") == false);
  CHECK(b1.at("train_steps") == 5);
  CHECK_FALSE(std::filesystem::exists(stopped.run_dir + "/final_parameters.pt"));

  xpm::TaggingJobConfig resumed = stopped;
  resumed.stop_after_steps = 0;
  resumed.resume = true;
  const nlohmann::json b2 = xpm::run_tagging_job(resumed);
  CHECK(b2.at("resumed_from_step") == 5);
  CHECK(b2.at("memory_model_from_checkpoint") == true);
  CHECK(b2.at("probes") == 0);
  CHECK(b2.at("train_steps") == 8);
  CHECK(identical(load_parameters(uninterrupted.run_dir + "/final_parameters.pt"),
                  load_parameters(resumed.run_dir + "/final_parameters.pt")));
  // The running counters and the validations continue too.
  CHECK(b2.at("final_loss") == a.at("final_loss"));
  CHECK(b2.at("real_tokens") == a.at("real_tokens"));
  CHECK(b2.at("microbatches") == a.at("microbatches"));
  CHECK(b2.at("validations") == a.at("validations"));
  CHECK(b2.at("val_token_accuracy") == a.at("val_token_accuracy"));
  CHECK(b2.at("best_step") == a.at("best_step"));
}

TEST_CASE("resume skips a corrupt newest checkpoint with a warning and continues exactly from the previous one") {
  xpm::TaggingJobConfig uninterrupted = short_job("corrupt-a", 6);
  uninterrupted.checkpoint_every_steps = 2;
  xpm::run_tagging_job(uninterrupted);

  xpm::TaggingJobConfig stopped = short_job("corrupt-b", 6);
  stopped.checkpoint_every_steps = 2;
  stopped.stop_after_steps = 4;
  xpm::run_tagging_job(stopped);
  const std::string newest = stopped.run_dir + "/checkpoints/step-00000004";
  REQUIRE(std::filesystem::exists(newest + "/model.pt"));
  {
    std::fstream file(newest + "/model.pt", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(200);
    const char garbage[8] = {'\x13', '\x37', '\x42', '\x00', '\x7f', '\x01', '\x55', '\x2a'};
    file.write(garbage, sizeof garbage);
  }
  xpm::TaggingJobConfig resumed = stopped;
  resumed.stop_after_steps = 0;
  resumed.resume = true;
  std::ostringstream captured;
  std::streambuf* previous = std::cerr.rdbuf(captured.rdbuf());
  nlohmann::json summary;
  try {
    summary = xpm::run_tagging_job(resumed);
  } catch (...) {
    std::cerr.rdbuf(previous);
    throw;
  }
  std::cerr.rdbuf(previous);
  const std::string warnings = captured.str();
  CHECK(warnings.find("warning") != std::string::npos);
  CHECK(warnings.find("step-00000004") != std::string::npos);
  CHECK(summary.at("resumed_from_step") == 2);
  CHECK(identical(load_parameters(uninterrupted.run_dir + "/final_parameters.pt"),
                  load_parameters(resumed.run_dir + "/final_parameters.pt")));
}

TEST_CASE("resume refuses a checkpoint written with another schedule and names the setting") {
  xpm::TaggingJobConfig stopped = short_job("resume-mismatch", 6);
  stopped.checkpoint_every_steps = 2;
  stopped.stop_after_steps = 2;
  xpm::run_tagging_job(stopped);
  xpm::TaggingJobConfig other = stopped;
  other.stop_after_steps = 0;
  other.resume = true;
  other.learning_rate = 1e-3;
  CHECK_THROWS_WITH_AS(xpm::run_tagging_job(other), doctest::Contains("learning_rate"),
                       std::invalid_argument);
}

TEST_CASE("bf16-mixed precision with activation checkpointing and the ffd packer train in the job under their own memory model") {
  // The plain run fills the shared cache; the mixed-precision, checkpointed run must not reuse
  // its fit (precision and activation checkpointing are part of the memory model's identity).
  // A cache of its own, emptied first: the shared one keeps fits across test runs.
  const std::string cache = kScratch + "/memory-models-identity";
  std::filesystem::remove_all(cache);
  xpm::TaggingJobConfig plain_config = short_job("identity-plain", 2);
  plain_config.memory_model_cache = cache;
  const nlohmann::json plain = xpm::run_tagging_job(plain_config);
  REQUIRE(plain.at("train_steps") == 2);
  CHECK(plain.at("memory_model_from_cache") == false);
  xpm::TaggingJobConfig config = short_job("bf16-checkpointed-ffd", 2);
  config.memory_model_cache = cache;
  config.precision = xpm::Precision::kBf16Mixed;
  config.model.activation_checkpointing = true;
  config.packer = xpm::PackerKind::kFirstFitDecreasing;
  config.lr_schedule = xpm::LrScheduleKind::kCosine;
  const nlohmann::json summary = xpm::run_tagging_job(config);
  CHECK(summary.at("train_steps") == 2);
  CHECK(summary.at("memory_model_from_cache") == false);
  CHECK(summary.at("probes").get<std::int64_t>() > 0);
  CHECK(summary.at("ooms") == 0);
  std::ifstream config_file(config.run_dir + "/config.json");
  const nlohmann::json written = nlohmann::json::parse(config_file);
  CHECK(written.at("precision") == "bf16-mixed");
  CHECK(written.at("lr_schedule") == "cosine");
  CHECK(written.at("model").at("activation_checkpointing") == true);
  std::ifstream model_file(config.run_dir + "/memory_model.json");
  const nlohmann::json memory_model = nlohmann::json::parse(model_file);
  CHECK(memory_model.at("metadata").at("precision") == "bf16-mixed");
  CHECK(memory_model.at("metadata").at("activation_checkpointing") == true);
  // The same settings again: now the cache has their fit.
  const nlohmann::json again = xpm::run_tagging_job(config);
  CHECK(again.at("memory_model_from_cache") == true);
}

TEST_CASE("precision and activation checkpointing errors name the setting; enum names parse both ways") {
  const auto message_of = [](const xpm::TaggingJobConfig& config) {
    try {
      config.validate();
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("(no error)");
  };
  xpm::TaggingJobConfig config = short_job("bad-options", 1);
  config.precision = xpm::Precision::k16Mixed;
  CHECK(message_of(config).find("16-mixed") != std::string::npos);
  config.precision = xpm::Precision::k32True;
  CHECK_THROWS_WITH_AS(xpm::parse_precision("fp8", "--precision"), doctest::Contains("--precision"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::parse_packer_kind("best", "--packer"),
                       "--packer must be 'adaptive', 'uniform', 'ffd' or 'fastest', got 'best'", std::invalid_argument);
  CHECK(xpm::parse_packer_kind(xpm::to_string(xpm::PackerKind::kFirstFitDecreasing), "packer") ==
        xpm::PackerKind::kFirstFitDecreasing);
  CHECK(xpm::parse_batcher_kind("power", "batcher") == xpm::BatcherKind::kPower);
  CHECK(xpm::to_string(xpm::TaggingMetric::kTokenAccuracy) == "token_accuracy");
  CHECK(xpm::to_string(xpm::parse_optimizer_checkpoint_layout("full", "x")) == "full");
  CHECK_FALSE(xpm::parse_validation_mode("auto", "x").has_value());
  CHECK(xpm::to_string(xpm::parse_validation_mode("min", "x")) == "min");
  CHECK(xpm::parse_collective_backend("gloo", "x") == xpm::CollectiveBackend::kGloo);
  CHECK_THROWS_WITH_AS(xpm::parse_collective_backend("mpi", "--backend"),
                       "--backend must be 'auto', 'gloo' or 'nccl', got 'mpi'", std::invalid_argument);
  config.architecture = xpm::TaggingArchitecture::kBilstm;
  config.model.activation_checkpointing = true;
  CHECK(message_of(config).find("activation_checkpointing") != std::string::npos);
}

TEST_CASE("weight_decay_groups gives the job's AdamW a second group without decay for biases and norms") {
  xpm::TaggingJobConfig config = short_job("decay-groups", 1);
  const xpm::TaggingData data = xpm::load_tagging_data(config);
  config.weight_decay_groups = true;
  xpm::TaggingModelSetup grouped(config, data, nullptr);
  auto& groups = grouped.optimizer().param_groups();
  REQUIRE(groups.size() == 2);
  const auto decay_of = [](torch::optim::OptimizerParamGroup& group) {
    return static_cast<torch::optim::AdamWOptions&>(group.options()).weight_decay();
  };
  CHECK(decay_of(groups[0]) == doctest::Approx(config.weight_decay));
  CHECK(decay_of(groups[1]) == 0.0);
  // Every trainable parameter is in exactly one group; the second holds the biases and norms.
  CHECK(groups[0].params().size() + groups[1].params().size() ==
        grouped.module().parameters().size());
  const xpm::WeightDecaySplit split = xpm::split_for_weight_decay(grouped.module());
  CHECK(groups[1].params().size() == split.no_decay_names.size());
  for (const std::string& name : split.no_decay_names) CHECK(xpm::excluded_from_weight_decay(name));
  config.weight_decay_groups = false;
  xpm::TaggingModelSetup plain(config, data, nullptr);
  CHECK(plain.optimizer().param_groups().size() == 1);
}
