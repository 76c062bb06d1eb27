// Tests of device_meter.hpp: the device names, the one-line refusal of CUDA where there is none,
// and the CPU meter with its cap.
#include <stdexcept>
#include <string>

#include "../torch_doctest.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/cuda_memory_meter.hpp"
#include "xpm/planner_torch/device_meter.hpp"

TEST_CASE("training_device reads cpu, cuda and cuda:N and refuses other names in one line") {
  CHECK(xpm::training_device("cpu", "--device").is_cpu());
  for (const char* bad : {"tpu", "cuda:", "cuda:x", "cuda:-1", "CPU"}) {
    CHECK_THROWS_WITH_AS(xpm::training_device(bad, "--device"),
                         ("--device must be 'cpu', 'cuda' or 'cuda:N', got '" + std::string(bad) + "'").c_str(),
                         std::invalid_argument);
  }
}

TEST_CASE("cuda where no GPU is visible fails in one line naming the option; with GPUs it is cuda:LOCAL_RANK") {
  const bool gpus = xpm::cuda_memory_meter_available() && xpm::CudaMemoryMeter::device_count() > 0;
  if (!gpus) {
    try {
      xpm::training_device("cuda", "--device", 1);
      FAIL("no error");
    } catch (const std::invalid_argument& error) {
      const std::string message = error.what();
      CHECK(message.rfind("--device 'cuda': ", 0) == 0);
      CHECK(message.find('\n') == std::string::npos);
    }
    CHECK_THROWS_AS(xpm::training_device("cuda:0", "--device"), std::invalid_argument);
    return;
  }
  const torch::Device device = xpm::training_device("cuda", "--device", 0);
  CHECK(device.is_cuda());
  CHECK(device.index() == 0);
  CHECK_THROWS_AS(xpm::training_device("cuda:" + std::to_string(xpm::CudaMemoryMeter::device_count()), "--device"),
                  std::invalid_argument);
}

TEST_CASE("the CPU device's meter is the installed CpuMemoryMeter with the cap set") {
  const std::int64_t before = xpm::CpuMemoryMeter::instance().capacity_bytes();
  const auto meter = xpm::make_device_meter(torch::kCPU, 123'456'789);
  CHECK(meter.get() == &xpm::CpuMemoryMeter::instance());
  CHECK(meter->capacity_bytes() == 123'456'789);
  CHECK_THROWS_AS(xpm::make_device_meter(torch::kCPU, -1), std::invalid_argument);
  xpm::CpuMemoryMeter::instance().set_capacity_bytes(before);
}
