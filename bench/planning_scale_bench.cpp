// planning_scale_bench.cpp — the planning work of one data-parallel step on one rank, simulated
// at world sizes 8 to 4096 and global batches up to 4M Brown sentence lengths: each record's
// predicted marginal cost, the units that fit, the rank assignment (longest processing time
// first, every rank computes the same), and the packing of this rank's share (adaptive, sorted
// by length). No collectives run; their sizes per step are counters.
//
//   BM_StepPlanning/<world>/<records>: one step's planning on rank 0 (Transformer bench model,
//   c + 1 GiB usable, packer_inputs.hpp).
//
// Counters: imbalance (max / mean predicted cost over ranks), my_records, my_microbatches,
// status_bytes (the step's status all-reduce: 8 x (2 + 2w + w x dims + 1)), peaks_bytes (the
// microbatch-peak all-reduce: 8 x w x max microbatches per rank x (dims + 2); it grows with the
// microbatches), collectives (per step, besides the gradient buckets: status, peaks, step peak).
// Extra option: --data-dir PATH (the Brown corpus, default data/brown).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "benchmark_main.hpp"
#include "packer_inputs.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/rank_assignment.hpp"

namespace {

std::string g_data_dir = "data/brown";

const xpm_bench::Records& records(std::size_t n) { return xpm_bench::cached_brown_batch(g_data_dir, n); }

void BM_StepPlanning(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const xpm_bench::Records& global = records(static_cast<std::size_t>(state.range(1)));
  const xpm_bench::BenchModel model = xpm_bench::bench_model(xpm_bench::BenchFormula::kQuadratic);
  const xpm::AdaptivePacker packer(xpm::AdaptivePackerOptions{"l"});
  const auto usable = static_cast<double>(model.usable_bytes);
  xpm::RankAssignment assignment;
  xpm::MicrobatchPlan plan;
  double units = 0;
  for (auto _ : state) {
    const std::vector<double> costs = xpm::record_costs_bytes(
        model.memory, global, model.usable_bytes,
        std::max<std::int64_t>(1, (static_cast<std::int64_t>(global.size()) + world - 1) / world));
    units = 0;
    for (const auto& dims : global) units += model.memory.fits(dims, usable) ? dims[1] : 0;
    assignment = xpm::assign_records_to_ranks(costs, world);
    std::vector<std::vector<double>> mine;
    for (std::size_t i : assignment.records_per_rank[0]) mine.push_back(global[i]);
    plan = packer.pack(mine, model.memory, model.usable_bytes);
    benchmark::DoNotOptimize(units);
  }
  const double dims = 2, w = world;
  state.counters["imbalance"] = assignment.imbalance();
  state.counters["my_records"] = static_cast<double>(assignment.records_per_rank[0].size());
  state.counters["my_microbatches"] = static_cast<double>(plan.microbatches.size());
  state.counters["status_bytes"] = 8 * (2 + 2 * w + w * dims + 1);
  state.counters["peaks_bytes"] = 8 * w * static_cast<double>(plan.microbatches.size()) * (dims + 2);
  state.counters["collectives"] = 3;
  state.SetItemsProcessed(state.iterations() * state.range(1));
}

BENCHMARK(BM_StepPlanning)
    ->ArgsProduct({{8, 64, 512, 1024, 4096}, {1 << 16, 1 << 20, 1 << 22}})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);

}  // namespace

int main(int argc, char** argv) {
  if (!xpm_bench::initialize_benchmarks(argc, argv, g_data_dir)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
