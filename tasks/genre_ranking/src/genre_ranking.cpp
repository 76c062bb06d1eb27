// Genre ranking on the Brown corpus (genre_ranking.hpp).
#include "xpm/tasks/genre_ranking.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "xpm/trainer/loop/learner.hpp"
#include "xpm/trainer/steps/fixed_step_engines.hpp"

namespace xpm {

GenreRankingData build_genre_ranking_data(const BrownCorpus& corpus, int heldout_every,
                                          std::size_t vocab_size, std::size_t min_count) {
  if (heldout_every < 2) {
    throw std::invalid_argument("build_genre_ranking_data: heldout_every must be >= 2, got " +
                                std::to_string(heldout_every));
  }
  GenreRankingData data;
  std::map<std::string, std::int64_t> genre_ids;
  std::vector<TaggedSentence> train_sentences;
  std::vector<const TaggedSentence*> heldout_sentences;
  for (std::size_t i = 0; i < corpus.files.size(); ++i) {
    const BrownFile& file = corpus.files[i];
    auto [at, inserted] = genre_ids.emplace(file.genre, static_cast<std::int64_t>(data.genres.size()));
    if (inserted) data.genres.push_back(file.genre);
    const std::int64_t genre = at->second;
    const bool heldout = static_cast<int>(i % static_cast<std::size_t>(heldout_every)) ==
                         heldout_every - 1;
    (heldout ? data.heldout_files : data.train_files) += 1;
    for (const TaggedSentence& sentence : file.sentences) {
      if (sentence.words.empty()) continue;
      if (heldout) {
        heldout_sentences.push_back(&sentence);
        data.heldout_genre_ids.push_back(genre);
      } else {
        train_sentences.push_back(sentence);
        data.train_genre_ids.push_back(genre);
      }
    }
  }
  if (data.genres.size() < 2) {
    throw std::invalid_argument("build_genre_ranking_data: the corpus has " +
                                std::to_string(data.genres.size()) +
                                " genre(s); ranking needs at least 2");
  }
  data.vocab = Vocabulary::build(train_sentences, vocab_size, min_count);
  const auto to_ids = [&](const TaggedSentence& sentence) {
    std::vector<std::int64_t> ids;
    ids.reserve(sentence.words.size());
    for (const std::string& word : sentence.words) ids.push_back(data.vocab.id(word));
    return ids;
  };
  for (const TaggedSentence& sentence : train_sentences) {
    data.train_token_ids.push_back(to_ids(sentence));
  }
  for (const TaggedSentence* sentence : heldout_sentences) {
    data.heldout_token_ids.push_back(to_ids(*sentence));
  }
  return data;
}

GenreRankerImpl::GenreRankerImpl(std::int64_t vocab_size, std::int64_t genre_count,
                                 GenreRankerOptions options)
    : options_(options) {
  if (vocab_size < 1 || genre_count < 2 || options.embedding_dim < 1) {
    throw std::invalid_argument(
        "GenreRanker: needs vocab_size >= 1, genre_count >= 2 and embedding_dim >= 1, got " +
        std::to_string(vocab_size) + ", " + std::to_string(genre_count) + " and " +
        std::to_string(options.embedding_dim));
  }
  words_ = register_module(
      "words", torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(vocab_size,
                                                                      options.embedding_dim)
                                           .mode(torch::kMean)));
  genres_ = register_module("genres",
                            torch::nn::Embedding(genre_count, options.embedding_dim));
  // N(0, 1) word and genre embeddings would give scores of size sqrt(d) before training;
  // a small scale starts every genre near a tie.
  torch::NoGradGuard no_grad;
  words_->weight.normal_(0, 0.1);
  genres_->weight.normal_(0, 0.1);
}

torch::Tensor GenreRankerImpl::forward(const torch::Tensor& token_ids,
                                       const torch::Tensor& offsets) {
  const torch::Tensor sentences = words_->forward(token_ids, offsets);  // [sentences, d]
  const torch::Tensor logits = sentences.matmul(genres_->weight.t());   // [sentences, genres]
  switch (options_.output_type) {
    case ScorerOutputType::real:
      return logits;
    case ScorerOutputType::log_probability:
      return torch::log_softmax(logits, 1);
    case ScorerOutputType::probability:
      return torch::softmax(logits, 1);
  }
  throw std::logic_error("unknown ScorerOutputType");
}

SentenceBag make_sentence_bag(const std::vector<std::vector<std::int64_t>>& sentences,
                              const std::vector<std::size_t>& indices) {
  std::vector<std::int64_t> token_ids;
  std::vector<std::int64_t> offsets;
  offsets.reserve(indices.size());
  for (std::size_t index : indices) {
    offsets.push_back(static_cast<std::int64_t>(token_ids.size()));
    const std::vector<std::int64_t>& sentence = sentences.at(index);
    token_ids.insert(token_ids.end(), sentence.begin(), sentence.end());
  }
  return {torch::tensor(token_ids, torch::kLong), torch::tensor(offsets, torch::kLong)};
}

