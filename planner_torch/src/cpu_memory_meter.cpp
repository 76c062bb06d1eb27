#include "xpm/planner_torch/cpu_memory_meter.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace xpm {
namespace {

// Priority used with c10::SetCPUAllocator; c10 keeps the allocator with the highest priority,
// so the meter and its uninstall both use this one.
constexpr std::uint8_t kMeterPriority = 100;

// A live storage of the meter: the wrapped allocator's DataPtr (freed through its own deleter)
// and the bytes it was counted with.
struct LiveAllocation {
  c10::DataPtr wrapped;
  std::int64_t n_bytes = 0;
  EmulatedBlockId block = 0;  // its block in the caching emulation (0: none)
};

// The meter's DataPtrs carry their data pointer as context (what Allocator::raw_allocate and
// raw_deleter() require), so the storage's size and wrapped DataPtr are looked up by address.
// Sharded by address so concurrent intra-op threads rarely wait on one lock.
class LiveAllocations {
 public:
  void insert(void* data, LiveAllocation allocation) {
    Shard& shard = shard_of(data);
    std::lock_guard<std::mutex> lock(shard.mutex);
    shard.entries.emplace(data, std::move(allocation));
  }

  /// Removes and returns the entry of `data`; false when the meter did not allocate it.
  bool extract(void* data, LiveAllocation& out) {
    Shard& shard = shard_of(data);
    std::lock_guard<std::mutex> lock(shard.mutex);
    const auto it = shard.entries.find(data);
    if (it == shard.entries.end()) return false;
    out = std::move(it->second);
    shard.entries.erase(it);
    return true;
  }

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_map<void*, LiveAllocation> entries;
  };
  static constexpr std::size_t kShards = 64;

  Shard& shard_of(void* data) {
    // Storages are 64-byte aligned: the low bits carry no information.
    return shards_[(std::hash<void*>{}(data) >> 6) % kShards];
  }

  std::array<Shard, kShards> shards_;
};

LiveAllocations& live_allocations() {
  // Never destroyed: storages may be freed during static destruction.
  static LiveAllocations* live = new LiveAllocations();
  return *live;
}

}  // namespace

CpuMemoryMeter& CpuMemoryMeter::instance() {
  // Never destroyed: storages may outlive static destruction order.
  static CpuMemoryMeter* meter = new CpuMemoryMeter();
  return *meter;
}

CpuMemoryMeter& CpuMemoryMeter::install() {
  CpuMemoryMeter& meter = instance();
  c10::Allocator* active = c10::GetCPUAllocator();
  if (active != &meter) {
    meter.wrapped_ = active;
    c10::SetCPUAllocator(&meter, kMeterPriority);
  }
  return meter;
}

void CpuMemoryMeter::uninstall() {
  CpuMemoryMeter& meter = instance();
  if (c10::GetCPUAllocator() == &meter && meter.wrapped_ != nullptr) {
    c10::SetCPUAllocator(meter.wrapped_, kMeterPriority);
  }
}

void CpuMemoryMeter::reset_peak() {
  peak_bytes_.store(current_bytes_.load());
  std::lock_guard<std::mutex> lock(emulation_mutex_);
  peak_reserved_bytes_ = reserved_locked();
}

void CpuMemoryMeter::set_caching(std::optional<CachingAllocatorOptions> options) {
  std::lock_guard<std::mutex> lock(emulation_mutex_);
  if (options && emulation_ && caching_expandable_ != options->expandable_segments) {
    if (emulation_->allocated_bytes() > 0) {
      throw std::logic_error("CpuMemoryMeter::set_caching: expandable segments cannot change while " +
                             std::to_string(emulation_->allocated_bytes()) +
                             " bytes of the emulated allocator's blocks are live");
    }
    emulation_.reset();
  }
  if (options && !emulation_) {
    emulation_ = std::make_unique<CachingAllocatorEmulation>(*options);
    caching_expandable_ = options->expandable_segments;
  }
  caching_ = options;
  caching_on_.store(options.has_value());
  emulation_made_.store(emulation_ != nullptr);
  peak_reserved_bytes_ = std::max(peak_reserved_bytes_, reserved_locked());
}

std::optional<CachingAllocatorOptions> CpuMemoryMeter::caching() const {
  std::lock_guard<std::mutex> lock(emulation_mutex_);
  return caching_;
}

std::int64_t CpuMemoryMeter::reserved_locked() const {
  const std::int64_t current = current_bytes_.load();
  return emulation_ ? emulation_->reserved_bytes() + current - emulation_->allocated_bytes() : current;
}

void CpuMemoryMeter::raise_reserved_peak_locked() {
  peak_reserved_bytes_ = std::max(peak_reserved_bytes_, reserved_locked());
}

std::int64_t CpuMemoryMeter::current_reserved_bytes() const {
  std::lock_guard<std::mutex> lock(emulation_mutex_);
  return reserved_locked();
}

std::int64_t CpuMemoryMeter::peak_reserved_bytes() const {
  std::lock_guard<std::mutex> lock(emulation_mutex_);
  return emulation_ ? std::max(peak_reserved_bytes_, reserved_locked()) : peak_bytes_.load();
}

void CpuMemoryMeter::empty_cache() {
  std::lock_guard<std::mutex> lock(emulation_mutex_);
  if (emulation_) emulation_->empty_cache();
}

