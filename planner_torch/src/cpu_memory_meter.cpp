#include "xpm/planner_torch/cpu_memory_meter.hpp"

#include <stdexcept>
#include <string>

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

namespace xpm {
namespace {

// Priority used with c10::SetCPUAllocator; c10 keeps the allocator with the highest priority,
// so the meter and its uninstall both use this one.
constexpr std::uint8_t kMeterPriority = 100;

// Owns the wrapped allocation until the tensor storage is freed.
struct TrackedAllocation {
  c10::DataPtr wrapped;
  std::int64_t n_bytes;
  const CpuMemoryMeter* meter;
};

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

void CpuMemoryMeter::reset_peak() { peak_bytes_.store(current_bytes_.load()); }

void CpuMemoryMeter::set_capacity_bytes(std::int64_t capacity_bytes) {
  if (capacity_bytes < 0) {
    throw std::invalid_argument("CpuMemoryMeter: capacity_bytes must be >= 0 (0 = no cap), got " +
                                std::to_string(capacity_bytes));
  }
  capacity_bytes_.store(capacity_bytes);
}

c10::DataPtr CpuMemoryMeter::allocate(size_t n_bytes) const {
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
  c10::Allocator* wrapped = wrapped_ != nullptr ? wrapped_ : c10::GetDefaultCPUAllocator();
  c10::DataPtr inner;
  try {
    inner = wrapped->allocate(n_bytes);
  } catch (...) {
    current_bytes_.fetch_sub(n);
    throw;
  }
  std::int64_t peak = peak_bytes_.load();
  while (after > peak && !peak_bytes_.compare_exchange_weak(peak, after)) {
  }
  void* data = inner.get();
  auto* context = new TrackedAllocation{std::move(inner), n, this};
  return {data, context, &CpuMemoryMeter::delete_tracked, c10::Device(c10::DeviceType::CPU)};
}

void CpuMemoryMeter::on_free(std::int64_t n_bytes) const { current_bytes_.fetch_sub(n_bytes); }

void CpuMemoryMeter::delete_tracked(void* context) {
  auto* allocation = static_cast<TrackedAllocation*>(context);
  allocation->meter->on_free(allocation->n_bytes);
  delete allocation;  // frees the wrapped storage through its own deleter
}

ScopedMemoryCap::ScopedMemoryCap(std::int64_t capacity_bytes)
    : previous_capacity_bytes_(CpuMemoryMeter::install().capacity_bytes()) {
  CpuMemoryMeter::instance().set_capacity_bytes(capacity_bytes);
}

ScopedMemoryCap::~ScopedMemoryCap() {
  CpuMemoryMeter::instance().set_capacity_bytes(previous_capacity_bytes_);
}

}  // namespace xpm
