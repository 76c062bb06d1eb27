#include "xpm/planner/stable_hash.hpp"

#include <cstdint>
#include <cstdio>

namespace xpm {

std::string stable_hash_hex(const std::string& text) {
  std::uint64_t hash = 14695981039346656037ULL;  // FNV-1a 64-bit offset basis
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ULL;  // FNV-1a 64-bit prime
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  return hex;
}

}  // namespace xpm
