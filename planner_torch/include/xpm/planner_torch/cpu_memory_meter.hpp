// xpm/planner_torch/cpu_memory_meter.hpp — current and peak allocated bytes of LibTorch CPU
// tensors, with an optional hard cap that raises c10::OutOfMemoryError.
//
//   CpuMemoryMeter& meter = CpuMemoryMeter::install();   // wraps c10's CPU allocator
//   meter.set_capacity_bytes(256 << 20);                  // optional cap (0 = none)
//   meter.reset_peak();
//   run_step();                                            // may throw c10::OutOfMemoryError
//   int64_t peak = meter.peak_allocated_bytes();
//
// This is how xpm plans memory on CPU and how OOM paths are tested without a GPU: the same
// exception type as CUDA's caching allocator raises, at the same place (tensor allocation).
//
// What it sees: every tensor storage allocated through c10's CPU allocator while it is installed
// (weights, gradients, optimizer state, activations, autograd-saved tensors, temporaries).
// What it does not see: memory that does not go through c10::GetCPUAllocator() — malloc/new in
// operator implementations (oneDNN/MKL/OpenBLAS scratch buffers, autograd graph nodes, std
// containers), thread stacks, the allocator's own bookkeeping, tensors created with from_blob,
// and storages allocated before install() (they are freed without being counted). Allocated
// bytes are the requested sizes, not what malloc rounds to. So it measures the same quantity as
// CUDA's "allocated_bytes" (tensor storages), not the process RSS.
#pragma once

#include <atomic>
#include <cstdint>

#include <c10/core/Allocator.h>

#include "xpm/planner_torch/memory_meter.hpp"

namespace xpm {

class CpuMemoryMeter final : public c10::Allocator, public MemoryMeter {
 public:
  /// Installs the process-wide meter as LibTorch's CPU allocator (idempotent) and returns it.
  /// Not thread-safe against concurrent install()/uninstall(); counting itself is thread-safe.
  static CpuMemoryMeter& install();
  /// Restores the allocator that was active before install(). Storages allocated through the
  /// meter stay valid and are still subtracted when freed.
  static void uninstall();
  /// The process-wide meter (installed or not).
  static CpuMemoryMeter& instance();

  /// Bytes of live tensor storages allocated through the meter.
  std::int64_t current_allocated_bytes() const override { return current_bytes_.load(); }
  /// Maximum of current_allocated_bytes() since the last reset_peak().
  std::int64_t peak_allocated_bytes() const override { return peak_bytes_.load(); }
  /// Sets the peak to the current allocated bytes.
  void reset_peak() override;
  /// Hard cap on current allocated bytes; 0 disables it. An allocation that would exceed it
  /// throws c10::OutOfMemoryError and changes no counter. Throws std::invalid_argument if < 0.
  void set_capacity_bytes(std::int64_t capacity_bytes);
  std::int64_t capacity_bytes() const override { return capacity_bytes_.load(); }
  /// Number of allocations refused by the cap since the process started.
  std::int64_t oom_count() const { return oom_count_.load(); }

  c10::DataPtr allocate(size_t n_bytes) const override;
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

 private:
  CpuMemoryMeter() = default;
  void on_free(std::int64_t n_bytes) const;
  static void delete_tracked(void* context);

  c10::Allocator* wrapped_ = nullptr;
  mutable std::atomic<std::int64_t> current_bytes_{0};
  mutable std::atomic<std::int64_t> peak_bytes_{0};
  mutable std::atomic<std::int64_t> oom_count_{0};
  std::atomic<std::int64_t> capacity_bytes_{0};
};

/// RAII: installs the meter, sets a cap and restores the previous cap on destruction.
class ScopedMemoryCap {
 public:
  explicit ScopedMemoryCap(std::int64_t capacity_bytes);
  ~ScopedMemoryCap();
  ScopedMemoryCap(const ScopedMemoryCap&) = delete;
  ScopedMemoryCap& operator=(const ScopedMemoryCap&) = delete;

 private:
  std::int64_t previous_capacity_bytes_;
};

}  // namespace xpm
