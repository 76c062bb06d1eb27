#include "../torch_doctest.hpp"

#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>

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

// LibTorch's raw interface: Allocator::raw_allocate asserts that the DataPtr's context is its
// data pointer, raw_deallocate frees through raw_deleter(). oneDNN (ideep) allocates this way.
TEST_CASE("raw_allocate and raw_deallocate on the meter are counted, capped and freed") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  c10::Allocator& allocator = meter;
  const bool has_raw_deleter = allocator.raw_deleter() != nullptr;
  REQUIRE(has_raw_deleter);
  const std::int64_t base = meter.current_allocated_bytes();
  meter.reset_peak();
  void* raw = nullptr;
  CHECK_NOTHROW(raw = allocator.raw_allocate(3 * kMiB));
  REQUIRE(raw != nullptr);
  static_cast<char*>(raw)[3 * kMiB - 1] = 1;  // the whole buffer is usable
  CHECK(meter.current_allocated_bytes() == base + 3 * kMiB);
  CHECK(meter.peak_allocated_bytes() == base + 3 * kMiB);
  allocator.raw_deallocate(raw);
  CHECK(meter.current_allocated_bytes() == base);
  CHECK(meter.peak_allocated_bytes() == base + 3 * kMiB);

  xpm::ScopedMemoryCap cap(base + kMiB);
  const std::int64_t ooms_before = meter.oom_count();
  CHECK_THROWS_AS(allocator.raw_allocate(2 * kMiB), c10::OutOfMemoryError);
  CHECK(meter.oom_count() == ooms_before + 1);
  CHECK(meter.current_allocated_bytes() == base);
}

TEST_CASE("a DataPtr of the meter rebuilt from its data pointer and raw_deleter frees its bytes") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t base = meter.current_allocated_bytes();
  c10::DataPtr original = meter.allocate(kMiB);
  CHECK(original.get_context() == original.get());
  const bool same_deleter = original.get_deleter() == meter.raw_deleter();
  CHECK(same_deleter);
  CHECK(original.cast_context<void>(meter.raw_deleter()) == original.get());
  CHECK(meter.current_allocated_bytes() == base + kMiB);
  // What another library does with a storage it takes over: keep the pointer, drop the DataPtr,
  // and later free it through a DataPtr of its own.
  void* data = original.release_context();
  CHECK(meter.current_allocated_bytes() == base + kMiB);
  {
    c10::DataPtr copy(data, data, meter.raw_deleter(), c10::Device(c10::DeviceType::CPU));
  }
  CHECK(meter.current_allocated_bytes() == base);
  c10::DataPtr empty = meter.allocate(0);
  CHECK(meter.current_allocated_bytes() == base);
}

TEST_CASE("raw memory taken before install() and freed through the meter goes back uncounted") {
  xpm::CpuMemoryMeter::uninstall();
  c10::Allocator* before = c10::GetCPUAllocator();
  void* raw = before->raw_allocate(kMiB);
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t base = meter.current_allocated_bytes();
  c10::GetCPUAllocator()->raw_deallocate(raw);
  CHECK(meter.current_allocated_bytes() == base);
}

TEST_CASE("storages of the meter freed after uninstall() are still uncounted") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t base = meter.current_allocated_bytes();
  torch::Tensor t = torch::empty({kMiB}, torch::kFloat32);
  void* raw = c10::GetCPUAllocator()->raw_allocate(kMiB);
  CHECK(meter.current_allocated_bytes() == base + 5 * kMiB);
  xpm::CpuMemoryMeter::uninstall();
  t = torch::Tensor();
  meter.raw_deallocate(raw);
  CHECK(meter.current_allocated_bytes() == base);
  xpm::CpuMemoryMeter::install();
}

// On x86 LibTorch runs these through oneDNN, which allocates through raw_allocate (on CPUs with
// AVX512-BF16 the bf16 matrix products of training_options_tests do too).
TEST_CASE("oneDNN tensors and a Conv1d forward/backward run under the meter and are counted") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  const std::int64_t base = meter.current_allocated_bytes();
  if (at::hasMKLDNN()) {
    torch::Tensor mkldnn = torch::ones({256, 256}).to_mkldnn();  // 256 KiB in an ideep buffer
    CHECK(meter.current_allocated_bytes() >= base + 256 * 1024);
    CHECK(mkldnn.to_dense().sum().item<float>() == 65536.0f);
  }
  CHECK(meter.current_allocated_bytes() == base);
  torch::nn::Conv1d conv(torch::nn::Conv1dOptions(16, 32, 3));
  meter.reset_peak();
  const std::int64_t with_weights = meter.current_allocated_bytes();
  {
    xpm::ScopedMemoryCap cap(with_weights + 64 * kMiB);
    torch::Tensor x = torch::randn({8, 16, 200});
    torch::Tensor loss = conv->forward(x).square().mean();
    CHECK_NOTHROW(loss.backward());
    CHECK(conv->weight.grad().defined());
  }
  // The activations at least: input 8*16*200 and output 8*32*198 floats.
  CHECK(meter.peak_allocated_bytes() - with_weights >= (8 * 16 * 200 + 8 * 32 * 198) * 4);
  conv->weight.mutable_grad() = torch::Tensor();
  conv->bias.mutable_grad() = torch::Tensor();
}

TEST_CASE("with caching the meter reserves segments, caps reserved bytes and releases its cache") {
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  meter.set_caching(xpm::CachingAllocatorOptions{});
  meter.empty_cache();
  const std::int64_t allocated = meter.current_allocated_bytes(), reserved = meter.current_reserved_bytes();
  {
    torch::Tensor t = torch::empty({3 * kMiB}, torch::kUInt8);  // 3 MiB: a 20 MiB segment
    CHECK(meter.current_allocated_bytes() == allocated + 3 * kMiB);
    CHECK(meter.current_reserved_bytes() == reserved + 20 * kMiB);
    torch::Tensor small = torch::empty({100}, torch::kUInt8);  // 512 B in a 2 MiB segment
    CHECK(meter.current_allocated_bytes() == allocated + 3 * kMiB + 512);
  }
  CHECK(meter.current_allocated_bytes() == allocated);
  CHECK(meter.current_reserved_bytes() == reserved + 22 * kMiB);  // cached
  meter.reset_peak();
  CHECK(meter.peak_reserved_bytes() == reserved + 22 * kMiB);
  meter.empty_cache();
  CHECK(meter.current_reserved_bytes() == reserved);

  meter.set_capacity_bytes(reserved + 10 * kMiB);  // 3 MiB allocated would fit, its segment does not
  const std::int64_t ooms = meter.oom_count();
  CHECK_THROWS_WITH_AS(torch::empty({3 * kMiB}, torch::kUInt8), doctest::Contains("bytes reserved"),
                       c10::OutOfMemoryError);
  CHECK(meter.oom_count() == ooms + 1);
  CHECK(meter.current_allocated_bytes() == allocated);
  meter.set_capacity_bytes(0);
  meter.set_caching(std::nullopt);
  CHECK_FALSE(meter.caching().has_value());
}
