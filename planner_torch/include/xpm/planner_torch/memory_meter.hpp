// xpm/planner_torch/memory_meter.hpp — the interface the probe runner and the trainer read
// memory through: CpuMemoryMeter on CPU (and a CUDA caching-allocator meter later).
#pragma once

#include <cstdint>

namespace xpm {

class MemoryMeter {
 public:
  virtual ~MemoryMeter() = default;
  /// Bytes of live tensor storages now.
  virtual std::int64_t current_allocated_bytes() const = 0;
  /// Maximum of current_allocated_bytes() since the last reset_peak().
  virtual std::int64_t peak_allocated_bytes() const = 0;
  /// Sets the peak to the current allocated bytes.
  virtual void reset_peak() = 0;
  /// Total memory of the device or the configured cap; 0 when unlimited.
  virtual std::int64_t capacity_bytes() const = 0;
};

}  // namespace xpm