double heldout_pairwise_accuracy(GenreRanker& ranker, const GenreRankingData& data) {
  const std::size_t count = data.heldout_token_ids.size();
  if (count == 0) throw std::invalid_argument("heldout_pairwise_accuracy: no held-out sentence");
  const bool was_training = ranker->is_training();
  ranker->eval();
  torch::NoGradGuard no_grad;
  double credit = 0;
  double pairs = 0;
  constexpr std::size_t kChunk = 1024;
  for (std::size_t begin = 0; begin < count; begin += kChunk) {
    std::vector<std::size_t> indices;
    for (std::size_t i = begin; i < std::min(count, begin + kChunk); ++i) indices.push_back(i);
    const SentenceBag bag = make_sentence_bag(data.heldout_token_ids, indices);
    const torch::Tensor scores = ranker->forward(bag.token_ids, bag.offsets).to(torch::kDouble);
    const torch::Tensor truth = torch::tensor(
        std::vector<std::int64_t>(data.heldout_genre_ids.begin() + static_cast<std::ptrdiff_t>(begin),
                                  data.heldout_genre_ids.begin() +
                                      static_cast<std::ptrdiff_t>(begin + indices.size())),
        torch::kLong);
    const torch::Tensor positive = scores.gather(1, truth.unsqueeze(1));  // [B, 1]
    // Every genre against the true one; the true genre ties with itself (1/2), taken off below.
    const torch::Tensor per_genre = (positive > scores).to(torch::kDouble) +
                                    0.5 * (positive == scores).to(torch::kDouble);
    credit += per_genre.sum().item<double>() - 0.5 * static_cast<double>(indices.size());
    pairs += static_cast<double>(indices.size()) * static_cast<double>(scores.size(1) - 1);
  }
  ranker->train(was_training);
  return credit / pairs;
}

double genre_prior_pairwise_accuracy(const GenreRankingData& data) {
  if (data.heldout_genre_ids.empty()) {
    throw std::invalid_argument("genre_prior_pairwise_accuracy: no held-out sentence");
  }
  std::vector<double> train_count(data.genres.size(), 0);
  for (std::int64_t genre : data.train_genre_ids) train_count[static_cast<std::size_t>(genre)] += 1;
  double credit = 0;
  double pairs = 0;
  for (std::int64_t truth : data.heldout_genre_ids) {
    const double positive = train_count[static_cast<std::size_t>(truth)];
    for (std::size_t g = 0; g < data.genres.size(); ++g) {
      if (static_cast<std::int64_t>(g) == truth) continue;
      credit += positive > train_count[g] ? 1.0 : positive == train_count[g] ? 0.5 : 0.0;
      pairs += 1;
    }
  }
  return credit / pairs;
}

GenreRankingTask::GenreRankingTask(GenreRanker& ranker, const GenreRankingData& data,
                                   const pairwise::PairwiseLoss& loss, std::uint64_t seed)
    : ranker_(ranker), data_(data), loss_(loss), negatives_(seed) {}

TrainingRecord GenreRankingTask::train_record(std::size_t index) const {
  const auto words = static_cast<double>(data_.train_token_ids.at(index).size());
  return {{1.0, words}, 1.0, words};
}

torch::Tensor GenreRankingTask::loss_sum(const std::vector<std::size_t>& records) {
  const auto genre_count = static_cast<std::int64_t>(data_.genres.size());
  std::uniform_int_distribution<std::int64_t> pick_other(0, genre_count - 2);
  std::vector<std::int64_t> positive_ids, negative_ids;
  for (std::size_t record : records) {
    positive_ids.push_back(data_.train_genre_ids.at(record));
    const std::int64_t other = pick_other(negatives_);  // uniform over the genre_count - 1 others
    negative_ids.push_back(other >= positive_ids.back() ? other + 1 : other);
  }
  const SentenceBag bag = make_sentence_bag(data_.train_token_ids, records);
  const torch::Tensor all_scores = ranker_->forward(bag.token_ids, bag.offsets);  // [B, genres]
  const torch::Tensor pair_ids = torch::stack(
      {torch::tensor(positive_ids, torch::kLong), torch::tensor(negative_ids, torch::kLong)}, 1);  // [B, 2]
  const torch::Tensor scores = all_scores.gather(1, pair_ids);  // [B, 2]: positive, negative
  const auto pairs = static_cast<double>(records.size());
  correct_pairs_ += pairwise::pairwise_accuracy(scores.detach()) * pairs;
  pairs_ += pairs;
  return loss_.sum(scores);
}

NamedMetrics GenreRankingTask::validate(const ValidationPlanFn& /*plan_of*/) {
  return {{"pairwise_accuracy", heldout_pairwise_accuracy(ranker_, data_)}};
}

