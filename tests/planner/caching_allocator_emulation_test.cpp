// caching_allocator_emulation_test.cpp — the emulated CUDA caching allocator against the
// allocation sequences of tests/caching_allocator/sequences.json (the reserved bytes PyTorch's
// documented policy gives), and its argument errors.
#include <doctest/doctest.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/caching_allocator_emulation.hpp"

namespace {

nlohmann::json read_sequences() {
  std::ifstream in(std::string(XPM_SOURCE_DIR) + "/tests/caching_allocator/sequences.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

constexpr std::int64_t kMiB = 1 << 20;

}  // namespace

TEST_CASE("the emulation gives each table sequence's reserved bytes") {
  const nlohmann::json table = read_sequences();
  REQUIRE(table.at("cases").size() >= 8);
  for (const auto& sequence : table.at("cases")) {
    CAPTURE(sequence.at("name").get<std::string>());
    xpm::CachingAllocatorEmulation allocator(
        xpm::CachingAllocatorOptions{sequence.at("expandable_segments").get<bool>()});
    const auto capacity_bytes = sequence.at("capacity_bytes").get<std::int64_t>();
    std::map<std::string, xpm::EmulatedBlockId> live;
    std::vector<std::string> out_of_memory;
    for (const auto& event : sequence.at("events")) {
      const auto op = event.at(0).get<std::string>();
      if (op == "a") {
        const auto block = allocator.allocate(event.at(2).get<std::int64_t>(), capacity_bytes);
        if (block) live[event.at(1).get<std::string>()] = *block;
        if (!block) out_of_memory.push_back(event.at(1).get<std::string>());
      } else if (op == "f") {
        allocator.free(live.at(event.at(1).get<std::string>()));
      } else {
        REQUIRE(op == "e");
        allocator.empty_cache();
      }
    }
    const auto& expected = sequence.at("expected");
    CHECK(allocator.allocated_bytes() == expected.at("allocated_bytes").get<std::int64_t>());
    CHECK(allocator.reserved_bytes() == expected.at("reserved_bytes").get<std::int64_t>());
    CHECK(allocator.peak_reserved_bytes() == expected.at("peak_reserved_bytes").get<std::int64_t>());
    CHECK(out_of_memory == expected.at("out_of_memory").get<std::vector<std::string>>());
    CHECK(allocator.oom_count() == static_cast<std::int64_t>(out_of_memory.size()));
  }
}

TEST_CASE("block and segment sizes follow the documented rounding") {
  CHECK(xpm::CachingAllocatorEmulation::block_bytes(1) == 512);
  CHECK(xpm::CachingAllocatorEmulation::block_bytes(513) == 1024);
  CHECK(xpm::CachingAllocatorEmulation::segment_bytes(kMiB) == 2 * kMiB);
  CHECK(xpm::CachingAllocatorEmulation::segment_bytes(kMiB + 1) == 20 * kMiB);
  CHECK(xpm::CachingAllocatorEmulation::segment_bytes(10 * kMiB) == 10 * kMiB);
  CHECK(xpm::CachingAllocatorEmulation::segment_bytes(21 * kMiB) == 22 * kMiB);
}

TEST_CASE("freed neighbours merge back into one cached block that a larger request reuses") {
  xpm::CachingAllocatorEmulation allocator;
  const auto a = allocator.allocate(4 * kMiB, 0), b = allocator.allocate(4 * kMiB, 0);
  REQUIRE(a);
  REQUIRE(b);
  allocator.free(*a);
  allocator.free(*b);
  const auto c = allocator.allocate(18 * kMiB, 0);  // fits only in the merged 20 MiB segment
  REQUIRE(c);
  CHECK(allocator.reserved_bytes() == 20 * kMiB);
  allocator.reset_peak();
  CHECK(allocator.peak_allocated_bytes() == 18 * kMiB);
}

TEST_CASE("bad arguments are refused with the value named") {
  xpm::CachingAllocatorEmulation allocator;
  CHECK_THROWS_WITH_AS(allocator.allocate(0, 0), doctest::Contains("n_bytes must be > 0, got 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(allocator.allocate(1, -1), doctest::Contains("capacity_bytes must be >= 0, got -1"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(allocator.free(7), doctest::Contains("block 7 is not live"), std::invalid_argument);
}
