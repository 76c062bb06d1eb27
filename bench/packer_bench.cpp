// packer_bench.cpp — microbatch packers side by side: time per plan and plan quality, on Brown
// corpus sentence lengths and synthetic length distributions.
//
//   BM_Packer_<Packer>/<distribution>/<formula>/<records>: one pack() of an outer batch.
//
// Packers: Uniform, Adaptive (record order), AdaptiveSorted (sort_by the length), FFD (first fit
// decreasing), and the baselines of packer_baselines.hpp: MaxTokens (fairseq's max_tokens
// batcher) and Reference / ReferenceSorted (the reference's AdaptivePacker algorithm, dims
// recomputed per candidate; run up to 65,536 records only: past that one plan takes seconds).
// Distributions and formulas: packer_inputs.hpp. Formula "quadratic-cpu" is the Transformer
// under xpm-train's demo budget (88 MB usable: about 60 sentences per microbatch) instead of
// c + 1 GiB.
//
// Counters (computed once per benchmark from the last plan, outside the timed loop, by
// plan_quality.hpp, independently of the packer): microbatches, lower_bound and vs_lower_bound
// (microbatches / volume bound), vs_ffd (microbatches / FFD's on the same input), util_mean and
// util_min (predicted bytes / usable), padding_waste (padded / real tokens - 1), over_budget
// (microbatches predicted above the budget), records_per_microbatch; items_per_second is
// records/s.
//
// Extra option: --data-dir PATH (or --data-dir=PATH), the Brown corpus (default data/brown). Any
// other token must be one of Google Benchmark's flags, else the program exits with code 2.
#include <benchmark/benchmark.h>

#include <boost/program_options.hpp>

#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "packer_baselines.hpp"
#include "packer_inputs.hpp"
#include "plan_quality.hpp"
#include "xpm/planner/ffd_packer.hpp"
#include "xpm/planner/packer.hpp"

namespace {

using xpm_bench::BenchFormula;
using xpm_bench::BenchModel;
using xpm_bench::LengthDistribution;
using xpm_bench::Records;

std::string g_data_dir = "data/brown";

const std::vector<double>& brown_lengths() {
  static const std::vector<double> lengths = xpm_bench::brown_sentence_lengths(g_data_dir);
  return lengths;
}

const Records& records_for(LengthDistribution d, std::size_t n) {
  static std::map<std::pair<int, std::size_t>, Records> cache;
  const auto key = std::make_pair(static_cast<int>(d), n);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, xpm_bench::outer_batch(d, n, brown_lengths())).first;
  return it->second;
}

// "quadratic-cpu" is the quadratic formula under the demo's CPU budget.
const BenchModel& model_for(const std::string& formula) {
  static const BenchModel quadratic = xpm_bench::bench_model(BenchFormula::kQuadratic);
  static const BenchModel linear = xpm_bench::bench_model(BenchFormula::kLinear);
  static const BenchModel packed = xpm_bench::bench_model(BenchFormula::kPacked);
  static const BenchModel demo = xpm_bench::demo_cpu_model();
  if (formula == "quadratic") return quadratic;
  if (formula == "linear") return linear;
  if (formula == "packed") return packed;
  return demo;
}

using PackerFactory =
    std::function<std::unique_ptr<xpm::MicrobatchPacker>(const BenchModel&, LengthDistribution)>;

struct PackerKind {
  std::string name;
  PackerFactory make;
  std::size_t max_records;  // larger outer batches are not run
};

std::vector<PackerKind> packer_kinds() {
  const std::size_t all = std::size_t{1} << 40;
  return {
      {"Uniform", [](const BenchModel&, LengthDistribution) {
         return std::make_unique<xpm::UniformPacker>(); }, all},
      {"Adaptive", [](const BenchModel&, LengthDistribution) {
         return std::make_unique<xpm::AdaptivePacker>(); }, all},
      {"AdaptiveSorted", [](const BenchModel& m, LengthDistribution) {
         return std::make_unique<xpm::AdaptivePacker>(
             xpm::AdaptivePackerOptions{m.memory.formula().variable_names()[1]}); }, all},
      {"FFD", [](const BenchModel&, LengthDistribution) {
         return std::make_unique<xpm::FirstFitDecreasingPacker>(); }, all},
      {"MaxTokens", [](const BenchModel& m, LengthDistribution d) {
         return std::make_unique<xpm_bench::MaxTokensBatcher>(
             1, xpm_bench::safe_max_tokens(m, xpm_bench::max_length(d, brown_lengths()))); }, all},
      {"Reference", [](const BenchModel&, LengthDistribution) {
         return std::make_unique<xpm_bench::ReferenceAdaptivePacker>(-1); }, 65536},
      {"ReferenceSorted", [](const BenchModel&, LengthDistribution) {
         return std::make_unique<xpm_bench::ReferenceAdaptivePacker>(1); }, 65536},
  };
}

struct Case {
  std::string packer;
  LengthDistribution distribution;
  std::string formula;
  std::size_t records;
};

std::size_t ffd_microbatches(const Case& c) {
  static std::map<std::tuple<int, std::string, std::size_t>, std::size_t> cache;
  const auto key = std::make_tuple(static_cast<int>(c.distribution), c.formula, c.records);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const BenchModel& model = model_for(c.formula);
    const std::size_t count = xpm::FirstFitDecreasingPacker()
                                  .pack(records_for(c.distribution, c.records), model.memory,
                                        model.usable_bytes)
                                  .microbatches.size();
    it = cache.emplace(key, count).first;
  }
  return it->second;
}