torch::Tensor GenreRankingTask::probe_loss_sum(const std::vector<double>& dims) {
  const auto bs = static_cast<std::int64_t>(dims.at(0));
  const auto words = static_cast<std::int64_t>(dims.at(1));
  const torch::Tensor token_ids =
      torch::randint(0, static_cast<std::int64_t>(data_.vocab.size()), {bs * words}, torch::kLong);
  const torch::Tensor offsets = torch::arange(0, bs * words, words, torch::kLong);
  const torch::Tensor scores = ranker_->forward(token_ids, offsets).narrow(1, 0, 2);
  return loss_.sum(scores);
}

nlohmann::json GenreRankingTask::extra_state() const {
  std::ostringstream text;
  text << negatives_;
  return {{"negatives", text.str()}};
}

void GenreRankingTask::restore_extra_state(const nlohmann::json& state) {
  std::istringstream text(state.at("negatives").get<std::string>());
  text >> negatives_;
  if (!text) throw std::runtime_error("GenreRankingTask: unreadable generator state in the checkpoint");
}

double GenreRankingTask::take_train_accuracy() {
  const double accuracy = pairs_ > 0 ? correct_pairs_ / pairs_ : 0.0;
  correct_pairs_ = pairs_ = 0;
  return accuracy;
}

namespace {

// Records each step's mean loss per pair and the pairwise accuracy of its pairs.
class GenreRankingRecorder : public StepTrainingHook {
 public:
  explicit GenreRankingRecorder(GenreRankingTask& task) : task_(task) {}
  std::string name() const override { return "genre-ranking-recorder"; }
  void before_step(TrainerContext& /*context*/) override { task_.take_train_accuracy(); }
  void after_step(TrainerContext& context) override {
    losses.push_back(context.metrics().at("train/loss"));
    accuracies.push_back(task_.take_train_accuracy());
  }
  std::vector<double> losses, accuracies;

 private:
  GenreRankingTask& task_;
};

}  // namespace

GenreRankingTrainResult train_genre_ranker(GenreRanker& ranker, const GenreRankingData& data,
                                           const pairwise::PairwiseLoss& loss,
                                           const GenreRankingTrainOptions& options) {
  if (options.steps < 1 || options.pairs_per_step < 1 || !(options.learning_rate > 0)) {
    throw std::invalid_argument(
        "train_genre_ranker: steps and pairs_per_step must be >= 1 and learning_rate > 0, got " +
        std::to_string(options.steps) + ", " + std::to_string(options.pairs_per_step) + " and " +
        std::to_string(options.learning_rate));
  }
  if (loss.output_type() != ranker->output_type()) {
    throw std::invalid_argument("train_genre_ranker: the loss expects " +
                                to_string(loss.output_type()) + " scores but the ranker outputs " +
                                to_string(ranker->output_type()));
  }
  if (data.train_token_ids.empty()) {
    throw std::invalid_argument("train_genre_ranker: no train sentence");
  }
  const auto start = std::chrono::steady_clock::now();
  ranker->train();
  torch::optim::Adam optimizer(ranker->parameters(), torch::optim::AdamOptions(options.learning_rate));
  GenreRankingTask task(ranker, data, loss, options.seed);
  HookList hooks;
  auto recorder = std::make_shared<GenreRankingRecorder>(task);
  hooks.add(recorder);
  LearnerOptions learner;
  learner.run_dir = options.run_dir;
  learner.max_steps = options.steps;
  const auto steps_per_epoch = static_cast<std::int64_t>(data.train_token_ids.size()) / options.pairs_per_step + 1;
  learner.epochs = options.steps / steps_per_epoch + 1;  // the step budget ends the run
  learner.outer_batch_size = options.pairs_per_step;
  learner.sampler_seed = options.seed;
  learner.lr_schedule.kind = LrScheduleKind::kConstant;
  learner.lr_schedule.peak_learning_rate = options.learning_rate;
  learner.validation.metric = "pairwise_accuracy";
  learner.validation.mode = MetricMode::kMax;
  learner.log = [](const std::string&) {};
  LearnerComponents parts;
  parts.engine = std::make_shared<FixedStepEngine>(optimizer, nullptr, options.pairs_per_step);  // 1 microbatch a step
  parts.hooks = &hooks;
  Learner(task, optimizer, learner, parts).run();

  GenreRankingTrainResult result;
  result.first_loss = recorder->losses.front();
  result.last_loss = recorder->losses.back();
  const std::size_t tail = std::max<std::size_t>(1, recorder->accuracies.size() / 10);
  double tail_accuracy = 0;
  for (std::size_t i = recorder->accuracies.size() - tail; i < recorder->accuracies.size(); ++i) {
    tail_accuracy += recorder->accuracies[i];
  }
  result.mean_train_accuracy_last_10_percent = tail_accuracy / static_cast<double>(tail);
  result.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace xpm
