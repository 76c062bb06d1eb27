// python_plan_bench.cpp — planning from Python against the same call in C++, in one run: the
// adaptive packer (sorted by length) over 1M Brown sentence lengths and the Transformer bench
// model (packer_inputs.hpp), once through xpm.plan in an embedded interpreter (the record dims
// a NumPy array made once, outside the timed loop), once as AdaptivePacker::pack in C++.
//
//   BM_Plan_Cpp/<records>, BM_Plan_Python/<records>: one plan; items_per_second is records/s.
//
// The Python package is the build's (XPM_PYTHON_PACKAGE_PARENT); the interpreter the one it was
// built for. Extra option: --data-dir PATH (the Brown corpus, default data/brown).
#include <benchmark/benchmark.h>
#include <pybind11/embed.h>
#include <pybind11/numpy.h>

#include <iostream>
#include <string>
#include <vector>

#include "benchmark_main.hpp"
#include "packer_inputs.hpp"
#include "xpm/planner/packer.hpp"

namespace py = pybind11;

namespace {

std::string g_data_dir = "data/brown";

const xpm_bench::Records& records(std::size_t n) { return xpm_bench::cached_brown_batch(g_data_dir, n); }

void BM_Plan_Cpp(benchmark::State& state) {
  const auto& input = records(static_cast<std::size_t>(state.range(0)));
  const xpm_bench::BenchModel model = xpm_bench::bench_model(xpm_bench::BenchFormula::kQuadratic);
  const xpm::AdaptivePacker packer(xpm::AdaptivePackerOptions{"l"});
  std::size_t microbatches = 0;
  for (auto _ : state) {
    const xpm::MicrobatchPlan plan = packer.pack(input, model.memory, model.usable_bytes);
    microbatches = plan.microbatches.size();
    benchmark::DoNotOptimize(microbatches);
  }
  state.counters["microbatches"] = static_cast<double>(microbatches);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_Plan_Python(benchmark::State& state) {
  const auto& input = records(static_cast<std::size_t>(state.range(0)));
  const xpm_bench::BenchModel model = xpm_bench::bench_model(xpm_bench::BenchFormula::kQuadratic);
  py::module_ xpm = py::module_::import("xpm");
  py::array_t<double> dims({static_cast<py::ssize_t>(input.size()), py::ssize_t{2}});
  auto d = dims.mutable_unchecked<2>();
  for (std::size_t i = 0; i < input.size(); ++i) {
    d(i, 0) = input[i][0];
    d(i, 1) = input[i][1];
  }
  py::object memory = xpm.attr("MemoryModel").attr("from_json")(model.memory.to_json().dump());
  py::object plan = xpm.attr("plan");
  py::object sort_by = py::str("l");
  std::size_t microbatches = 0;
  for (auto _ : state) {
    py::object result = plan(dims, memory, model.usable_bytes, py::arg("sort_by") = sort_by);
    microbatches = py::len(result);
  }
  state.counters["microbatches"] = static_cast<double>(microbatches);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

BENCHMARK(BM_Plan_Cpp)->Arg(65536)->Arg(1 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Plan_Python)->Arg(65536)->Arg(1 << 20)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  if (!xpm_bench::initialize_benchmarks(argc, argv, g_data_dir)) return 2;
  py::scoped_interpreter interpreter;
  py::module_::import("sys").attr("path").attr("insert")(0, XPM_PYTHON_PACKAGE_PARENT);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
