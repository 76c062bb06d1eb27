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
// What it sees: every storage allocated through c10's CPU allocator while it is installed, by
// every entry point LibTorch and the libraries under it use:
//  - Allocator::allocate: tensor storages (weights, gradients, optimizer state, activations,
//    autograd-saved tensors, temporaries);
//  - Allocator::raw_allocate / raw_deallocate and raw_deleter(): raw buffers, e.g. oneDNN
//    (ideep) tensors and scratch memory of its convolutions and bf16 matrix products, which
//    LibTorch takes this way on CPUs where oneDNN runs them (x86 with AVX2 for convolutions at
//    batch size >= 2, AVX512-BF16/AMX for bf16 matrix products);
//  - DataPtrs copied or rebuilt by other code from (data, context, deleter): the meter's
//    DataPtrs carry their data pointer as context and one static deleter (raw_deleter()), so a
//    copy frees and uncounts like the original.
// Raw allocations are counted and capped like any other (an over-cap raw_allocate throws
// c10::OutOfMemoryError). A raw pointer freed through raw_deallocate() that the meter did not
// allocate (taken before install()) is passed to the previous allocator's raw deleter.
// What it does not see: memory that does not go through c10::GetCPUAllocator(): malloc/new in
// operator implementations (oneDNN primitive caches, OpenBLAS buffers, autograd graph nodes,
// std containers), the heap of other libraries, thread stacks, tensors made with from_blob,
// and storages allocated before install() (they are freed without being counted). Allocated
// bytes are the requested sizes, not what malloc rounds to. So it measures the same quantity as
// CUDA's "allocated_bytes" (tensor storages), not the process RSS. How large the unseen part is,
// measured for the bundled models (glibc's heap in use sampled at every tensor allocation of a
// training step, bench/meter_unseen_main.cpp; docs/benchmarks.md, "What the CPU meter does not
// see"): for the Transformer tagger at most 0.09 MB at any shape (under 0.04 % of the step's
// peak); for the BiLSTM tagger, LibTorch's LSTM working memory, which grows with the shape:
// 11.9 MB at bs 32, l 180, 6.1 % of that step's 194 MB peak. A cap enforced by the meter is
// exceeded in the process by that much. What a step leaves behind unseen (oneDNN's primitive
// caches) is at most 0.06 MB.
//
// Caching (set_caching): the meter can also play CUDA's caching allocator over the storages it
// counts (xpm/planner/caching_allocator_emulation.hpp: 512-byte blocks, 2 and 20 MiB segments,
// best fit, split and merge, a cache released and retried before out of memory, optionally
// expandable segments), so that what binds on a GPU, reserved bytes, binds here:
//
//   meter.set_caching(CachingAllocatorOptions{});   // from now on; std::nullopt stops it
//   meter.set_capacity_bytes(512 << 20);             // now a cap on *reserved* bytes
//   meter.reset_peak();  run_step();
//   int64_t reserved = meter.peak_reserved_bytes();  // segments held at the peak, cache included
//   meter.empty_cache();                             // torch.cuda.empty_cache()'s counterpart
//
// Allocated bytes then count block sizes (requests rounded up to 512 B, or a whole segment the
// allocator would not split), as CUDA's allocated_bytes do. The memory itself still comes from
// the wrapped allocator at the requested size: the emulation is bookkeeping only. Storages
// allocated before caching started are counted in reserved bytes at their own size.
//
// Thread-safety: counting is thread-safe (atomics; live storages in a sharded, locked table keyed
// by address, one lock per allocation and per free; the emulation under one lock of its own).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include <c10/core/Allocator.h>

#include "xpm/planner/caching_allocator_emulation.hpp"
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

  /// Emulates CUDA's caching allocator over the storages allocated from now on (std::nullopt:
  /// stops; storages it holds are still freed into it). The cap then bounds reserved bytes.
  /// Throws std::logic_error when `options` change expandable segments while blocks of the
  /// emulation are live.
  void set_caching(std::optional<CachingAllocatorOptions> options);
  /// The caching in effect (std::nullopt: none).
  std::optional<CachingAllocatorOptions> caching() const;
  /// True while caching is on: the cap bounds reserved bytes.
  bool reserves_segments() const override { return caching_on_.load(); }
  /// Bytes the emulated allocator holds (segments, cache included), plus storages outside it;
  /// without caching, current_allocated_bytes().
  std::int64_t current_reserved_bytes() const override;
  /// Maximum of current_reserved_bytes() since the last reset_peak().
  std::int64_t peak_reserved_bytes() const override;
  /// Releases the emulation's cached segments that hold no block in use (no-op without caching).
  void empty_cache() override;

  /// Counts `n_bytes` (throws c10::OutOfMemoryError over the cap, changing no counter) and
  /// allocates them through the allocator that was active before install(). The DataPtr's
  /// context is its data pointer and its deleter raw_deleter(), so raw_allocate() works.
  c10::DataPtr allocate(size_t n_bytes) override;
  /// Copies `count` bytes between two storages of the meter (memcpy; Tensor::clone uses it).
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  /// Frees and uncounts a pointer of the meter (see the file comment for other pointers).
  c10::DeleterFnPtr raw_deleter() const override { return &CpuMemoryMeter::free_raw; }

 private:
  CpuMemoryMeter() = default;
  c10::Allocator& wrapped() const;
  static void free_raw(void* data);
  c10::DataPtr allocate_cached(size_t n_bytes);
  std::int64_t reserved_locked() const;  // emulation_mutex_ held
  void raise_reserved_peak_locked();      // emulation_mutex_ held

  mutable std::mutex emulation_mutex_;
  std::unique_ptr<CachingAllocatorEmulation> emulation_;  // made by the first set_caching
  std::optional<CachingAllocatorOptions> caching_;
  bool caching_expandable_ = false;                        // the emulation's option
  std::atomic<bool> caching_on_{false};                    // caching_.has_value(), read without the lock
  std::atomic<bool> emulation_made_{false};                // emulation_ != nullptr, read without the lock
  std::int64_t peak_reserved_bytes_ = 0;                   // emulation_mutex_ held

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
