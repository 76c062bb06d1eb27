// Genre ranking on the Brown corpus (genre_ranking.hpp).
#include "xpm/tasks/genre_ranking.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <stdexcept>

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
  torch::optim::Adam optimizer(ranker->parameters(),
                               torch::optim::AdamOptions(options.learning_rate));
  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<std::size_t> pick_sentence(0, data.train_token_ids.size() - 1);
  const auto genre_count = static_cast<std::int64_t>(data.genres.size());
  std::uniform_int_distribution<std::int64_t> pick_other(0, genre_count - 2);

  GenreRankingTrainResult result;
  const std::int64_t tail_steps = std::max<std::int64_t>(1, options.steps / 10);
  double tail_accuracy = 0;
  const auto batch = static_cast<std::size_t>(options.pairs_per_step);
  for (std::int64_t step = 0; step < options.steps; ++step) {
    std::vector<std::size_t> indices(batch);
    std::vector<std::int64_t> positive_ids(batch);
    std::vector<std::int64_t> negative_ids(batch);
    for (std::size_t i = 0; i < batch; ++i) {
      indices[i] = pick_sentence(rng);
      positive_ids[i] = data.train_genre_ids[indices[i]];
      const std::int64_t other = pick_other(rng);  // uniform over the genre_count - 1 others
      negative_ids[i] = other >= positive_ids[i] ? other + 1 : other;
    }
    const SentenceBag bag = make_sentence_bag(data.train_token_ids, indices);
    const torch::Tensor all_scores = ranker->forward(bag.token_ids, bag.offsets);  // [B, genres]
    const torch::Tensor pair_ids =
        torch::stack({torch::tensor(positive_ids, torch::kLong),
                      torch::tensor(negative_ids, torch::kLong)},
                     1);                                      // [B, 2]
    const torch::Tensor scores = all_scores.gather(1, pair_ids);  // [B, 2]: positive, negative
    optimizer.zero_grad();
    const torch::Tensor loss_mean = loss.sum(scores) / static_cast<double>(batch);
    loss_mean.backward();
    optimizer.step();

    const double value = loss_mean.item<double>();
    if (step == 0) result.first_loss = value;
    result.last_loss = value;
    if (step >= options.steps - tail_steps) tail_accuracy += pairwise::pairwise_accuracy(scores);
  }
  result.mean_train_accuracy_last_10_percent = tail_accuracy / static_cast<double>(tail_steps);
  result.duration_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace xpm
