#include "../torch_doctest.hpp"

#include <torch/torch.h>

#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"

namespace {

// A model whose activations grow with bs * l: a linear layer applied to [bs, l, 64] inputs.
struct ProbeFixture {
  torch::nn::Linear layer{torch::nn::LinearOptions(64, 64)};
  torch::optim::AdamW optimizer{layer->parameters(), torch::optim::AdamWOptions(0.0)};
  xpm::TorchProbeSteps steps() {
    xpm::TorchProbeSteps s;
    s.forward_backward = [this](const std::vector<double>& dims) {
      auto x = torch::randn({static_cast<std::int64_t>(dims[0]), static_cast<std::int64_t>(dims[1]), 64});
      layer(x).relu().sum().backward();
    };
    s.optimizer_step = [this] { optimizer.step(); };
    s.zero_grad = [this] { optimizer.zero_grad(); };
    return s;
  }
};

}  // namespace

TEST_CASE("a probe measures a larger forward/backward peak for a larger batch") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  ProbeFixture fixture;
  xpm::TorchProbeExecutor executor(fixture.steps(), meter);
  const xpm::ProbeResult small = executor.run_probe({2, 16});
  const xpm::ProbeResult large = executor.run_probe({8, 16});
  REQUIRE(small.feasible);
  REQUIRE(large.feasible);
  // The input alone is 8*16*64*4 bytes; the peak grows by at least the input's growth.
  CHECK(large.forward_backward_peak_bytes - small.forward_backward_peak_bytes >= 6 * 16 * 64 * 4);
  CHECK(large.optimizer_step_peak_bytes >= executor.static_bytes());
  CHECK(large.step_peak_bytes() >= large.forward_backward_peak_bytes);
}

TEST_CASE("a probe that runs out of memory is reported infeasible, not thrown") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  ProbeFixture fixture;
  xpm::TorchProbeExecutor executor(fixture.steps(), meter);
  executor.run_probe({1, 1});  // allocates gradients and optimizer state
  const std::int64_t cap_bytes = meter.current_allocated_bytes() + 64 * 1024;
  xpm::ScopedMemoryCap cap(cap_bytes);
  const xpm::ProbeResult probe = executor.run_probe({64, 64});  // 1 MiB input alone
  CHECK_FALSE(probe.feasible);
  CHECK(probe.error.find("CPU memory cap exceeded") != std::string::npos);
  CHECK(probe.capacity_bytes == static_cast<double>(cap_bytes));  // the bound the fit will use
}

TEST_CASE("probing with a learning rate of 0 leaves the parameters bitwise unchanged") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  ProbeFixture fixture;
  const torch::Tensor before = fixture.layer->weight.detach().clone();
  xpm::TorchProbeExecutor executor(fixture.steps(), meter);
  for (int i = 0; i < 3; ++i) executor.run_probe({4, 8});
  CHECK(torch::equal(before, fixture.layer->weight.detach()));
}

TEST_CASE("the predictive batcher fits measured probes of a real step and predicts held-out shapes") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  ProbeFixture fixture;
  xpm::TorchProbeExecutor executor(fixture.steps(), meter);
  executor.run_probe({1, 1});
  xpm::PredictiveBatcherOptions options;
  options.formula = xpm::CostFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"});
  options.probe_points = {{{{"bs", 4}, {"l", 32}}}, {{{"bs", 8}, {"l", 32}}},
                          {{{"bs", 16}, {"l", 64}}}, {{{"bs", 32}, {"l", 64}}}};
  options.budget = {std::int64_t{1} << 30, 0.9, 0};
  xpm::PredictiveBatcher batcher(options, std::make_shared<xpm::AdaptivePacker>());
  const xpm::MemoryModel& model = batcher.probe_and_fit(executor);
  CHECK(batcher.fit_summary().converged);
  CHECK(batcher.fit_summary().max_rel_error < 1e-3);
  const xpm::ProbeResult held_out = executor.run_probe({24, 48});
  const double predicted = model.predict_bytes({24, 48});
  CHECK(std::abs(predicted - held_out.step_peak_bytes()) / held_out.step_peak_bytes() < 0.01);
}

TEST_CASE("a probe without optimizer state under-predicts; ours allocates it and measures more") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  torch::nn::Linear layer(torch::nn::LinearOptions(256, 256));
  // Naive: forward + backward of a fresh model, no gradients or optimizer state beforehand.
  meter.reset_peak();
  layer(torch::randn({4, 256})).sum().backward();
  const double naive_bytes = static_cast<double>(meter.peak_allocated_bytes());
  // Ours: the full step with AdamW's state allocated, as in training.
  ProbeFixture fixture;  // a 64x64 layer: compare like with like below
  torch::optim::AdamW optimizer(layer->parameters(), torch::optim::AdamWOptions(0.0));
  xpm::TorchProbeSteps steps;
  steps.forward_backward = [&](const std::vector<double>& dims) {
    layer(torch::randn({static_cast<std::int64_t>(dims[0]), 256})).sum().backward();
  };
  steps.optimizer_step = [&] { optimizer.step(); };
  steps.zero_grad = [&] { optimizer.zero_grad(); };
  xpm::TorchProbeExecutor executor(steps, meter);
  executor.run_probe({4, 1});  // allocates the AdamW state
  const xpm::ProbeResult probe = executor.run_probe({4, 1});
  // AdamW keeps two moments per parameter: 2 x (256*256 + 256) floats more than the naive probe.
  CHECK(probe.step_peak_bytes() - naive_bytes >= 2.0 * (256 * 256 + 256) * 4);
}
