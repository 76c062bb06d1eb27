// xpm/tasks/genre_ranking.hpp — a small ranking task on real data so that the pairwise
// losses (losses.hpp) train on something: for a Brown sentence, score its true genre (its
// file's category in cats.txt, 15 genres) above a wrong one.
//
//   BrownCorpus corpus = read_brown_corpus("data/brown");
//   GenreRankingData data = build_genre_ranking_data(corpus);   // every 10th file held out
//   GenreRanker ranker(data.vocab.size(), data.genres.size(), GenreRankerOptions{});
//   pairwise::CrossEntropyLoss loss(ScorerOutputType::real);
//   double before = heldout_pairwise_accuracy(ranker, data);    // about 0.5
//   GenreRankingTrainResult r = train_genre_ranker(ranker, data, loss, GenreRankingTrainOptions{});
//   double after = heldout_pairwise_accuracy(ranker, data);
//
// Model: a sentence is the mean of its words' embeddings e (EmbeddingBag, dim d); a genre g has
// an embedding v_g (dim d); the real score is the dot product z_g = e . v_g. The ranker's output
// type chooses what it returns: real z_g; log-probability log_softmax_g(z); probability
// softmax_g(z) — the softmax over all genres, so every loss type can be trained on the same
// model. Training pairs: a train sentence, its genre (positive) and a genre drawn uniformly
// among the 14 others (negative).
//
// Evaluation: pairwise accuracy on the held-out sentences against EVERY wrong genre (14 pairs
// per sentence; a tie counts 1/2), so it is deterministic and its chance level is exactly 0.5.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/trainer/loop/training_task.hpp"
#include "xpm/trainer/steps/losses.hpp"

namespace xpm {

/// Sentences as word ids with their genre id, split by file like the tagger's data.
struct GenreRankingData {
  Vocabulary vocab;                                   // built on the train sentences
  std::vector<std::string> genres;                    // id -> name, in order of first file
  std::vector<std::vector<std::int64_t>> train_token_ids;    // one per train sentence
  std::vector<std::int64_t> train_genre_ids;                 // same length
  std::vector<std::vector<std::int64_t>> heldout_token_ids;  // one per held-out sentence
  std::vector<std::int64_t> heldout_genre_ids;               // same length
  std::size_t train_files = 0;
  std::size_t heldout_files = 0;
};

/// File i (cats.txt order) is held out when i % heldout_every == heldout_every - 1 (as
/// split_by_file does for the tagger). Empty sentences are dropped. Throws
/// std::invalid_argument when heldout_every < 2 or the corpus has fewer than 2 genres.
GenreRankingData build_genre_ranking_data(const BrownCorpus& corpus, int heldout_every = 10,
                                          std::size_t vocab_size = 20000,
                                          std::size_t min_count = 2);

struct GenreRankerOptions {
  std::int64_t embedding_dim = 32;                       // d
  ScorerOutputType output_type = ScorerOutputType::real;  // what forward() returns
};

class GenreRankerImpl : public torch::nn::Module {
 public:
  /// Throws std::invalid_argument when a size or embedding_dim is < 1 (genre_count < 2).
  GenreRankerImpl(std::int64_t vocab_size, std::int64_t genre_count, GenreRankerOptions options);

  /// Scores of every genre for each sentence: [sentences, genres], of the output type.
  /// token_ids: [tokens] int64 (all sentences concatenated); offsets: [sentences] int64,
  /// where each sentence starts in token_ids.
  torch::Tensor forward(const torch::Tensor& token_ids, const torch::Tensor& offsets);

  ScorerOutputType output_type() const { return options_.output_type; }