void CpuMemoryMeter::set_capacity_bytes(std::int64_t capacity_bytes) {
  if (capacity_bytes < 0) {
    throw std::invalid_argument("CpuMemoryMeter: capacity_bytes must be >= 0 (0 = no cap), got " +
                                std::to_string(capacity_bytes));
  }
  capacity_bytes_.store(capacity_bytes);
}

c10::Allocator& CpuMemoryMeter::wrapped() const {
  return wrapped_ != nullptr ? *wrapped_ : *c10::GetDefaultCPUAllocator();
}

c10::DataPtr CpuMemoryMeter::allocate_cached(size_t n_bytes) {
  const auto n = static_cast<std::int64_t>(n_bytes);
  const std::int64_t cap = capacity_bytes_.load();
  std::lock_guard<std::mutex> lock(emulation_mutex_);
  const std::int64_t before = emulation_->allocated_bytes();
  const std::int64_t outside = current_bytes_.load() - before;
  std::optional<EmulatedBlockId> block;
  if (cap == 0 || cap > outside) block = emulation_->allocate(n, cap == 0 ? 0 : cap - outside);
  if (!block) {
    oom_count_.fetch_add(1);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU memory cap exceeded: tried to allocate ", n, " bytes (a block of ",
                     CachingAllocatorEmulation::block_bytes(n), " bytes that no cached block holds; the segment it "
                     "needs would pass the cap) with ", current_bytes_.load(), " bytes allocated, ", reserved_locked(),
                     " bytes reserved and a capacity of ", cap,
                     " bytes (xpm CpuMemoryMeter, emulating CUDA's caching allocator)");
  }
  const std::int64_t counted = emulation_->allocated_bytes() - before;
  c10::DataPtr inner;
  try {
    inner = wrapped().allocate(n_bytes);
  } catch (...) {
    emulation_->free(*block);
    throw;
  }
  const std::int64_t after = current_bytes_.fetch_add(counted) + counted;
  std::int64_t peak = peak_bytes_.load();
  while (after > peak && !peak_bytes_.compare_exchange_weak(peak, after)) {
  }
  raise_reserved_peak_locked();
  void* data = inner.get();
  live_allocations().insert(data, LiveAllocation{std::move(inner), counted, *block});
  return {data, data, &CpuMemoryMeter::free_raw, c10::Device(c10::DeviceType::CPU)};
}

c10::DataPtr CpuMemoryMeter::allocate(size_t n_bytes) {
  if (n_bytes > 0 && caching_on_.load()) return allocate_cached(n_bytes);
  const auto n = static_cast<std::int64_t>(n_bytes);
  const std::int64_t cap = capacity_bytes_.load();
  // Reserve first so concurrent allocations cannot both pass the cap check.
  const std::int64_t after = current_bytes_.fetch_add(n) + n;
  if (cap > 0 && after > cap) {
    current_bytes_.fetch_sub(n);
    oom_count_.fetch_add(1);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU memory cap exceeded: tried to allocate ",
                     n, " bytes with ", after - n, " bytes allocated and a capacity of ", cap,
                     " bytes (xpm CpuMemoryMeter)");
  }
  c10::DataPtr inner;
  try {
    inner = wrapped().allocate(n_bytes);
  } catch (...) {
    current_bytes_.fetch_sub(n);
    throw;
  }
  void* data = inner.get();
  if (data == nullptr) {  // a zero-byte storage: nothing to count or free
    current_bytes_.fetch_sub(n);
    return {nullptr, nullptr, &CpuMemoryMeter::free_raw, c10::Device(c10::DeviceType::CPU)};
  }
  std::int64_t peak = peak_bytes_.load();
  while (after > peak && !peak_bytes_.compare_exchange_weak(peak, after)) {
  }
  live_allocations().insert(data, LiveAllocation{std::move(inner), n, 0});
  if (emulation_made_.load()) {
    std::lock_guard<std::mutex> lock(emulation_mutex_);
    raise_reserved_peak_locked();
  }
  return {data, data, &CpuMemoryMeter::free_raw, c10::Device(c10::DeviceType::CPU)};
}

void CpuMemoryMeter::free_raw(void* data) {
  if (data == nullptr) return;
  LiveAllocation allocation;
  if (live_allocations().extract(data, allocation)) {
    CpuMemoryMeter& meter = instance();
    if (allocation.block != 0) {
      std::lock_guard<std::mutex> lock(meter.emulation_mutex_);
      meter.emulation_->free(allocation.block);
      meter.current_bytes_.fetch_sub(allocation.n_bytes);
      return;
    }
    meter.current_bytes_.fetch_sub(allocation.n_bytes);
    return;  // `allocation.wrapped` frees the storage through the wrapped allocator's deleter
  }
  // Not the meter's: raw memory of the allocator that was active before install(), handed back
  // through raw_deallocate() after it (e.g. a oneDNN buffer taken before the meter).
  c10::DeleterFnPtr deleter = instance().wrapped().raw_deleter();
  if (deleter == nullptr) deleter = c10::GetDefaultCPUAllocator()->raw_deleter();
  if (deleter != nullptr) deleter(data);
}

ScopedMemoryCap::ScopedMemoryCap(std::int64_t capacity_bytes)
    : previous_capacity_bytes_(CpuMemoryMeter::install().capacity_bytes()) {
  CpuMemoryMeter::instance().set_capacity_bytes(capacity_bytes);
}

ScopedMemoryCap::~ScopedMemoryCap() {
  CpuMemoryMeter::instance().set_capacity_bytes(previous_capacity_bytes_);
}

}  // namespace xpm
