// packer_bench.cpp — microbatch packers on synthetic log-normal record lengths.
//   BM_<Packer>_<Variant>/<records>: one pack() of an outer batch of that many records.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "xpm/planner/packer.hpp"

namespace {

// a*bs*l^2 + b*bs*l + c, lengths aggregated by max (a Transformer-like activation cost).
xpm::MemoryModel bench_model() {
  return xpm::MemoryModel(
      xpm::CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
      {64.0, 8192.0, 1e9}, 0, "bs", {{"l", xpm::DimAggregation::kMax}});
}

std::vector<std::vector<double>> synthetic_records(std::int64_t n) {
  std::mt19937 rng(42);
  std::lognormal_distribution<double> length(5.0, 0.7);  // median ~148 tokens
  std::vector<std::vector<double>> records(static_cast<std::size_t>(n));
  for (auto& r : records) r = {0.0, std::min(4096.0, std::max(1.0, std::round(length(rng))))};
  return records;
}

constexpr std::int64_t kUsableBytes = std::int64_t{8} << 30;  // 8 GiB

void run_packer(benchmark::State& state, const xpm::MicrobatchPacker& packer) {
  const auto model = bench_model();
  const auto records = synthetic_records(state.range(0));
  std::size_t microbatches = 0;
  for (auto _ : state) {
    const xpm::MicrobatchPlan plan = packer.pack(records, model, kUsableBytes);
    microbatches = plan.microbatches.size();
    benchmark::DoNotOptimize(microbatches);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.counters["microbatches"] = static_cast<double>(microbatches);
}

void BM_AdaptivePacker_Sorted(benchmark::State& state) {
  xpm::AdaptivePackerOptions options;
  options.sort_by = "l";
  run_packer(state, xpm::AdaptivePacker(options));
}

void BM_AdaptivePacker_Unsorted(benchmark::State& state) {
  run_packer(state, xpm::AdaptivePacker());
}

void BM_UniformPacker_RecordOrder(benchmark::State& state) {
  run_packer(state, xpm::UniformPacker());
}

}  // namespace

BENCHMARK(BM_AdaptivePacker_Sorted)->Arg(1 << 10)->Arg(1 << 16);
BENCHMARK(BM_AdaptivePacker_Unsorted)->Arg(1 << 10)->Arg(1 << 16);
BENCHMARK(BM_UniformPacker_RecordOrder)->Arg(1 << 10)->Arg(1 << 16);

BENCHMARK_MAIN();