void run_case(benchmark::State& state, const Case& c, const PackerFactory& make) {
  const Records& records = records_for(c.distribution, c.records);
  const BenchModel& model = model_for(c.formula);
  const std::unique_ptr<xpm::MicrobatchPacker> packer = make(model, c.distribution);
  std::size_t microbatches = 0;
  for (auto _ : state) {
    const xpm::MicrobatchPlan plan = packer->pack(records, model.memory, model.usable_bytes);
    microbatches = plan.microbatches.size();
    benchmark::DoNotOptimize(microbatches);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(c.records));
  // Quality of the plan (deterministic: the same for every call of this case).
  static std::map<std::string, xpm_bench::PlanQuality> quality_cache;
  const std::string key = c.packer + "/" + xpm_bench::to_string(c.distribution) + "/" + c.formula + "/" +
                          std::to_string(c.records);
  auto it = quality_cache.find(key);
  if (it == quality_cache.end()) {
    const xpm::MicrobatchPlan plan = packer->pack(records, model.memory, model.usable_bytes);
    it = quality_cache.emplace(key, xpm_bench::plan_quality(plan, records, model.memory,
                                                            model.usable_bytes)).first;
  }
  const xpm_bench::PlanQuality& q = it->second;
  const auto ffd = static_cast<double>(ffd_microbatches(c));
  state.counters["microbatches"] = static_cast<double>(q.microbatches);
  state.counters["lower_bound"] = static_cast<double>(q.lower_bound);
  state.counters["vs_lower_bound"] = static_cast<double>(q.microbatches) / static_cast<double>(q.lower_bound);
  state.counters["vs_ffd"] = static_cast<double>(q.microbatches) / ffd;
  state.counters["util_mean"] = q.utilization_mean;
  state.counters["util_min"] = q.utilization_min;
  state.counters["padding_waste"] = q.padding_waste;
  state.counters["over_budget"] = static_cast<double>(q.over_budget);
  state.counters["records_per_microbatch"] = q.mean_records;
}

void register_benchmarks() {
  const std::vector<LengthDistribution> distributions = {
      LengthDistribution::kBrown, LengthDistribution::kUniform, LengthDistribution::kLogNormal,
      LengthDistribution::kBimodal};
  const std::vector<std::size_t> sizes = {64, 1024, 65536, 1048576};
  const std::vector<std::size_t> brown_sizes = {64, 1024, 16384, 65536, 262144, 1048576};
  for (const PackerKind& kind : packer_kinds()) {
    for (const std::string formula : {"quadratic", "linear", "packed"}) {
      for (LengthDistribution d : distributions) {
        for (std::size_t n : d == LengthDistribution::kBrown ? brown_sizes : sizes) {
          if (n > kind.max_records) continue;
          // Extra sizes (scaling curve) for the quadratic formula only.
          if (d == LengthDistribution::kBrown && formula != std::string("quadratic") &&
              (n == 16384 || n == 262144)) {
            continue;
          }
          const Case c{kind.name, d, formula, n};
          const std::string name = "BM_Packer_" + kind.name + "/" + xpm_bench::to_string(d) + "/" +
                                   formula + "/" + std::to_string(n);
          benchmark::RegisterBenchmark(name.c_str(), [c, make = kind.make](benchmark::State& s) {
            run_case(s, c, make);
          })->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
  // The demo's CPU budget: small microbatches, where the reference's quadratic cost matters less.
  for (const PackerKind& kind : packer_kinds()) {
    if (kind.name == "MaxTokens") continue;
    for (std::size_t n : {std::size_t{64}, std::size_t{1024}, std::size_t{65536}}) {
      const Case c{kind.name, LengthDistribution::kBrown, "quadratic-cpu", n};
      const std::string name = "BM_Packer_" + kind.name + "/brown/quadratic-cpu/" + std::to_string(n);
      benchmark::RegisterBenchmark(name.c_str(), [c, make = kind.make](benchmark::State& s) {
        run_case(s, c, make);
      })->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

// Our option first (Boost.Program_options, unknown tokens kept for Google Benchmark), then
// Google Benchmark's; a token neither takes is refused with exit code 2.
int main(int argc, char** argv) {
  namespace po = boost::program_options;
  po::options_description options("packer_bench (then Google Benchmark's --benchmark_* flags)");
  options.add_options()("data-dir", po::value(&g_data_dir)->default_value(g_data_dir),
                        "the Brown corpus folder");
  std::vector<std::string> rest;  // Google Benchmark's flags, and anything else (refused below)
  try {
    const po::parsed_options parsed =
        po::command_line_parser(argc, argv).options(options).allow_unregistered().run();
    po::variables_map vm;
    po::store(parsed, vm);
    po::notify(vm);
    rest = po::collect_unrecognized(parsed.options, po::include_positional);
  } catch (const po::error& error) {
    std::cerr << "packer_bench: error: " << error.what() << "\n";
    return 2;
  }
  try {
    brown_lengths();
  } catch (const std::exception& error) {
    std::cerr << "packer_bench: error: --data-dir: " << error.what() << "\n";
    return 2;
  }
  std::vector<char*> args = {argv[0]};
  for (std::string& token : rest) args.push_back(token.data());
  int count = static_cast<int>(args.size());
  args.push_back(nullptr);
  register_benchmarks();
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
