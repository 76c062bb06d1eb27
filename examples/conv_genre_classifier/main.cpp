// A character-level 1-D convolution network that tells the genre of a Brown sentence (15
// genres, the letter after 'c' in the file name), trained by xpm's Learner: probing, microbatches
// under a CPU memory cap, validation with best model, checkpoints, exact resume, data parallel.
//
//   conv-genre-classifier --data-dir data/brown --run-dir runs/conv [--steps 60] [--nproc 2]
//                         [--stop-after-steps N] [--resume] [--memory-cap-bytes 24000000]
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/trainer/distributed/local_launcher.hpp"
#include "xpm/trainer/loop/learner.hpp"

namespace {

// ---- The model: characters -> embedding 32 -> two convolutions (64 channels, width 5) -> max
// over positions -> genre logits. Its memory grows with bs x l (no l^2 term).
constexpr std::int64_t kVocab = 128, kGenres = 15;

struct ConvClassifier : torch::nn::Module {
  torch::nn::Embedding embedding{register_module("embedding", torch::nn::Embedding(kVocab, 32))};
  torch::nn::Conv1d conv1{register_module("conv1", torch::nn::Conv1d(torch::nn::Conv1dOptions(32, 64, 5).padding(2)))};
  torch::nn::Conv1d conv2{register_module("conv2", torch::nn::Conv1d(torch::nn::Conv1dOptions(64, 64, 5).padding(2)))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(64, kGenres))};
  torch::Tensor forward(const torch::Tensor& chars) {  // [bs, l] -> [bs, kGenres]
    torch::Tensor x = embedding(chars).transpose(1, 2);
    x = torch::relu(conv2(torch::relu(conv1(x))));
    return head(std::get<0>(x.max(2)));
  }
};

// ---- The data: Brown sentences as text (words of "word/tag" tokens, at most 256 characters),
// labelled with their file's genre; every 10th file held out.
struct Sentence {
  std::string text;
  std::int64_t genre = 0;
};

void read_brown(const std::string& dir, std::vector<Sentence>& train, std::vector<Sentence>& held_out) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (std::regex_match(entry.path().filename().string(), std::regex("c[a-r][0-9][0-9]"))) files.push_back(entry);
  }
  if (files.empty()) throw std::invalid_argument("--data-dir '" + dir + "' holds no Brown files (ca01, ...)");
  std::sort(files.begin(), files.end());
  const std::string genres = "abcdefghjklmnpr";
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::ifstream in(files[i]);
    const auto genre = static_cast<std::int64_t>(genres.find(files[i].filename().string()[1]));
    for (std::string line, token; std::getline(in, line);) {
      std::istringstream tokens(line);
      std::string text;
      while (tokens >> token) text += (text.empty() ? "" : " ") + token.substr(0, token.rfind('/'));
      if (text.size() >= 5) (i % 10 == 9 ? held_out : train).push_back({text.substr(0, 256), genre});
    }
  }
}

// Character ids [n, l] (padding 0, l the longest sentence) and genre labels [n] of set[ids].
std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<Sentence>& set, const std::vector<std::size_t>& ids) {
  std::size_t l = 0;
  for (std::size_t i : ids) l = std::max(l, set[i].text.size());
  torch::Tensor chars = torch::zeros({std::int64_t(ids.size()), std::int64_t(l)}, torch::kLong);
  torch::Tensor labels = torch::empty({std::int64_t(ids.size())}, torch::kLong);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const std::string& text = set[ids[k]].text;
    for (std::size_t j = 0; j < text.size(); ++j) chars[std::int64_t(k)][std::int64_t(j)] = int(text[j]) & 127;
    labels[std::int64_t(k)] = set[ids[k]].genre;
  }
  return {chars, labels};
}

torch::Tensor summed_cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits, labels,
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// ---- The task the Learner drives: records, a microbatch's summed loss, validation, probes.
class GenreTask : public xpm::TrainingTask {
 public:
  GenreTask(std::vector<Sentence> train, std::vector<Sentence> held_out, xpm::DistributedContext& dist)
      : train_(std::move(train)), held_out_(std::move(held_out)), dist_(dist) {}
  torch::nn::Module& module() override { return *model_; }
  std::size_t train_record_count() const override { return train_.size(); }
  xpm::TrainingRecord train_record(std::size_t i) const override {
    const auto l = static_cast<double>(train_[i].text.size());
    return {{1.0, l}, 1.0, l};  // dims {bs, l}; the loss is summed over sentences; size: characters
  }
  torch::Tensor loss_sum(const std::vector<std::size_t>& records) override {
    const auto [chars, labels] = batch(train_, records);
    return summed_cross_entropy(model_->forward(chars), labels);
  }
  xpm::NamedMetrics validate(const xpm::ValidationPlanFn& plan_of) override {
    torch::NoGradGuard no_grad;
    model_->eval();
    std::vector<std::size_t> mine;  // this rank's share of the held-out sentences
    std::vector<std::vector<double>> dims;
    for (std::size_t i = std::size_t(dist_.rank()); i < held_out_.size(); i += std::size_t(dist_.world_size())) {
      mine.push_back(i);
      dims.push_back({1.0, double(held_out_[i].text.size())});
    }
    double correct = 0, loss = 0;
    for (const xpm::Microbatch& mb : plan_of(dims).microbatches) {
      std::vector<std::size_t> ids;
      for (std::size_t j : mb.record_indices) ids.push_back(mine[j]);
      const auto [chars, labels] = batch(held_out_, ids);
      const torch::Tensor logits = model_->forward(chars);
      correct += logits.argmax(1).eq(labels).sum().item<double>();
      loss += summed_cross_entropy(logits, labels).item<double>();
    }
    model_->train();
    const std::vector<double> total = dist_.all_reduce({correct, loss}, xpm::ReduceOp::kSum);
    const auto n = double(held_out_.size());
    return {{"accuracy", total[0] / n}, {"loss", total[1] / n}, {"sentences", n}};
  }
  torch::Tensor probe_loss_sum(const std::vector<double>& dims) override {
    const auto bs = std::int64_t(dims[0]);
    return summed_cross_entropy(model_->forward(torch::randint(1, kVocab, {bs, std::int64_t(dims[1])})),
                                torch::randint(0, kGenres, {bs}));
  }

