#include "../torch_doctest.hpp"

#include <string>

#include <torch/torch.h>

#include "xpm/planner_torch/cuda_memory_meter.hpp"

namespace {
constexpr std::int64_t kCudaTestMiB = 1 << 20;
}

#ifndef XPM_WITH_CUDA

TEST_CASE("without a CUDA LibTorch the CUDA meter says so instead of measuring") {
  CHECK_FALSE(xpm::cuda_memory_meter_available());
  CHECK(xpm::CudaMemoryMeter::device_count() == 0);
  std::string message;
  try {
    xpm::CudaMemoryMeter meter(0);
  } catch (const std::runtime_error& error) {
    message = error.what();
  }
  CHECK(message.find("LibTorch without CUDA") != std::string::npos);
  CHECK(message.find("Torch_DIR") != std::string::npos);
}

#else  // a CUDA LibTorch: these run on a GPU machine (tools/device-check.sh)

TEST_CASE("the CUDA meter counts a known allocation and reset_peak lowers the peak to current") {
  REQUIRE(xpm::CudaMemoryMeter::device_count() > 0);
  xpm::CudaMemoryMeter meter(0);
  torch::cuda::synchronize();
  const std::int64_t base = meter.current_allocated_bytes();
  meter.reset_peak();
  {
    torch::Tensor t = torch::empty({16 * kCudaTestMiB}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32));
    // The caching allocator rounds blocks up (to 512 bytes; large ones to 2 MiB segments for
    // reserved, not for allocated): 64 MiB is a multiple of both.
    CHECK(meter.current_allocated_bytes() == base + 64 * kCudaTestMiB);
    CHECK(meter.peak_allocated_bytes() == base + 64 * kCudaTestMiB);
    CHECK(meter.current_reserved_bytes() >= meter.current_allocated_bytes());
  }
  CHECK(meter.current_allocated_bytes() == base);
  CHECK(meter.peak_allocated_bytes() == base + 64 * kCudaTestMiB);
  meter.reset_peak();
  CHECK(meter.peak_allocated_bytes() == base);
}

TEST_CASE("the CUDA meter's capacity is the device memory and a memory fraction caps allocations") {
  xpm::CudaMemoryMeter meter(0);
  const std::int64_t total = meter.total_device_bytes();
  CHECK(total > 1024 * kCudaTestMiB);
  CHECK(meter.capacity_bytes() == total);
  meter.set_memory_fraction(0.25);
  CHECK(meter.capacity_bytes() == total / 4);
  bool oom = false;
  try {
    torch::Tensor t = torch::empty({total / 2}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kUInt8));
  } catch (const c10::OutOfMemoryError&) {
    oom = true;
  }
  CHECK(oom);
  meter.set_memory_fraction(1.0);
  CHECK_THROWS_AS(meter.set_memory_fraction(0.0), std::invalid_argument);
  CHECK_THROWS_AS(xpm::CudaMemoryMeter(xpm::CudaMemoryMeter::device_count()), std::invalid_argument);
}

#endif
