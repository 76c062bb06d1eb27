#include "xpm/planner/memory_model_cache.hpp"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <utility>

namespace xpm {

std::string identity_key(const nlohmann::json& identity) { return stable_hash_hex(identity.dump()); }

MemoryModelCache::MemoryModelCache(std::string folder) : folder_(std::move(folder)) {
  if (folder_.empty()) throw std::invalid_argument("MemoryModelCache: folder must not be empty");
}

std::string MemoryModelCache::path_for(const nlohmann::json& identity) const {
  return folder_ + "/" + identity_key(identity) + ".json";
}

std::optional<MemoryModel> MemoryModelCache::lookup(const nlohmann::json& identity,
                                                    std::string* warning) const {
  const std::string path = path_for(identity);
  if (!std::filesystem::exists(path)) return std::nullopt;
  try {
    MemoryModel model = MemoryModel::load(path);
    const auto it = model.metadata().find("identity");
    if (it == model.metadata().end() || *it != identity) {
      if (warning != nullptr) {
        *warning = "memory-model cache file '" + path +
                   "' was made for a different setup (identity mismatch); ignored";
      }
      return std::nullopt;
    }
    return model;
  } catch (const std::exception& error) {
    if (warning != nullptr) {
      *warning = "memory-model cache file '" + path + "' is unusable (" + error.what() + "); ignored";
    }
    return std::nullopt;
  }
}

std::string MemoryModelCache::store(const nlohmann::json& identity, MemoryModel model) const {
  try {
    std::filesystem::create_directories(folder_);
  } catch (const std::filesystem::filesystem_error& error) {
    throw std::runtime_error("memory-model cache: cannot create the folder '" + folder_ + "': " +
                             error.code().message());
  }
  model.metadata()["identity"] = identity;
  const std::string path = path_for(identity);
  model.save(path);
  return path;
}

}  // namespace xpm