 private:
  std::vector<Sentence> train_, held_out_;
  xpm::DistributedContext& dist_;
  std::shared_ptr<ConvClassifier> model_ = std::make_shared<ConvClassifier>();
};

std::string option(const std::vector<std::string>& args, const std::string& name, const std::string& fallback) {
  const auto it = std::find(args.begin(), args.end(), "--" + name);
  return it == args.end() || it + 1 == args.end() ? fallback : *(it + 1);
}

}  // namespace

int main(int argc, char** argv) try {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const std::string known = " --data-dir --run-dir --steps --nproc --stop-after-steps --resume --memory-cap-bytes --threads ";
  for (const std::string& arg : args) {
    if (arg.rfind("--", 0) == 0 && known.find(" " + arg + " ") == std::string::npos) throw std::invalid_argument("unknown option " + arg);
  }
  const int nproc = std::stoi(option(args, "nproc", "1"));
  const auto worker = xpm::WorkerEnvironment::from_environment();
  if (nproc > 1 && !worker) return xpm::launch_local_workers(args, {nproc, 0, 60});
  xpm::DistributedContext dist = worker ? xpm::DistributedContext(*worker, {}) : xpm::DistributedContext();
  torch::set_num_threads(std::stoi(option(args, "threads", "1")));
  torch::manual_seed(1);
  std::vector<Sentence> train, held_out;
  read_brown(option(args, "data-dir", "data/brown"), train, held_out);
  std::vector<Sentence> sample;  // 1024 held-out sentences spread over every held-out file
  for (std::size_t i = 0; i < held_out.size(); i += std::max<std::size_t>(1, held_out.size() / 1024)) sample.push_back(held_out[i]);
  held_out.swap(sample);

  // The meter before the model (it must see the weights), then the cap to plan under.
  const std::int64_t cap_bytes = std::stoll(option(args, "memory-cap-bytes", "24000000"));
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  GenreTask task(std::move(train), std::move(held_out), dist);
  torch::optim::Adam optimizer(task.module().parameters(), torch::optim::AdamOptions(2e-3));
  meter.set_capacity_bytes(cap_bytes);

  xpm::PredictiveBatcherOptions plan;  // the memory model: probed and fitted by the Learner
  plan.formula = xpm::CostFormula::with_variables("a*bs*l + b*bs + c", {"bs", "l"});
  plan.variable_max = {{"bs", 64}, {"l", 256}};
  plan.design_fractions = {1.0, 0.5, 0.25};  // most sentences are short: probe short l too
  plan.budget = xpm::meter_budget(meter);  // the capacity given once, to the meter
  plan.fit.usable_max_rel_error = 0.15;  // a lone sentence peaks 16 % above the trend (LibTorch's batch-1 Conv1d path)
  xpm::PredictiveBatcher batcher(plan, std::make_shared<xpm::AdaptivePacker>());

  xpm::LearnerOptions options;
  options.run_dir = option(args, "run-dir", "runs/conv-genre");
  options.max_steps = std::stoll(option(args, "steps", "60"));
  options.epochs = 100;  // the step budget ends the run
  options.outer_batch_size = 64;
  options.lr_schedule.peak_learning_rate = 2e-3;
  options.lr_schedule.warmup_steps = 5;
  options.validation.every_steps = 20;
  options.validation.metric = "accuracy";
  options.checkpoints.every_steps = 20;
  options.stop_after_steps = std::stoll(option(args, "stop-after-steps", "0"));
  options.resume = std::find(args.begin(), args.end(), "--resume") != args.end();
  options.log_prefix = "conv-genre";
  options.config = {{"steps", options.max_steps}, {"memory_cap_bytes", cap_bytes}};
  xpm::LearnerComponents parts;
  parts.dist = &dist;
  parts.batcher = &batcher;
  parts.meter = &meter;
  xpm::Learner learner(task, optimizer, options, parts);
  xpm::LearnerOutcome outcome = learner.run();

  if (dist.is_main()) {
    const xpm::RunCounters& c = outcome.counters;
    std::cout << "formula " << batcher.model().formula().canonical() << "; steps " << outcome.steps << ", microbatches "
              << c.microbatches << ", OOM " << c.ooms << ", max step prediction error "
              << 100 * c.max_prediction_rel_error << " %, underpredictions " << c.underpredictions
              << "; held-out accuracy " << outcome.last_validation["accuracy"] << (outcome.finished ? "" : " (stopped; resume with --resume)") << "\n";
  }
  return 0;
} catch (const std::exception& error) {
  std::cerr << "conv-genre-classifier: error: " << error.what() << "\n";
  return 2;
}