 private:
  GenreRankerOptions options_;
  torch::nn::EmbeddingBag words_{nullptr};  // [vocab, d], mean mode
  torch::nn::Embedding genres_{nullptr};    // [genres, d]
};
TORCH_MODULE(GenreRanker);

/// Flattened input of a batch of sentences for GenreRankerImpl::forward.
struct SentenceBag {
  torch::Tensor token_ids;  // [tokens] int64
  torch::Tensor offsets;    // [sentences] int64
};
SentenceBag make_sentence_bag(const std::vector<std::vector<std::int64_t>>& sentences,
                              const std::vector<std::size_t>& indices);

/// Pairwise accuracy (losses.hpp) over every (held-out sentence, wrong genre) pair; eval mode,
/// no gradient, in chunks of 1024 sentences. Throws std::invalid_argument when there is no
/// held-out sentence.
double heldout_pairwise_accuracy(GenreRanker& ranker, const GenreRankingData& data);

/// Pairwise accuracy of the genre prior: every sentence scores genre g by the number of train
/// sentences of genre g. The score to beat for a model that reads no word.
double genre_prior_pairwise_accuracy(const GenreRankingData& data);

struct GenreRankingTrainOptions {
  std::int64_t steps = 300;           // optimizer steps
  std::int64_t pairs_per_step = 64;   // train sentences (one pair each) per step
  double learning_rate = 0.01;        // Adam
  std::uint64_t seed = 1;             // sentence and negative sampling
  std::string run_dir = "runs/genre-ranking";  // the Learner's metrics.jsonl, best_parameters.pt
};

/// The genre-ranking task as a TrainingTask (xpm/trainer/loop/training_task.hpp): records are
/// the train sentences (dims {bs = 1, l = words}, one pair each: units 1, size the words); the
/// summed loss of a microbatch draws each sentence's wrong genre uniformly among the others from
/// the task's own generator (saved in checkpoints); validation is heldout_pairwise_accuracy
/// ("pairwise_accuracy"). Single process. References must outlive the task.
class GenreRankingTask : public TrainingTask {
 public:
  GenreRankingTask(GenreRanker& ranker, const GenreRankingData& data, const pairwise::PairwiseLoss& loss,
                   std::uint64_t seed);
  torch::nn::Module& module() override { return *ranker_; }
  std::size_t train_record_count() const override { return data_.train_token_ids.size(); }
  TrainingRecord train_record(std::size_t index) const override;
  torch::Tensor loss_sum(const std::vector<std::size_t>& records) override;
  NamedMetrics validate(const ValidationPlanFn& plan_of) override;
  torch::Tensor probe_loss_sum(const std::vector<double>& dims) override;
  nlohmann::json extra_state() const override;
  void restore_extra_state(const nlohmann::json& state) override;
  /// Pairwise accuracy of the pairs loss_sum scored since the last call (0 when none), then reset.
  double take_train_accuracy();

 private:
  GenreRanker& ranker_;
  const GenreRankingData& data_;
  const pairwise::PairwiseLoss& loss_;
  std::mt19937_64 negatives_;
  double correct_pairs_ = 0;  // pairwise_accuracy x pairs, since take_train_accuracy()
  double pairs_ = 0;
};

struct GenreRankingTrainResult {
  double first_loss = 0;        // mean loss per pair of the first step
  double last_loss = 0;         // mean loss per pair of the last step
  double mean_train_accuracy_last_10_percent = 0;  // pairwise accuracy of the last steps' pairs
  double duration_s = 0;        // wall time of training
};

/// Trains `ranker` with `loss` (its output type must be the ranker's) on the Learner
/// (xpm/trainer/loop/learner.hpp) over a GenreRankingTask: each step takes the next
/// pairs_per_step sentences of an epoch's shuffle, one wrong genre each, and minimizes
/// loss.sum(scores) / pairs_per_step with Adam at a constant learning rate, in one microbatch
/// (FixedStepEngine); a validation at the end. Writes the Learner's files in options.run_dir.
/// Throws std::invalid_argument for options < 1, learning_rate <= 0, or a loss whose output
/// type differs from the ranker's.
GenreRankingTrainResult train_genre_ranker(GenreRanker& ranker, const GenreRankingData& data,
                                           const pairwise::PairwiseLoss& loss,
                                           const GenreRankingTrainOptions& options);

}  // namespace xpm
