// The automatic probe design with a sample of the training data's records: probes are mixes of
// real records, so a summed variable (real tokens) and the padded length it moves with can be
// told apart.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "xpm/planner/predictive_batcher.hpp"

namespace {

// A step whose forward/backward peaks at the static bytes plus `activations_bytes(dims)`; the
// optimizer step peaks at the static bytes plus 5000. A mix of records combines their dims by
// `mix_dims`.
class StepExecutor : public xpm::ProbeExecutor {
 public:
  xpm::ProbeResult run_probe(const std::vector<double>& dims) override {
    xpm::ProbeResult r;
    r.dims = dims;
    r.forward_backward_peak_bytes = kStatic + activations_bytes(dims);
    r.optimizer_step_peak_bytes = kStatic + 5000;
    return r;
  }
  xpm::ProbeResult run_probe_records(const std::vector<std::vector<double>>& records) override {
    ++mixes;
    return run_probe(mix_dims(records));
  }
  double static_bytes() override { return kStatic; }
  static constexpr double kStatic = 1e6;
  int mixes = 0;

 protected:
  virtual double activations_bytes(const std::vector<double>& dims) const = 0;
  virtual std::vector<double> mix_dims(const std::vector<std::vector<double>>& records) const = 0;
};

// A packed-sequence step over records (bs = 1, l, t = l): padded buffers 300 bytes per padded
// position (bs * l, l the longest record), packed ones 2000 bytes per real token (t, summed),
// 500 bytes per record.
class PackedStepExecutor : public StepExecutor {
 protected:
  double activations_bytes(const std::vector<double>& dims) const override {
    return 300 * dims[0] * dims[1] + 2000 * dims[2] + 500 * dims[0];
  }
  std::vector<double> mix_dims(const std::vector<std::vector<double>>& records) const override {
    double l = 0, t = 0;
    for (const auto& record : records) {
      l = std::max(l, record[1]);
      t += record[2];
    }
    return {static_cast<double>(records.size()), l, t};
  }
};

// Record lengths 2..96 skewed toward short ones, as sentence lengths are.
std::vector<std::vector<double>> length_sample(std::size_t count, std::uint32_t seed) {
  std::mt19937 generator(seed);
  std::vector<std::vector<double>> records;
  for (std::size_t i = 0; i < count; ++i) {
    const double u = static_cast<double>(generator()) / 4294967296.0;
    const double l = std::floor(2 + 94 * u * u);
    records.push_back({1, l, l});
  }
  return records;
}

xpm::PredictiveBatcherOptions packed_options() {
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula::with_variables("a*bs*l + b*t + d*bs + c", {"bs", "l", "t"});
  options.aggregation = {{"t", xpm::DimAggregation::kSum}};
  options.variable_max = {{"bs", 32}};
  options.record_dims_sample = length_sample(2000, 7);
  options.budget = {4'000'000'000, 0.9, 0};
  return options;
}

}  // namespace

TEST_CASE("with a record sample, mixes tell a summed variable from the padded length, and mixes are predicted") {
  PackedStepExecutor executor;
  xpm::PredictiveBatcher batcher(packed_options(), std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  CHECK(executor.mixes == static_cast<int>(batcher.probes().size()));  // every probe was a mix
  CHECK(model.coefficients()[0] == doctest::Approx(300).epsilon(1e-6));
  CHECK(model.coefficients()[1] == doctest::Approx(2000).epsilon(1e-6));
  CHECK(model.coefficients()[2] == doctest::Approx(500).epsilon(1e-6));
  // Held out: random microbatches of the sample, unsorted.
  const std::vector<std::vector<double>> sample = length_sample(2000, 11);
  std::mt19937 generator(3);
  double worst = 0;
  for (int k = 0; k < 50; ++k) {
    const std::size_t bs = 1 + generator() % 32;
    double l = 0, t = 0;
    for (std::size_t i = 0; i < bs; ++i) {
      const auto& record = sample[generator() % sample.size()];
      l = std::max(l, record[1]);
      t += record[2];
    }
    const double measured = executor.run_probe({static_cast<double>(bs), l, t}).step_peak_bytes();
    worst = std::max(worst, std::abs(model.predict_bytes({static_cast<double>(bs), l, t}) - measured) / measured);
  }
  CHECK(worst < 1e-6);
}

TEST_CASE("the sample's mixes: near-equal records below a quantile, and records spread up to it") {
  PackedStepExecutor executor;
  xpm::PredictiveBatcherOptions options = packed_options();
  options.record_dims_sample = {{1, 10, 10}, {1, 40, 40}, {1, 20, 20}, {1, 30, 30}};
  options.design_fractions = {1.0};
  options.variable_max = {{"bs", 4}};
  options.adaptive.max_probes = 0;
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  batcher.probe_and_fit(executor);
  std::vector<std::vector<double>> dims;
  for (const xpm::ProbeResult& probe : batcher.probes()) dims.push_back(probe.dims);
  // Near-equal: the largest records first. Spread: evenly over the ranks (the median at bs 1).
  const std::vector<std::vector<double>> expected = {
      {1, 40, 40}, {2, 40, 70}, {4, 40, 100},   // 40; 40+30; all four
      {1, 30, 30}, {2, 40, 60}, {4, 40, 100}};  // rank 2; ranks 1, 3; all four
  CHECK(dims == expected);
}

namespace {

// The automatic design's probes over records of these lengths (l = t), design fractions 1 and
// 0.5, microbatches up to 8, no adaptive probes: 2 fractions x 2 mixes x bs 1, 2, 4, 8.
std::vector<xpm::ProbeResult> half_length_design_probes(const std::vector<double>& lengths) {
  PackedStepExecutor executor;
  xpm::PredictiveBatcherOptions options = packed_options();
  options.record_dims_sample.clear();
  for (double l : lengths) options.record_dims_sample.push_back({1, l, l});
  options.design_fractions = {1.0, 0.5};
  options.variable_max = {{"bs", 8}};
  options.adaptive.max_probes = 0;
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  batcher.probe_and_fit(executor);
  return batcher.probes();
}

}  // namespace

TEST_CASE("a sample mostly cut at one length is probed below it too: a fraction of the length") {
  // 700 records cut at 120, 300 of 10..119: every quantile from the 30 % one lies at 120, yet a
  // sorting packer's last microbatch of a step holds the shortest records.
  std::vector<double> lengths;
  for (int i = 0; i < 1000; ++i) lengths.push_back(i < 700 ? 120 : 10 + (i - 700) % 110);
  const std::vector<xpm::ProbeResult> probes = half_length_design_probes(lengths);
  REQUIRE(probes.size() == 16);  // 2 fractions x 2 mixes x bs 1, 2, 4, 8
  for (std::size_t i = 0; i < 8; ++i) CHECK(probes[i].dims[1] == 120);    // f = 1: the longest
  for (std::size_t i = 8; i < 16; ++i) CHECK(probes[i].dims[1] <= 60);    // f = 0.5: half the length
  CHECK(probes[8].dims == std::vector<double>{1, 60, 60});  // the longest record within half
}

TEST_CASE("where too few records lie below a fraction of the length, the mixes keep the quantiles") {
  // Records of 100 to 120 and one outlier of 10: at f = 0.5 only the outlier lies below half the
  // length, too few for a microbatch of 8; the mixes stay at the median's records.
  std::vector<double> lengths;
  for (int i = 0; i < 400; ++i) lengths.push_back(100 + i % 21);
  lengths.push_back(10);
  const std::vector<xpm::ProbeResult> probes = half_length_design_probes(lengths);
  REQUIRE(probes.size() == 16);
  for (std::size_t i = 8; i < 16; ++i) CHECK(probes[i].dims[1] >= 100);  // f = 0.5: never the outlier alone
  CHECK(probes[8].dims == std::vector<double>{1, 110, 110});                // the median record
}

TEST_CASE("an executor that cannot build a mix says so when a sample asks for one") {
  class DimsOnly : public xpm::ProbeExecutor {
   public:
    xpm::ProbeResult run_probe(const std::vector<double>& dims) override { return PackedStepExecutor().run_probe(dims); }
    double static_bytes() override { return PackedStepExecutor::kStatic; }
  } executor;
  xpm::PredictiveBatcher batcher(packed_options(), std::make_shared<xpm::AdaptivePacker>());
  CHECK_THROWS_WITH_AS(batcher.probe_and_fit(executor),
                       doctest::Contains("override run_probe_records"), std::logic_error);
}

TEST_CASE("a record sample is checked: width, batch-size column, values, and no second range") {
  const auto refused = [](const std::function<void(xpm::PredictiveBatcherOptions&)>& change) {
    xpm::PredictiveBatcherOptions options = packed_options();
    change(options);
    try {
      xpm::PredictiveBatcher(options, std::make_shared<xpm::AdaptivePacker>());
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(refused([](auto& o) { o.record_dims_sample[3] = {1, 5}; }) ==
        "PredictiveBatcherOptions.record_dims_sample[3] has 2 dims; the formula has 3 variables (bs, l, t)");
  CHECK(refused([](auto& o) { o.record_dims_sample[0][0] = 4; }) ==
        "PredictiveBatcherOptions.record_dims_sample[0]: its bs column is 4, not 1 (one record)");
  CHECK(refused([](auto& o) { o.record_dims_sample[1][2] = std::nan(""); }) ==
        "PredictiveBatcherOptions.record_dims_sample[1]: t = nan is not a finite value >= 0");
  CHECK(refused([](auto& o) { o.variable_max["l"] = 96; }).find("variable_max['l'] and record_dims_sample") !=
        std::string::npos);
  CHECK(refused([](auto& o) { o.probe_points = {{{{"bs", 1}, {"l", 4}, {"t", 4}}}}; }).find("probe_points") !=
        std::string::npos);
  CHECK(refused([](auto& o) { o.variable_max.clear(); }).find("variable 'bs'") != std::string::npos);
}

TEST_CASE("an aggregation that names no variable, or the batch size, is refused") {
  xpm::PredictiveBatcherOptions options = packed_options();
  options.aggregation = {{"T", xpm::DimAggregation::kSum}};
  CHECK_THROWS_WITH_AS(xpm::PredictiveBatcher(options, std::make_shared<xpm::AdaptivePacker>()),
                       "PredictiveBatcherOptions.aggregation names 'T', which is not a variable of the formula "
                       "other than the batch size (bs, l, t)",
                       std::invalid_argument);
  options.aggregation = {{"bs", xpm::DimAggregation::kSum}};
  CHECK_THROWS_AS(xpm::PredictiveBatcher(options, std::make_shared<xpm::AdaptivePacker>()), std::invalid_argument);
}

namespace {

// An encoder-decoder step over records (bs = 1, ls, lt), each length a microbatch's max: encoder
// attention bs*ls^2, cross attention bs*ls*lt, decoder attention bs*lt^2, 400 bytes per padded
// token of either side.
class EncoderDecoderExecutor : public StepExecutor {
 protected:
  double activations_bytes(const std::vector<double>& dims) const override {
    const double bs = dims[0], ls = dims[1], lt = dims[2];
    return bs * (30 * ls * ls + 12 * ls * lt + 20 * lt * lt + 400 * (ls + lt));
  }
  std::vector<double> mix_dims(const std::vector<std::vector<double>>& records) const override {
    double ls = 0, lt = 0;
    for (const auto& record : records) {
      ls = std::max(ls, record[1]);
      lt = std::max(lt, record[2]);
    }
    return {static_cast<double>(records.size()), ls, lt};
  }
};

// Targets about half their source (10..200 tokens), and `lopsided` records of the longest
// source with a 2-token target (a classification label).
xpm::PredictiveBatcher encoder_decoder_design(EncoderDecoderExecutor& executor, int lopsided) {
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula::with_variables("a*bs*ls^2 + b*bs*ls*lt + d*bs*lt^2 + e*bs*ls + f*bs*lt + c",
                                                     {"bs", "ls", "lt"});
  options.variable_max = {{"bs", 16}};
  std::mt19937 generator(5);
  for (int i = 0; i < 400; ++i) {
    const double ls = 10 + static_cast<double>(generator() % 191);
    options.record_dims_sample.push_back({1, ls, std::floor(ls / 2) + static_cast<double>(generator() % 3)});
  }
  for (int i = 0; i < lopsided; ++i) options.record_dims_sample.push_back({1, 200, 2});
  options.budget = {4'000'000'000, 0.9, 0};
  options.adaptive.max_probes = 0;
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  batcher.probe_and_fit(executor);
  return batcher;
}

}  // namespace

TEST_CASE("with two lengths, the record most lopsided toward each is swept on its own") {
  EncoderDecoderExecutor executor;
  const xpm::PredictiveBatcher batcher = encoder_decoder_design(executor, 1);
  std::vector<std::vector<double>> lopsided;
  for (const xpm::ProbeResult& probe : batcher.probes()) {
    if (probe.dims[2] == 2) lopsided.push_back(probe.dims);
  }
  // Its sweep: 1, 2, 4, 8 and 16 copies of the long source with the 2-token target. No record
  // leads in the target length by half its range: no sweep there.
  CHECK(lopsided == std::vector<std::vector<double>>{{1, 200, 2}, {2, 200, 2}, {4, 200, 2}, {8, 200, 2},
                                                     {16, 200, 2}});
  // The lopsided shapes are predicted.
  for (const std::vector<double>& dims : {std::vector<double>{1, 200, 2}, {3, 200, 2}, {5, 180, 4}}) {
    const double measured = executor.run_probe(dims).step_peak_bytes();
    CHECK(std::abs(batcher.model().predict_bytes(dims) - measured) / measured < 1e-3);
  }
}

TEST_CASE("lengths that grow together add no lopsided sweep") {
  EncoderDecoderExecutor executor;
  const xpm::PredictiveBatcher with = encoder_decoder_design(executor, 1);
  const xpm::PredictiveBatcher without = encoder_decoder_design(executor, 0);
  CHECK(with.probes().size() == without.probes().size() + 5);
  for (const xpm::ProbeResult& probe : without.probes()) CHECK(probe.dims[2] >= std::floor(probe.dims[1] / 2));
}
