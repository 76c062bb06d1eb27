// bench/benchmark_main.hpp — the start of a Google Benchmark program that also reads the Brown
// corpus: takes --data-dir PATH out of argv, hands the rest to Google Benchmark.
#pragma once

#include <benchmark/benchmark.h>

#include <cstring>
#include <string>
#include <vector>

namespace xpm_bench {

/// --data-dir PATH into `data_dir`, benchmark::Initialize with the other arguments. False when
/// one of them is not a Google Benchmark flag (it is printed; the program then exits with 2).
inline bool initialize_benchmarks(int argc, char** argv, std::string& data_dir) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--data-dir") == 0 && i + 1 < argc) {
      data_dir = argv[++i];
    } else {
      rest.push_back(argv[i]);
    }
  }
  int rest_count = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_count, rest.data());
  return !benchmark::ReportUnrecognizedArguments(rest_count, rest.data());
}

}  // namespace xpm_bench
