// xpm/planner/memory_model_cache.hpp — a folder of fitted memory models keyed by the identity
// of what was measured, so a rerun or a resume of the same setup does not probe again.
//
//   nlohmann::json identity = {{"formula", canonical}, {"model_signature", ...},
//                              {"precision", "32-true"}, {"capacity_bytes", cap}, ...};
//   MemoryModelCache cache(".cache/xpm/memory-models");
//   std::string warning;
//   if (auto model = cache.lookup(identity, &warning)) use(*model);
//   else { if (!warning.empty()) log(warning); model = probe_and_fit(); cache.store(identity, model); }
//
// The file for an identity is <folder>/<identity_key(identity)>.json: a MemoryModel JSON whose
// metadata.identity holds the identity object itself. A file that is unreadable, not a model, or
// whose stored identity differs from the one asked for (a hash collision or a hand edit) is
// reported through `warning` and ignored, never trusted.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "xpm/planner/memory_model.hpp"
#include "xpm/planner/stable_hash.hpp"

namespace xpm {

/// The cache key of an identity: stable_hash_hex of its compact JSON dump (keys sorted, as
/// nlohmann::json orders object keys).
std::string identity_key(const nlohmann::json& identity);

class MemoryModelCache {
 public:
  /// `folder` is created on the first store(). Throws std::invalid_argument if empty.
  explicit MemoryModelCache(std::string folder);

  /// The cached model for `identity`, or nullopt. When a file exists but cannot be trusted,
  /// returns nullopt and sets *warning (if given) to a one-line reason naming the file.
  std::optional<MemoryModel> lookup(const nlohmann::json& identity, std::string* warning = nullptr) const;

  /// Writes `model` with metadata.identity = identity, atomically. Returns the path.
  /// Throws std::runtime_error naming the path on failure.
  std::string store(const nlohmann::json& identity, MemoryModel model) const;

  std::string path_for(const nlohmann::json& identity) const;
  const std::string& folder() const { return folder_; }

 private:
  std::string folder_;
};

}  // namespace xpm
