// budget.cpp — MemoryBudget validation and usable bytes (see budget.hpp).
#include "xpm/planner/budget.hpp"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace xpm {
namespace {

// capacity * fraction, floored, computed in long double: exact for any int64 capacity when
// fraction == 1 on x86-64 (64-bit mantissa), and never above the exact product otherwise.
std::int64_t scaled_capacity(std::int64_t capacity_bytes, double memory_fraction) {
  const long double scaled =
      std::floor(static_cast<long double>(capacity_bytes) * static_cast<long double>(memory_fraction));
  return static_cast<std::int64_t>(scaled);  // 0 < scaled <= capacity_bytes: representable
}

}  // namespace

void MemoryBudget::validate() const {
  if (capacity_bytes <= 0) {
    throw std::invalid_argument("MemoryBudget: capacity_bytes must be > 0, got " +
                                std::to_string(capacity_bytes));
  }
  if (!(std::isfinite(memory_fraction) && memory_fraction > 0.0 && memory_fraction <= 1.0)) {
    std::ostringstream os;
    os << "MemoryBudget: memory_fraction must be in (0, 1], got " << memory_fraction;
    throw std::invalid_argument(os.str());
  }
  if (extra_overhead_bytes < 0) {
    throw std::invalid_argument("MemoryBudget: extra_overhead_bytes must be >= 0, got " +
                                std::to_string(extra_overhead_bytes));
  }
  const std::int64_t scaled = scaled_capacity(capacity_bytes, memory_fraction);
  if (extra_overhead_bytes >= scaled) {
    std::ostringstream os;
    os << "MemoryBudget: no usable bytes left: capacity_bytes " << capacity_bytes
       << " * memory_fraction " << memory_fraction << " = " << scaled
       << " <= extra_overhead_bytes " << extra_overhead_bytes;
    throw std::invalid_argument(os.str());
  }
}

std::int64_t MemoryBudget::usable_bytes() const {
  validate();
  return scaled_capacity(capacity_bytes, memory_fraction) - extra_overhead_bytes;
}

}  // namespace xpm
