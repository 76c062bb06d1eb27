// The genre-ranking task (genre_ranking.hpp) on the real Brown corpus: the pairwise losses
// train a ranker that beats chance and the genre prior on held-out files, in process and
// through the xpm-rank-example program (exit codes, bad options).
#include <unistd.h>

#include "torch_doctest.hpp"
#include "scratch_folders.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <sys/wait.h>

#include <torch/torch.h>

#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/tasks/genre_ranking.hpp"
#include "xpm/trainer/steps/losses.hpp"

namespace {

const std::string kProgram = std::string(XPM_BINARY_DIR) + "/bin/xpm-rank-example";
const std::string kData = std::string(XPM_SOURCE_DIR) + "/data/brown";
const std::string kWork = std::string(XPM_BINARY_DIR) + "/tests/genre_ranking";

// kWork/NAME (a run folder or a log), removed when the running test case passes.
std::string scratch(const std::string& name) {
  const std::string path = kWork + "/" + name;
  xpm_test::remove_when_passed(path);
  return path;
}

const xpm::GenreRankingData& corpus_data() {
  static const xpm::GenreRankingData data =
      xpm::build_genre_ranking_data(xpm::read_brown_corpus(kData));
  return data;
}

struct Run {
  int exit_code = -1;
  std::string output;                    // stdout and stderr
  std::map<std::string, double> values;  // the `key value` lines
};

Run run_example(const std::string& arguments) {
  std::filesystem::create_directories(kWork);
  // One log per process: ctest runs the test cases of this file in parallel.
  const std::string log = scratch("run-" + std::to_string(::getpid()) + ".log");
  const std::string command = "'" + kProgram + "' " + arguments + " > '" + log + "' 2>&1";
  const int status = std::system(command.c_str());
  Run run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  run.output = text.str();
  std::istringstream lines(run.output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string key;
    double number = 0;
    std::string rest;
    if (fields >> key >> number && !(fields >> rest)) run.values[key] = number;
  }
  return run;
}

}  // namespace

TEST_CASE("genre-ranking data holds out every 10th file and keeps all 15 genres") {
  const xpm::GenreRankingData& data = corpus_data();
  CHECK(data.genres.size() == 15);
  CHECK(data.genres.front() == "news");
  CHECK(data.train_files == 450);
  CHECK(data.heldout_files == 50);
  CHECK(data.train_token_ids.size() == data.train_genre_ids.size());
  CHECK(data.heldout_token_ids.size() == data.heldout_genre_ids.size());
  CHECK(data.train_token_ids.size() + data.heldout_token_ids.size() > 57000);
  CHECK(data.heldout_token_ids.size() > 4000);
  CHECK_THROWS_AS(xpm::build_genre_ranking_data(xpm::BrownCorpus{}, 1), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::build_genre_ranking_data(xpm::BrownCorpus{}),
                       doctest::Contains("ranking needs at least 2"), std::invalid_argument);
}

TEST_CASE("the ranker outputs scores of its output type for every genre") {
  torch::manual_seed(0);
  const std::vector<std::vector<std::int64_t>> sentences = {{2, 3, 4}, {5}};
  const xpm::SentenceBag bag = xpm::make_sentence_bag(sentences, {0, 1});
  CHECK(bag.offsets.sizes() == torch::IntArrayRef{2});
  CHECK(bag.token_ids.sizes() == torch::IntArrayRef{4});
  for (xpm::ScorerOutputType type : {xpm::ScorerOutputType::real, xpm::ScorerOutputType::probability,
                                     xpm::ScorerOutputType::log_probability}) {
    xpm::GenreRanker ranker(10, 4, xpm::GenreRankerOptions{8, type});
    const torch::Tensor scores = ranker->forward(bag.token_ids, bag.offsets);
    REQUIRE(scores.sizes() == torch::IntArrayRef{2, 4});
    if (type == xpm::ScorerOutputType::probability) {
      CHECK(scores.sum(1)[0].item<double>() == doctest::Approx(1));
    }
    if (type == xpm::ScorerOutputType::log_probability) {
      CHECK(scores.exp().sum(1)[1].item<double>() == doctest::Approx(1));
    }
  }
  CHECK_THROWS_AS(xpm::GenreRanker(10, 1, xpm::GenreRankerOptions{}), std::invalid_argument);
}

