// brown_sentences.hpp — the examples' data: Brown corpus sentences as plain text (the words of
// its "word/tag" tokens), labelled with their file's genre (the letter after 'c' in "ca01":
// 15 genres), every 10th file held out. Header-only; shared by the C++ examples.
//
//   const brown::Corpus corpus = brown::read_sentences("data/brown", /*max_characters=*/256);
//   corpus.train[0].text, corpus.train[0].genre;  // "The Fulton County Grand Jury said ...", 0
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace brown {

struct Sentence {
  std::string text;        // words separated by one space, cut after max_characters
  std::int64_t genre = 0;  // 0..14, the order of "abcdefghjklmnpr"
};

struct Corpus {
  std::vector<Sentence> train, held_out;
};

/// Reads every Brown file (ca01 ... cr09) of `dir`; sentences shorter than `min_characters`
/// are left out; at most `max_held_out` held-out sentences, spread over every held-out file
/// (0: all). Throws std::invalid_argument when `dir` holds no Brown file.
inline Corpus read_sentences(const std::string& dir, std::size_t max_characters, std::size_t min_characters = 2,
                             std::size_t max_held_out = 0) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (std::regex_match(entry.path().filename().string(), std::regex("c[a-r][0-9][0-9]"))) files.push_back(entry);
  }
  if (files.empty()) throw std::invalid_argument("--data-dir '" + dir + "' holds no Brown files (ca01, ...)");
  std::sort(files.begin(), files.end());
  const std::string genres = "abcdefghjklmnpr";
  Corpus corpus;
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::ifstream in(files[i]);
    const auto genre = static_cast<std::int64_t>(genres.find(files[i].filename().string()[1]));
    for (std::string line, token; std::getline(in, line);) {
      std::istringstream tokens(line);
      std::string text;
      while (tokens >> token) text += (text.empty() ? "" : " ") + token.substr(0, token.rfind('/'));
      if (text.size() >= min_characters) (i % 10 == 9 ? corpus.held_out : corpus.train).push_back({text.substr(0, max_characters), genre});
    }
  }
  if (max_held_out > 0 && corpus.held_out.size() > max_held_out) {
    std::vector<Sentence> sample;
    const std::size_t stride = corpus.held_out.size() / max_held_out;
    for (std::size_t i = 0; i < corpus.held_out.size() && sample.size() < max_held_out; i += stride) sample.push_back(corpus.held_out[i]);
    corpus.held_out.swap(sample);
  }
  return corpus;
}

}  // namespace brown
