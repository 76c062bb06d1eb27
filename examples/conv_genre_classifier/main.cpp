// A character-level 1-D convolution network that tells the genre of a Brown sentence (15
// genres), trained by xpm's Learner: probing, microbatches under a memory cap, validation with
// best model, checkpoints, exact resume, data parallel; run_learner_main gives the flags.
//
//   conv-genre-classifier --data-dir data/brown --run-dir runs/conv [--steps 60] [--nproc 2]
//                         [--stop-after-steps N] [--resume] [--memory-cap-bytes 24000000] [--device cuda]

#include <torch/torch.h>

#include "brown_sentences.hpp"
#include "xpm/trainer/loop/learner_main.hpp"

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

// Character ids [n, l] (padding 0, l the longest sentence) and genre labels [n] of set[ids].
std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<brown::Sentence>& set, const std::vector<std::size_t>& ids) {
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

// ---- The task the Learner drives: records {bs, l}, a microbatch's summed loss, validation sums, probes.
class GenreTask : public xpm::TrainingTask {
 public:
  GenreTask(brown::Corpus corpus, torch::Device device) : corpus_(std::move(corpus)), device_(device) { model_->to(device); }
  torch::nn::Module& module() override { return *model_; }
  std::size_t train_record_count() const override { return corpus_.train.size(); }
  xpm::TrainingRecord train_record(std::size_t i) const override { return record(corpus_.train[i]); }
  torch::Tensor loss_sum(const std::vector<std::size_t>& ids) override {
    const auto [chars, labels] = batch(corpus_.train, ids);
    return summed_cross_entropy(model_->forward(chars.to(device_)), labels.to(device_));
  }
  std::size_t validation_record_count() const override { return corpus_.held_out.size(); }
  xpm::TrainingRecord validation_record(std::size_t i) const override { return record(corpus_.held_out[i]); }
  xpm::NamedMetrics validation_sums(const std::vector<std::size_t>& ids) override {
    const auto [chars, labels] = batch(corpus_.held_out, ids);
    const torch::Tensor logits = model_->forward(chars.to(device_)), on_device = labels.to(device_);
    return {{"accuracy", logits.argmax(1).eq(on_device).sum().item<double>()},
            {"loss", summed_cross_entropy(logits, on_device).item<double>()}};
  }
  torch::Tensor probe_loss_sum(const std::vector<double>& dims) override {
    const auto bs = std::int64_t(dims[0]);
    const auto on = torch::TensorOptions().device(device_).dtype(torch::kLong);
    return summed_cross_entropy(model_->forward(torch::randint(1, kVocab, {bs, std::int64_t(dims[1])}, on)),
                                torch::randint(0, kGenres, {bs}, on));
  }

 private:
  static xpm::TrainingRecord record(const brown::Sentence& s) {  // the loss is summed over sentences
    return {{1.0, double(s.text.size())}, 1.0, double(s.text.size())};
  }
  brown::Corpus corpus_;
  torch::Device device_;
  std::shared_ptr<ConvClassifier> model_ = std::make_shared<ConvClassifier>();
};

}  // namespace

int main(int argc, char** argv) {
  xpm::LearnerProgram program;
  program.name = "conv-genre-classifier";
  program.extra_flags = {{"data-dir", "data/brown"}};
  program.default_memory_cap_bytes = 24'000'000;
  program.make_job = [](const xpm::LearnerRun& run) {
    auto corpus = brown::read_sentences(run.flag("data-dir"), 256, 5, 1024);  // 1024 held-out sentences
    auto task = std::make_unique<GenreTask>(std::move(corpus), run.device);
    auto optimizer = std::make_unique<torch::optim::Adam>(task->module().parameters(), torch::optim::AdamOptions(2e-3));
    auto options = xpm::LearnerOptions().set_run_dir("runs/conv-genre").set_max_steps(60).set_epochs(100)
                       .set_outer_batch_size(64).set_learning_rate(2e-3, 5).set_validation_every(20, "accuracy")
                       .set_checkpoint_every(20).set_log_prefix("conv-genre");
    options.memory_plan = xpm::MemoryPlanOptions(xpm::CostFormula::with_variables("a*bs*l + b*bs + c", {"bs", "l"}))
                              .set_variable_max({{"bs", 64}, {"l", 256}})
                              .set_design_fractions({1.0, 0.5, 0.25})  // most sentences are short
                              .set_usable_max_rel_error(0.15);  // a lone sentence peaks 16 % above the trend
    return xpm::LearnerJob{std::move(task), std::move(optimizer), options};
  };
  return xpm::run_learner_main(argc, argv, program);
}
