#include "../torch_doctest.hpp"

#include <torch/torch.h>

#include "xpm/planner_torch/cpu_memory_meter.hpp"

namespace {
constexpr std::int64_t kMiB = 1 << 20;
}

TEST_CASE("the meter's peak tracks a known allocation and reset_peak lowers it to current") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  meter.reset_peak();
  const std::int64_t base = meter.current_allocated_bytes();
  {
    torch::Tensor t = torch::empty({kMiB}, torch::kFloat32);  // 4 MiB
    CHECK(meter.current_allocated_bytes() == base + 4 * kMiB);
    CHECK(meter.peak_allocated_bytes() >= base + 4 * kMiB);
  }
  CHECK(meter.current_allocated_bytes() == base);
  CHECK(meter.peak_allocated_bytes() >= base + 4 * kMiB);
  meter.reset_peak();
  CHECK(meter.peak_allocated_bytes() == base);
}

TEST_CASE("the cap throws c10::OutOfMemoryError and leaves the meter consistent") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t base = meter.current_allocated_bytes();
  const std::int64_t ooms_before = meter.oom_count();
  {
    xpm::ScopedMemoryCap cap(base + 2 * kMiB);
    meter.reset_peak();
    CHECK_THROWS_AS(torch::empty({kMiB}, torch::kFloat32), c10::OutOfMemoryError);
    CHECK(meter.current_allocated_bytes() == base);
    CHECK(meter.peak_allocated_bytes() == base);
    CHECK(meter.oom_count() == ooms_before + 1);
    torch::Tensor small = torch::ones({1024}, torch::kFloat32);  // 4 KiB still fits
    CHECK(small.sum().item<float>() == 1024.0f);
    CHECK(meter.current_allocated_bytes() == base + 4096);
  }
  CHECK(meter.capacity_bytes() == 0);
  CHECK(meter.current_allocated_bytes() == base);
}

TEST_CASE("the OOM message names the request and the capacity") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  xpm::ScopedMemoryCap cap(meter.current_allocated_bytes() + 1024);
  try {
    (void)torch::empty({4096}, torch::kFloat32);
    FAIL("expected c10::OutOfMemoryError");
  } catch (const c10::OutOfMemoryError& error) {
    const std::string message = error.what_without_backtrace();
    CHECK(message.find("tried to allocate 16384 bytes") != std::string::npos);
    CHECK(message.find("capacity of") != std::string::npos);
  }
}

TEST_CASE("the meter rejects a negative capacity") {
  CHECK_THROWS_AS(xpm::CpuMemoryMeter::instance().set_capacity_bytes(-1), std::invalid_argument);
}
