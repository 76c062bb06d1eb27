// xpm/planner_torch/cuda_memory_meter.hpp — allocated and reserved bytes of one GPU from
// LibTorch's CUDA caching allocator, the GPU counterpart of CpuMemoryMeter.
//
//   if (cuda_memory_meter_available() && CudaMemoryMeter::device_count() > 0) {
//     CudaMemoryMeter meter(local_rank);          // device index = local rank (docs/cuda.md)
//     meter.set_memory_fraction(0.5);             // optional cap: the allocator refuses beyond it
//     meter.reset_peak();
//     run_step();                                 // may throw c10::OutOfMemoryError
//     std::int64_t peak = meter.peak_allocated_bytes();
//   }
//
// What it reads (c10::cuda::CUDACachingAllocator::getDeviceStats, the numbers behind
// torch.cuda.max_memory_allocated / memory_reserved): "allocated" is the bytes of live tensor
// blocks, "reserved" what the allocator holds from cudaMalloc (allocated + cached free blocks).
// The planner models allocated bytes, the quantity CpuMemoryMeter counts on CPU; the gap to
// reserved (fragmentation) is covered by memory_fraction and extra_overhead_bytes. Probes do not
// call empty_cache between them, so the cache and its fragmentation evolve as in training.
//
// Out-of-memory errors: the caching allocator throws c10::OutOfMemoryError (after freeing its
// cache and retrying), the same type CpuMemoryMeter's cap throws, so the probe runner and the
// batchers handle both alike.
//
// Built only with a CUDA-enabled LibTorch (CMake sets XPM_WITH_CUDA; docs/cuda.md). Without it
// the class still exists and its constructor throws std::runtime_error saying so, so callers need
// no #ifdef. Single process, one device per process; not thread-safe against reset_peak() calls
// from other threads.
#pragma once

#include <cstdint>

#include "xpm/planner_torch/memory_meter.hpp"

namespace xpm {

/// True when this build has the CUDA meter (built against a CUDA-enabled LibTorch).
bool cuda_memory_meter_available();

class CudaMemoryMeter final : public MemoryMeter {
 public:
  /// Meter of device `device_index` (0-based, after CUDA_VISIBLE_DEVICES). Throws
  /// std::runtime_error when this build has no CUDA, and std::invalid_argument naming the index
  /// when it is not in [0, device_count()).
  explicit CudaMemoryMeter(int device_index);

  /// Bytes of live tensor blocks on the device (allocator stat allocated_bytes, current).
  std::int64_t current_allocated_bytes() const override;
  /// Maximum of current_allocated_bytes() since the last reset_peak().
  std::int64_t peak_allocated_bytes() const override;
  /// True: the caching allocator's reserved bytes are what runs the device out of memory.
  bool reserves_segments() const override { return true; }
  /// Bytes the caching allocator holds from the driver (allocated + cached free blocks).
  std::int64_t current_reserved_bytes() const override;
  std::int64_t peak_reserved_bytes() const override;
  /// Releases the caching allocator's unused cached blocks (c10 emptyCache).
  void empty_cache() override;
  /// Resets the allocator's peak statistics of this device (c10 resetPeakStats).
  void reset_peak() override;
  /// The device's total memory (cudaMemGetInfo) times the memory fraction set, if any.
  std::int64_t capacity_bytes() const override;
  /// The device's total memory in bytes, whatever the fraction.
  std::int64_t total_device_bytes() const;
  /// Caps this process's allocations on the device at `fraction` x total memory (the caching
  /// allocator's per-process memory fraction; beyond it allocations throw
  /// c10::OutOfMemoryError). Throws std::invalid_argument unless 0 < fraction <= 1.
  void set_memory_fraction(double fraction);
  int device_index() const { return device_index_; }

  /// Number of visible CUDA devices; 0 without CUDA (no throw).
  static int device_count();

 private:
  int device_index_;
  double memory_fraction_ = 1.0;
};

}  // namespace xpm
