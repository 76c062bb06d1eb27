// python_plan_bench.cpp — planning from Python against the same call in C++, in one run: the
// adaptive packer (sorted by length) over Brown sentence lengths and the Transformer bench model
// (packer_inputs.hpp), through xpm.plan in an embedded interpreter (the record dims a NumPy
// array made once, outside the timed loop) and as AdaptivePacker::pack in C++.
//
//   BM_Plan_Cpp/<records>: pack(RecordDimsView) over one contiguous [records, 2] buffer, the
//     primary entry point (the dims read in place, as the Python module reads NumPy's buffer).
//   BM_Plan_CppRows/<records>: pack(std::vector<std::vector<double>>), one vector per record,
//     adapted to a view (one copy of the dims).
//   BM_Plan_Python/<records>: xpm.plan(dims, model, usable_bytes, sort_by="l"), the plan's
//     arrays made.
//   items_per_second is records/s; the counter microbatches the plan's length (the same in all).
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
#include "xpm/planner/record_dims_view.hpp"

namespace py = pybind11;

namespace {

std::string g_data_dir = "data/brown";

const xpm_bench::Records& records(std::size_t n) { return xpm_bench::cached_brown_batch(g_data_dir, n); }

// The records' dims contiguous, row-major: what a NumPy [n, 2] float64 array holds.
std::vector<double> contiguous(const xpm_bench::Records& input) {
  std::vector<double> dims;
  dims.reserve(input.size() * 2);
  for (const std::vector<double>& record : input) dims.insert(dims.end(), record.begin(), record.end());
  return dims;
}

void BM_Plan_Cpp(benchmark::State& state) {
  const auto& input = records(static_cast<std::size_t>(state.range(0)));
  const std::vector<double> dims = contiguous(input);
  const xpm::RecordDimsView view(dims.data(), input.size(), 2);
  const xpm_bench::BenchModel model = xpm_bench::bench_model(xpm_bench::BenchFormula::kQuadratic);
  const xpm::AdaptivePacker packer(xpm::AdaptivePackerOptions{"l"});
  std::size_t microbatches = 0;
  for (auto _ : state) {
    const xpm::MicrobatchPlan plan = packer.pack(view, model.memory, model.usable_bytes);
    microbatches = plan.microbatches.size();
    benchmark::DoNotOptimize(microbatches);
  }
  state.counters["microbatches"] = static_cast<double>(microbatches);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_Plan_CppRows(benchmark::State& state) {
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
  const std::vector<double> flat = contiguous(input);
  py::array_t<double> dims({static_cast<py::ssize_t>(input.size()), py::ssize_t{2}}, flat.data());  // a copy
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
BENCHMARK(BM_Plan_CppRows)->Arg(65536)->Arg(1 << 20)->Unit(benchmark::kMillisecond);
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
