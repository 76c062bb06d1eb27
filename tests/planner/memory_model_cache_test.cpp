#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>

#include "xpm/planner/memory_model_cache.hpp"

namespace {

std::string fresh_folder(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(dir);
  return dir.string();
}

xpm::MemoryModel small_model() {
  return xpm::MemoryModel(xpm::CostFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"}), {2.0, 100.0},
                          50.0, "bs");
}

}  // namespace

TEST_CASE("stable_hash_hex is FNV-1a 64 and identity_key depends on every field") {
  CHECK(xpm::stable_hash_hex("") == "cbf29ce484222325");  // FNV-1a 64 offset basis
  CHECK(xpm::stable_hash_hex("a") == "af63dc4c8601ec8c");  // published FNV-1a test vector
  const nlohmann::json id = {{"formula", "a*bs*l + c"}, {"precision", "32-true"}};
  nlohmann::json other = id;
  other["precision"] = "bf16-mixed";
  CHECK(xpm::identity_key(id) == xpm::identity_key(nlohmann::json::parse(id.dump())));
  CHECK(xpm::identity_key(id) != xpm::identity_key(other));
}

TEST_CASE("the cache misses, then hits after store, and misses for a changed identity") {
  const xpm::MemoryModelCache cache(fresh_folder("xpm_cache_hit_miss"));
  const nlohmann::json id = {{"formula", "a*bs*l + c"}, {"capacity_bytes", 1000}};
  std::string warning;
  CHECK_FALSE(cache.lookup(id, &warning).has_value());
  CHECK(warning.empty());
  cache.store(id, small_model());
  const auto hit = cache.lookup(id, &warning);
  REQUIRE(hit.has_value());
  CHECK(hit->coefficients() == std::vector<double>{2.0, 100.0});
  CHECK(hit->floor_bytes() == 50.0);
  nlohmann::json changed = id;
  changed["capacity_bytes"] = 2000;
  CHECK_FALSE(cache.lookup(changed, &warning).has_value());
  CHECK(warning.empty());
}

TEST_CASE("a corrupt cache file is reported and ignored, never trusted") {
  const xpm::MemoryModelCache cache(fresh_folder("xpm_cache_corrupt"));
  const nlohmann::json id = {{"formula", "a*bs*l + c"}};
  cache.store(id, small_model());
  std::ofstream(cache.path_for(id), std::ios::trunc) << "{\"format_version\": 1, \"formula\": ";
  std::string warning;
  CHECK_FALSE(cache.lookup(id, &warning).has_value());
  CHECK(warning.find("is unusable") != std::string::npos);
  CHECK(warning.find(cache.path_for(id)) != std::string::npos);
}

TEST_CASE("a cache file made for another identity is reported as a mismatch and ignored") {
  const xpm::MemoryModelCache cache(fresh_folder("xpm_cache_mismatch"));
  const nlohmann::json id = {{"formula", "a*bs*l + c"}};
  const nlohmann::json other = {{"formula", "a*bs*l^2 + c"}};
  cache.store(other, small_model());
  std::filesystem::rename(cache.path_for(other), cache.path_for(id));  // as if keys collided
  std::string warning;
  CHECK_FALSE(cache.lookup(id, &warning).has_value());
  CHECK(warning.find("identity mismatch") != std::string::npos);
}

TEST_CASE("a cache folder that is a file is refused naming the folder, the model not stored") {
  const std::string file = fresh_folder("xpm_cache_a_file");
  std::ofstream(file) << "not a folder";
  const xpm::MemoryModelCache cache(file + "/models");
  CHECK_THROWS_WITH_AS(cache.store({{"formula", "a*bs*l + c"}}, small_model()),
                       ("memory-model cache: cannot create the folder '" + file + "/models': Not a directory").c_str(),
                       std::runtime_error);
  std::filesystem::remove(file);
}