TEST_CASE("pairwise cross-entropy trains the genre ranker well above chance and the prior") {
  const xpm::GenreRankingData& data = corpus_data();
  torch::manual_seed(1);
  xpm::GenreRanker ranker(static_cast<std::int64_t>(data.vocab.size()),
                          static_cast<std::int64_t>(data.genres.size()), xpm::GenreRankerOptions{});
  const xpm::pairwise::CrossEntropyLoss loss(xpm::ScorerOutputType::real);
  const double before = xpm::heldout_pairwise_accuracy(ranker, data);
  const double prior = xpm::genre_prior_pairwise_accuracy(data);
  xpm::GenreRankingTrainOptions options;
  options.steps = 200;
  options.run_dir = scratch("in_process");
  const xpm::GenreRankingTrainResult trained = xpm::train_genre_ranker(ranker, data, loss, options);
  const double after = xpm::heldout_pairwise_accuracy(ranker, data);
  MESSAGE("before " << before << ", after " << after << ", prior " << prior << ", loss "
                    << trained.first_loss << " -> " << trained.last_loss);
  CHECK(std::abs(before - 0.5) < 0.05);  // small random embeddings: near chance
  CHECK(after > 0.7);
  CHECK(after > prior + 0.05);
  CHECK(trained.last_loss < trained.first_loss);
}

TEST_CASE("training refuses a loss whose output type is not the ranker's") {
  const xpm::GenreRankingData& data = corpus_data();
  xpm::GenreRanker ranker(static_cast<std::int64_t>(data.vocab.size()),
                          static_cast<std::int64_t>(data.genres.size()),
                          xpm::GenreRankerOptions{8, xpm::ScorerOutputType::log_probability});
  const xpm::pairwise::HingeLoss loss(xpm::ScorerOutputType::real);
  CHECK_THROWS_WITH_AS(xpm::train_genre_ranker(ranker, data, loss, {}),
                       "train_genre_ranker: the loss expects real scores but the ranker outputs "
                       "log-probability",
                       std::invalid_argument);
}

TEST_CASE("xpm-rank-example trains with the hinge loss: accuracy after > before") {
  const Run run = run_example("--data-dir '" + kData + "' --loss hinge --steps 150 --threads 1 --run-dir '" +
                              scratch("hinge") + "'");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  REQUIRE(run.values.count("heldout_pairwise_accuracy_before") == 1);
  REQUIRE(run.values.count("heldout_pairwise_accuracy_after") == 1);
  CHECK(run.values.at("chance_pairwise_accuracy") == 0.5);
  CHECK(run.values.at("heldout_pairwise_accuracy_after") >
        run.values.at("heldout_pairwise_accuracy_before") + 0.1);
  CHECK(run.values.at("heldout_pairwise_accuracy_after") > 0.65);
}

TEST_CASE("xpm-rank-example trains pointwise cross-entropy on log-probabilities") {
  const Run run = run_example("--data-dir '" + kData +
                              "' --loss pointwise-cross-entropy --output-type log-probability "
                              "--steps 150 --threads 1 --run-dir '" + scratch("pointwise") + "'");
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  CHECK(run.values.at("heldout_pairwise_accuracy_after") >
        run.values.at("heldout_pairwise_accuracy_before") + 0.1);
}

TEST_CASE("xpm-rank-example exits 2 on bad options, naming them") {
  const auto check_bad = [](const std::string& arguments, const std::string& expected) {
    const Run run = run_example(arguments);  // all fail before the corpus is read
    INFO(arguments);
    INFO(run.output);
    CHECK(run.exit_code == 2);
    CHECK(run.output.find(expected) != std::string::npos);
  };
  check_bad("--no-such-option", "no-such-option");
  check_bad("--loss ranknet", "unknown pairwise loss 'ranknet'");
  check_bad("--loss cross-entropy --output-type probability",
            "output type probability is not supported");
  check_bad("--loss hinge --output-type probability --margin 2", "margin 2 > 1");
  check_bad("--output-type logit", "--output-type must be 'real', 'probability' or 'log-probability', got 'logit'");
  check_bad("--steps 0", "--steps must be >= 1, got 0");
  check_bad("--steps many", "steps");
  check_bad("--data-dir /nonexistent/brown", "has no cats.txt");
  CHECK(run_example("--help").exit_code == 0);
}
