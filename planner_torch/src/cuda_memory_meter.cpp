// CudaMemoryMeter over LibTorch's CUDA caching allocator. Compiled only with a CUDA-enabled
// LibTorch (XPM_WITH_CUDA) and, without one, by the header compile check (XPM_CUDA_HEADER_CHECK)
// against Debian's c10/cuda headers and the CUDA toolkit's, so a change that breaks it shows on
// CPU machines too. The other build uses cuda_memory_meter_unavailable.cpp.
#include "xpm/planner_torch/cuda_memory_meter.hpp"

#include <cstddef>
#include <stdexcept>
#include <string>

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

namespace xpm {
namespace {

namespace allocator = c10::cuda::CUDACachingAllocator;

// StatType::AGGREGATE (all pools) is index 0 of each StatArray in LibTorch 1.13 and 2.x, where
// the enum moved namespaces (c10/core/CachingDeviceAllocator.h); naming the index keeps one
// source for both.
constexpr std::size_t kAggregate = 0;

allocator::DeviceStats stats_of(int device_index) { return allocator::getDeviceStats(device_index); }

}  // namespace

bool cuda_memory_meter_available() { return true; }

int CudaMemoryMeter::device_count() { return static_cast<int>(c10::cuda::device_count()); }

CudaMemoryMeter::CudaMemoryMeter(int device_index) : device_index_(device_index) {
  const int count = device_count();
  if (device_index < 0 || device_index >= count) {
    throw std::invalid_argument("CudaMemoryMeter: device index " + std::to_string(device_index) +
                                " is not one of the " + std::to_string(count) +
                                " visible CUDA devices (CUDA_VISIBLE_DEVICES applies)");
  }
  // The caching allocator keeps no statistics of a device before CUDA's lazy initialisation
  // (the first CUDA tensor): getDeviceStats would throw "Invalid device argument".
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
}

std::int64_t CudaMemoryMeter::current_allocated_bytes() const {
  return stats_of(device_index_).allocated_bytes[kAggregate].current;
}

std::int64_t CudaMemoryMeter::peak_allocated_bytes() const {
  return stats_of(device_index_).allocated_bytes[kAggregate].peak;
}

std::int64_t CudaMemoryMeter::current_reserved_bytes() const {
  return stats_of(device_index_).reserved_bytes[kAggregate].current;
}

std::int64_t CudaMemoryMeter::peak_reserved_bytes() const {
  return stats_of(device_index_).reserved_bytes[kAggregate].peak;
}

void CudaMemoryMeter::reset_peak() { allocator::resetPeakStats(device_index_); }

void CudaMemoryMeter::empty_cache() { allocator::emptyCache(); }

std::int64_t CudaMemoryMeter::total_device_bytes() const {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
  std::size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (status != cudaSuccess) {
    throw std::runtime_error("CudaMemoryMeter: cudaMemGetInfo on device " +
                             std::to_string(device_index_) + " failed: " + cudaGetErrorString(status));
  }
  return static_cast<std::int64_t>(total_bytes);
}

std::int64_t CudaMemoryMeter::capacity_bytes() const {
  return static_cast<std::int64_t>(memory_fraction_ * static_cast<double>(total_device_bytes()));
}

void CudaMemoryMeter::set_memory_fraction(double fraction) {
  if (!(fraction > 0 && fraction <= 1)) {
    throw std::invalid_argument("CudaMemoryMeter::set_memory_fraction: fraction must be in (0, 1], got " +
                                std::to_string(fraction));
  }
  allocator::setMemoryFraction(fraction, device_index_);
  memory_fraction_ = fraction;
}

}  // namespace xpm
