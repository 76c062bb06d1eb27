#include "xpm/tasks/brown_corpus.hpp"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace xpm {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read corpus file '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

std::size_t BrownCorpus::sentence_count() const {
  std::size_t n = 0;
  for (const auto& file : files) n += file.sentences.size();
  return n;
}

std::size_t BrownCorpus::token_count() const {
  std::size_t n = 0;
  for (const auto& file : files)
    for (const auto& sentence : file.sentences) n += sentence.words.size();
  return n;
}

std::string normalize_brown_tag(const std::string& raw_tag) {
  std::string tag = raw_tag;
  std::transform(tag.begin(), tag.end(), tag.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  bool stripped = true;
  while (stripped) {
    stripped = false;
    for (const char* suffix : {"-tl", "-hl", "-nc"}) {
      if (ends_with(tag, suffix)) {
        tag.resize(tag.size() - 3);
        stripped = true;
      }
    }
  }
  return tag;
}

std::vector<TaggedSentence> parse_brown_text(const std::string& text, const std::string& source) {
  std::vector<TaggedSentence> sentences;
  std::istringstream lines(text);
  std::string line;
  std::size_t line_number = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    std::istringstream tokens(line);
    std::string token;
    TaggedSentence sentence;
    while (tokens >> token) {
      const std::size_t slash = token.rfind('/');
      if (slash == std::string::npos || slash == 0 || slash + 1 == token.size()) {
        throw std::runtime_error(source + ":" + std::to_string(line_number) + ": token '" + token +
                                 "' is not of the form word/tag");
      }
      sentence.words.push_back(token.substr(0, slash));
      sentence.tags.push_back(normalize_brown_tag(token.substr(slash + 1)));
    }
    if (!sentence.words.empty()) sentences.push_back(std::move(sentence));
  }
  return sentences;
}

BrownCorpus read_brown_corpus(const std::string& directory) {
  const std::string cats_path = directory + "/cats.txt";
  std::istringstream cats(read_file(cats_path));
  BrownCorpus corpus;
  std::set<std::string> listed;
  std::string line;
  while (std::getline(cats, line)) {
    std::istringstream fields(line);
    BrownFile file;
    if (!(fields >> file.name)) continue;
    fields >> file.genre;
    const bool plain_name =
        file.name.find('/') == std::string::npos && file.name != "." && file.name != "..";
    if (!plain_name) {
      throw std::runtime_error("'" + cats_path + "' lists '" + file.name +
                               "', not a file name inside the corpus folder");
    }
    if (!listed.insert(file.name).second) {
      throw std::runtime_error("'" + cats_path + "' lists '" + file.name + "' twice");
    }
    file.sentences = parse_brown_text(read_file(directory + "/" + file.name), file.name);
    corpus.files.push_back(std::move(file));
  }
  if (corpus.files.empty()) throw std::runtime_error("'" + cats_path + "' lists no corpus file");
  return corpus;
}

CorpusSplit split_by_file(const BrownCorpus& corpus, int validation_every) {
  if (validation_every < 2) {
    throw std::invalid_argument("split_by_file: validation_every must be >= 2, got " +
                                std::to_string(validation_every));
  }
  CorpusSplit split;
  for (std::size_t i = 0; i < corpus.files.size(); ++i) {
    const BrownFile& file = corpus.files[i];
    const bool validation = static_cast<int>(i % validation_every) == validation_every - 1;
    auto& target = validation ? split.validation : split.train;
    target.insert(target.end(), file.sentences.begin(), file.sentences.end());
    if (validation) split.validation_files.push_back(file.name);
  }
  return split;
}

Vocabulary Vocabulary::build(const std::vector<TaggedSentence>& sentences, std::size_t max_size,
                             std::size_t min_count) {
  std::unordered_map<std::string, std::size_t> counts;
  for (const auto& sentence : sentences)
    for (const auto& word : sentence.words) ++counts[word];
  std::vector<std::pair<std::string, std::size_t>> ranked(counts.begin(), counts.end());
  std::sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) {
    return x.second != y.second ? x.second > y.second : x.first < y.first;
  });
  Vocabulary vocab;
  vocab.words_ = {"<pad>", "<unk>"};
  for (const auto& [word, count] : ranked) {
    if (vocab.words_.size() >= max_size || count < min_count) break;
    vocab.words_.push_back(word);
  }
  for (std::size_t i = 0; i < vocab.words_.size(); ++i)
    vocab.ids_[vocab.words_[i]] = static_cast<std::int64_t>(i);
  return vocab;
}

std::int64_t Vocabulary::id(const std::string& word) const {
  auto it = ids_.find(word);
  return it == ids_.end() || it->second == kPadId ? kUnknownId : it->second;
}

TagSet TagSet::build(const std::vector<TaggedSentence>& sentences) {
  TagSet set;
  for (const auto& sentence : sentences)
    for (const auto& tag : sentence.tags) set.ids_.emplace(tag, 0);
  for (auto& [tag, id] : set.ids_) set.tags_.push_back(tag);
  std::sort(set.tags_.begin(), set.tags_.end());
  for (std::size_t i = 0; i < set.tags_.size(); ++i)
    set.ids_[set.tags_[i]] = static_cast<std::int64_t>(i);
  return set;
}

std::int64_t TagSet::id(const std::string& tag) const {
  auto it = ids_.find(tag);
  return it == ids_.end() ? -1 : it->second;
}

std::vector<EncodedSentence> encode(const std::vector<TaggedSentence>& sentences,
                                    const Vocabulary& vocab, const TagSet& tags) {
  std::vector<EncodedSentence> encoded;
  encoded.reserve(sentences.size());
  for (const auto& sentence : sentences) {
    EncodedSentence e;
    for (std::size_t i = 0; i < sentence.words.size(); ++i) {
      e.token_ids.push_back(vocab.id(sentence.words[i]));
      e.tag_ids.push_back(tags.id(sentence.tags[i]));
    }
    encoded.push_back(std::move(e));
  }
  return encoded;
}

double most_frequent_tag_accuracy(const std::vector<TaggedSentence>& train,
                                  const std::vector<TaggedSentence>& evaluation) {
  std::unordered_map<std::string, std::map<std::string, std::size_t>> word_tags;
  std::map<std::string, std::size_t> tag_counts;
  for (const auto& sentence : train) {
    for (std::size_t i = 0; i < sentence.words.size(); ++i) {
      ++word_tags[sentence.words[i]][sentence.tags[i]];
      ++tag_counts[sentence.tags[i]];
    }
  }
  const auto most_frequent = [](const std::map<std::string, std::size_t>& counts) {
    return std::max_element(counts.begin(), counts.end(), [](const auto& x, const auto& y) {
             return x.second < y.second;
           })->first;
  };
  if (tag_counts.empty()) throw std::invalid_argument("most_frequent_tag_accuracy: empty train");
  const std::string default_tag = most_frequent(tag_counts);
  std::unordered_map<std::string, std::string> best;
  for (const auto& [word, counts] : word_tags) best[word] = most_frequent(counts);
  std::size_t correct = 0, total = 0;
  for (const auto& sentence : evaluation) {
    for (std::size_t i = 0; i < sentence.words.size(); ++i) {
      auto it = best.find(sentence.words[i]);
      correct += (it == best.end() ? default_tag : it->second) == sentence.tags[i];
      ++total;
    }
  }
  return total == 0 ? 0.0 : static_cast<double>(correct) / static_cast<double>(total);
}

}  // namespace xpm
