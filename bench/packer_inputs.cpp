// packer_inputs.cpp — see packer_inputs.hpp.
#include "packer_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>

#include "xpm/tasks/brown_corpus.hpp"

namespace xpm_bench {

std::string to_string(LengthDistribution d) {
  switch (d) {
    case LengthDistribution::kBrown: return "brown";
    case LengthDistribution::kUniform: return "uniform";
    case LengthDistribution::kLogNormal: return "lognormal";
    case LengthDistribution::kBimodal: return "bimodal";
  }
  return "?";
}

std::string to_string(BenchFormula f) {
  switch (f) {
    case BenchFormula::kQuadratic: return "quadratic";
    case BenchFormula::kLinear: return "linear";
    case BenchFormula::kPacked: return "packed";
  }
  return "?";
}

double max_length(LengthDistribution d, const std::vector<double>& brown_lengths) {
  switch (d) {
    case LengthDistribution::kBrown:
      return brown_lengths.empty() ? 0.0 : *std::max_element(brown_lengths.begin(), brown_lengths.end());
    case LengthDistribution::kUniform: return 256;
    case LengthDistribution::kLogNormal:
    case LengthDistribution::kBimodal: return 1024;
  }
  return 0;
}

std::vector<double> brown_sentence_lengths(const std::string& directory) {
  const xpm::BrownCorpus corpus = xpm::read_brown_corpus(directory);
  std::vector<double> lengths;
  lengths.reserve(corpus.sentence_count());
  for (const xpm::BrownFile& file : corpus.files) {
    for (const xpm::TaggedSentence& sentence : file.sentences) {
      lengths.push_back(static_cast<double>(sentence.words.size()));
    }
  }
  if (lengths.empty()) throw std::runtime_error("no sentences in the corpus at '" + directory + "'");
  return lengths;
}

Records outer_batch(LengthDistribution d, std::size_t n, const std::vector<double>& brown_lengths) {
  std::mt19937 rng(42);
  Records records(n);
  auto clamp = [](double x, double hi) { return std::min(hi, std::max(1.0, std::round(x))); };
  switch (d) {
    case LengthDistribution::kBrown: {
      if (brown_lengths.empty()) throw std::invalid_argument("outer_batch: no Brown lengths");
      std::vector<std::size_t> order(brown_lengths.size());
      std::size_t next = order.size();  // position in the current pass
      for (auto& r : records) {
        if (next == order.size()) {  // a new pass: reshuffle
          std::iota(order.begin(), order.end(), std::size_t{0});
          std::shuffle(order.begin(), order.end(), rng);
          next = 0;
        }
        r = {1.0, brown_lengths[order[next++]]};
      }
      break;
    }
    case LengthDistribution::kUniform: {
      std::uniform_int_distribution<int> length(1, 256);
      for (auto& r : records) r = {1.0, static_cast<double>(length(rng))};
      break;
    }
    case LengthDistribution::kLogNormal: {
      std::lognormal_distribution<double> length(std::log(64.0), 0.8);
      for (auto& r : records) r = {1.0, clamp(length(rng), 1024)};
      break;
    }
    case LengthDistribution::kBimodal: {
      std::bernoulli_distribution long_one(0.2);
      std::normal_distribution<double> short_length(24, 8), long_length(384, 64);
      for (auto& r : records) {
        const bool is_long = long_one(rng);
        const double x = is_long ? long_length(rng) : short_length(rng);
        r = {1.0, clamp(x, 1024)};
      }
      break;
    }
  }
  return records;
}

namespace {

constexpr double kActivationBytes = 1024.0 * 1024.0 * 1024.0;  // 1 GiB above c

BenchModel make(const std::string& formula, const std::string& length_variable,
                std::vector<double> coefficients, xpm::DimAggregation aggregation) {
  const double c = coefficients.back();
  xpm::MemoryModel memory(xpm::CostFormula(formula, {"a", "b", "c"}, {"bs", length_variable}),
                          std::move(coefficients), 0, "bs", {{length_variable, aggregation}});
  return {std::move(memory), static_cast<std::int64_t>(c + kActivationBytes)};
}

}  // namespace

BenchModel bench_model(BenchFormula f) {
  switch (f) {
    case BenchFormula::kQuadratic:
      return make("a*bs*l^2 + b*bs*l + c", "l", {96.0, 25811.8, 49091683.6}, xpm::DimAggregation::kMax);
    case BenchFormula::kLinear:
      return make("a*bs*(l-1) + b*bs + c", "l", {24593.2, 18434.9, 52709866.0}, xpm::DimAggregation::kMax);
    case BenchFormula::kPacked:
      return make("a*t + b*bs + c", "t", {24593.2, 0.0, 52709866.0}, xpm::DimAggregation::kSum);
  }
  throw std::invalid_argument("bench_model: unknown formula");
}

BenchModel demo_cpu_model() {
  xpm::MemoryModel memory(xpm::CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
                          {96.0, 25811.8, 49091683.6}, 69570620.0, "bs",
                          {{"l", xpm::DimAggregation::kMax}});
  return {std::move(memory), 88363094};
}

std::int64_t safe_max_tokens(const BenchModel& model, double longest) {
  const xpm::CostFormula& formula = model.memory.formula();
  const auto& coefficients = model.memory.coefficients();
  const double c = formula.predict(coefficients, {0.0, 0.0});  // no record at all
  double worst_per_token = 0;
  for (double l = 1; l <= longest; l += 1) {
    const double g = formula.predict(coefficients, {1.0, l}) - c;
    worst_per_token = std::max(worst_per_token, g / l);
  }
  return static_cast<std::int64_t>(std::floor((static_cast<double>(model.usable_bytes) - c) / worst_per_token));
}

const Records& cached_brown_batch(const std::string& directory, std::size_t n) {
  static std::map<std::string, std::vector<double>> lengths;
  static std::map<std::pair<std::string, std::size_t>, Records> batches;
  const auto key = std::make_pair(directory, n);
  auto it = batches.find(key);
  if (it == batches.end()) {
    auto known = lengths.find(directory);
    if (known == lengths.end()) known = lengths.emplace(directory, brown_sentence_lengths(directory)).first;
    it = batches.emplace(key, outer_batch(LengthDistribution::kBrown, n, known->second)).first;
  }
  return it->second;
}

}  // namespace xpm_bench
