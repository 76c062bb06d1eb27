// probe_cases_test.cpp — the C++ side of the probe table (tests/probe_cases/cases.json): each
// case's MLP probed at its points through ProbeStateGuard, probe_steps_for and
// TorchProbeExecutor, the table's expectations checked, and the measured peaks written as JSON
// (to $XPM_PROBE_CASES_OUT, else under the build's test_scratch) for tests/python/
// test_probe_cases.py, which measures the same table in Python and compares the two.
#include "../torch_doctest.hpp"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/planner_torch/step_probing.hpp"

namespace {

nlohmann::json read_cases() {
  std::ifstream in(std::string(XPM_SOURCE_DIR) + "/tests/probe_cases/cases.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

torch::nn::Sequential mlp(const std::vector<std::int64_t>& widths) {
  return torch::nn::Sequential(torch::nn::Linear(widths.at(0), widths.at(1)), torch::nn::ReLU(),
                               torch::nn::Linear(widths.at(1), widths.at(2)));
}

std::unique_ptr<torch::optim::Optimizer> optimizer_for(const std::string& name, torch::nn::Sequential& model) {
  if (name == "adam") return std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  REQUIRE(name == "sgd_momentum");
  return std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
}

// One case: its probes' feasibility and peaks above the steady state's bytes, in table order.
nlohmann::json measure_case(const nlohmann::json& spec, xpm::CpuMemoryMeter& meter) {
  const auto widths = spec.at("widths").get<std::vector<std::int64_t>>();
  torch::manual_seed(0);
  torch::nn::Sequential model = mlp(widths);
  std::unique_ptr<torch::optim::Optimizer> optimizer = optimizer_for(spec.at("optimizer"), model);
  const xpm::ProbeLossFn loss_fn = [&](const std::vector<double>& dims) {
    return model->forward(torch::randn({static_cast<std::int64_t>(dims.at(0)), static_cast<std::int64_t>(dims.at(1)),
                                        widths.at(0)})).sum();
  };
  nlohmann::json probes = nlohmann::json::array();
  {
    xpm::ProbeStateGuard steady(*model, *optimizer);
    xpm::TorchProbeExecutor executor(xpm::probe_steps_for(*model, *optimizer, loss_fn, meter), meter);
    const double static_bytes = executor.static_bytes();
    const auto cap_above = spec.at("cap_above_static_bytes").get<std::int64_t>();
    meter.set_capacity_bytes(cap_above > 0 ? static_cast<std::int64_t>(static_bytes) + cap_above : 0);
    for (const auto& point : spec.at("points")) {
      const xpm::ProbeResult result = executor.run_probe(point.get<std::vector<double>>());
      probes.push_back({{"dims", point},
                        {"feasible", result.feasible},
                        {"forward_backward_above_static_bytes", result.forward_backward_peak_bytes - static_bytes},
                        {"optimizer_step_above_static_bytes", result.optimizer_step_peak_bytes - static_bytes}});
    }
    meter.set_capacity_bytes(0);
  }
  CHECK(optimizer->state().empty());  // the steady state's optimizer state is gone again
  return probes;
}

std::string output_path() {
  if (const char* given = std::getenv("XPM_PROBE_CASES_OUT")) return given;
  const std::filesystem::path folder = std::filesystem::path(XPM_BINARY_DIR) / "test_scratch" / "probe_cases";
  std::filesystem::create_directories(folder);
  return (folder / "cpp.json").string();
}

TEST_CASE("probe cases: the C++ probe measures the shared table as it expects, and writes the peaks") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  nlohmann::json measured = nlohmann::json::object();
  const nlohmann::json table = read_cases();
  REQUIRE(table.at("cases").size() >= 3);
  for (const auto& spec : table.at("cases")) {
    CAPTURE(spec.at("name").get<std::string>());
    const nlohmann::json probes = measure_case(spec, meter);
    const auto expected = spec.at("feasible").get<std::vector<bool>>();
    REQUIRE(probes.size() == expected.size());
    for (std::size_t k = 0; k < probes.size(); ++k) {
      CHECK(probes[k].at("feasible").get<bool>() == expected[k]);
      if (!expected[k]) continue;
      const double above = probes[k].at("forward_backward_above_static_bytes").get<double>();
      CHECK(above > 0);
      for (std::size_t j = 0; j < k; ++j) {  // a shape probed again, an out-of-memory probe between: the same peak
        if (probes[j].at("dims") == probes[k].at("dims") && expected[j]) {
          CHECK(above == probes[j].at("forward_backward_above_static_bytes").get<double>());
        }
      }
    }
    measured[spec.at("name").get<std::string>()] = probes;
  }
  xpm::write_file_atomically(output_path(), measured.dump(2) + "\n");
}

}  // namespace
