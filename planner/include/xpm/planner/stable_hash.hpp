// xpm/planner/stable_hash.hpp — a hash that is the same on every run and platform, for names
// that must not change between runs (formula identities, cache keys).
//
//   stable_hash_hex("a") == "af63dc4c8601ec8c"
#pragma once

#include <string>

namespace xpm {

/// 16 lowercase hex digits of the 64-bit FNV-1a hash of `text` (Fowler, Noll, Vo,
/// http://www.isthe.com/chongo/tech/comp/fnv/): not cryptographic, stable across runs.
std::string stable_hash_hex(const std::string& text);

}  // namespace xpm
