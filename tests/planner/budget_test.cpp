// budget_test.cpp — MemoryBudget validation and usable bytes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "xpm/planner/budget.hpp"

using xpm::MemoryBudget;

namespace {

MemoryBudget budget(std::int64_t capacity, double fraction, std::int64_t overhead) {
  MemoryBudget b;
  b.capacity_bytes = capacity;
  b.memory_fraction = fraction;
  b.extra_overhead_bytes = overhead;
  return b;
}

}  // namespace

TEST_CASE("usable bytes are capacity times fraction minus the extra overhead") {
  CHECK(budget(1000, 0.9, 100).usable_bytes() == 800);
  CHECK(budget(80LL << 30, 0.9, 512LL << 20).usable_bytes() ==
        static_cast<std::int64_t>((80LL << 30) * 0.9) - (512LL << 20));
}

TEST_CASE("usable bytes are exact for a full fraction of a huge capacity") {
  const std::int64_t capacity = (std::int64_t{1} << 62) + 1;  // not representable as a double
  CHECK(budget(capacity, 1.0, 1).usable_bytes() == capacity - 1);
}

TEST_CASE("usable bytes round the scaled capacity down") {
  CHECK(budget(10, 0.55, 0).usable_bytes() == 5);
}

TEST_CASE("budget rejects a memory fraction of 0") {
  CHECK_THROWS_WITH_AS(budget(1000, 0.0, 0).validate(), doctest::Contains("memory_fraction"),
                       std::invalid_argument);
}

TEST_CASE("budget rejects a memory fraction above 1 or not a number") {
  CHECK_THROWS_WITH_AS(budget(1000, 1.5, 0).validate(), doctest::Contains("1.5"),
                       std::invalid_argument);
  CHECK_THROWS_AS(budget(1000, std::nan(""), 0).validate(), std::invalid_argument);
  CHECK_NOTHROW(budget(1000, 1.0, 0).validate());
}

TEST_CASE("budget rejects a negative extra overhead") {
  CHECK_THROWS_WITH_AS(budget(1000, 0.9, -1).validate(),
                       doctest::Contains("extra_overhead_bytes"), std::invalid_argument);
}

TEST_CASE("budget rejects an overhead that leaves no usable bytes") {
  CHECK_THROWS_WITH_AS(budget(1000, 0.9, 2000).usable_bytes(), doctest::Contains("2000"),
                       std::invalid_argument);
  CHECK_THROWS_AS(budget(1000, 0.9, 900).validate(), std::invalid_argument);
  CHECK(budget(1000, 0.9, 899).usable_bytes() == 1);
}

TEST_CASE("budget rejects a zero or negative capacity") {
  CHECK_THROWS_WITH_AS(budget(0, 0.9, 0).validate(), doctest::Contains("capacity_bytes"),
                       std::invalid_argument);
  CHECK_THROWS_AS(budget(-5, 0.9, 0).validate(), std::invalid_argument);
}
