// CheckpointStore: atomic checkpoint folders with a checksummed manifest (see
// checkpoint_store.hpp and docs/checkpoints.md).
#include "xpm/trainer/state/checkpoint_store.hpp"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/crc.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/trainer/loop/error_context.hpp"

namespace xpm {
namespace {

namespace fs = std::filesystem;

constexpr int kFormatVersion = 1;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kBestMarkerName = "best";
constexpr const char* kTempPrefix = ".tmp-step-";

[[noreturn]] void throw_io(const std::string& path, const std::string& what, int err) {
  throw std::runtime_error("checkpoint: cannot " + what + " '" + path + "': " +
                           std::strerror(err));
}

/// fsyncs a file or a folder (opened read-only; Linux allows fsync on such a descriptor).
void fsync_path(const std::string& path, bool is_dir) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (is_dir ? O_DIRECTORY : 0));
  if (fd < 0) throw_io(path, "open for fsync", errno);
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    throw_io(path, "fsync", err);
  }
  ::close(fd);
}

struct FileDigest {
  std::int64_t bytes = 0;
  std::uint32_t crc32 = 0;
};

/// Size and CRC-32 (the zlib/PNG polynomial, Boost.CRC's crc_32_type) of a file's content.
/// nullopt when the file cannot be opened.
std::optional<FileDigest> digest_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  boost::crc_32_type crc;
  std::vector<char> buffer(1 << 20);
  FileDigest digest;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize n = in.gcount();
    if (n <= 0) break;
    crc.process_bytes(buffer.data(), static_cast<std::size_t>(n));
    digest.bytes += n;
  }
  if (in.bad()) return std::nullopt;
  digest.crc32 = crc.checksum();
  return digest;
}

std::string step_folder_name(std::int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

/// The step of a folder named "step-<digits>", or nullopt for any other name.
std::optional<std::int64_t> parse_step_folder_name(const std::string& name) {
  static const std::string prefix = "step-";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) {
    return std::nullopt;
  }
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoll(digits);
}

/// A file name a checkpoint may hold: plain, not hidden, not the manifest.
void check_file_name(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name[0] == '.' ||
      name == kManifestName) {
    throw std::invalid_argument("checkpoint: file name '" + name +
                                "' is not allowed (must be a plain, non-hidden name other than "
                                "manifest.json)");
  }
}

/// True when `name` is a temporary folder left by a process that no longer runs (or by this
/// one): ".tmp-step-<digits>-<pid>" (or "...-<pid>-old", a replaced checkpoint being removed).
/// Another live process's folder is left alone.
bool is_stale_temp_folder(std::string name) {
  if (name.compare(0, std::strlen(kTempPrefix), kTempPrefix) != 0) return false;
  const std::string old_suffix = "-old";
  if (name.size() > old_suffix.size() &&
      name.compare(name.size() - old_suffix.size(), old_suffix.size(), old_suffix) == 0) {
    name.resize(name.size() - old_suffix.size());
  }
  const std::size_t dash = name.rfind('-');
  if (dash == std::string::npos || dash + 1 >= name.size()) return false;
  const std::string pid_text = name.substr(dash + 1);
  if (!std::all_of(pid_text.begin(), pid_text.end(),
                   [](char c) { return c >= '0' && c <= '9'; }) ||
      pid_text.size() > 9) {
    return false;
  }
  const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
  if (pid == ::getpid()) return true;
  return !(::kill(pid, 0) == 0 || errno == EPERM);
}

void remove_stale_temp_folders(const std::string& dir) {
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::error_code type_ec;
    if (!entry.is_directory(type_ec) || entry.is_symlink(type_ec)) continue;
    if (!is_stale_temp_folder(name)) continue;
    std::error_code remove_ec;
    fs::remove_all(entry.path(), remove_ec);  // best effort: a leftover is ignored anyway
  }
}

/// Puts the folder `from` at `to`. When `to` exists (a checkpoint of the same step), the two
/// are exchanged atomically (renameat2 RENAME_EXCHANGE) and the old one, now at `from`, removed.
void move_into_place(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) == 0) return;
  if (errno != ENOTEMPTY && errno != EEXIST) throw_io(to, "rename '" + from + "' to", errno);
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    std::error_code ec;
    fs::remove_all(from, ec);
    return;
  }
#endif
  // No atomic exchange on this file system: move the old one aside (a temporary name, so it is
  // ignored and cleaned up if we crash now), then rename the new one in.
  const std::string aside = from + "-old";
  if (::rename(to.c_str(), aside.c_str()) != 0) throw_io(to, "move aside the old", errno);
  if (::rename(from.c_str(), to.c_str()) != 0) throw_io(to, "rename '" + from + "' to", errno);
  std::error_code ec;
  fs::remove_all(aside, ec);
}

std::string read_best_marker(const std::string& dir) {
  std::ifstream in(dir + "/" + kBestMarkerName);
  std::string name;
  if (!in || !std::getline(in, name)) return "";
  while (!name.empty() && (name.back() == '\r' || name.back() == ' ')) name.pop_back();
  return parse_step_folder_name(name) ? name : "";
}

std::string hex32(std::uint32_t value) {
  char text[16];
  std::snprintf(text, sizeof text, "%08x", value);
  return text;
}

}  // namespace

void CheckpointSettings::validate() const {
  if (every_steps < 0) {
    throw std::invalid_argument("CheckpointSettings.every_steps must be >= 0 (0: not by steps), got " +
                                std::to_string(every_steps));
  }
  if (every_epochs < 0) {
    throw std::invalid_argument(
        "CheckpointSettings.every_epochs must be >= 0 (0: not by epochs), got " +
        std::to_string(every_epochs));
  }
  if (keep_last < 1) {
    throw std::invalid_argument("CheckpointSettings.keep_last must be >= 1, got " +
                                std::to_string(keep_last));
  }
}

CheckpointStore::CheckpointStore(std::string dir, CheckpointSettings settings)
    : dir_(std::move(dir)), settings_(settings) {
  settings_.validate();
  if (dir_.empty()) throw std::invalid_argument("CheckpointStore: the folder name is empty");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_)) {
    throw std::runtime_error("checkpoint: cannot create the folder '" + dir_ + "': " +
                             (ec ? ec.message() : "not a folder"));
  }
}

bool CheckpointStore::due(std::int64_t step, std::int64_t epoch_completed) const {
  const bool by_steps = settings_.every_steps > 0 && step > 0 && step % settings_.every_steps == 0;
  const bool by_epochs = settings_.every_epochs > 0 && epoch_completed > 0 &&
                         epoch_completed % settings_.every_epochs == 0;
  return by_steps || by_epochs;
}

std::string CheckpointStore::save(std::int64_t step, const nlohmann::json& manifest_extra,
                                  const std::map<std::string, CheckpointFileWriter>& files,
                                  bool is_best) {
  if (step < 0) {
    throw std::invalid_argument("checkpoint: step must be >= 0, got " + std::to_string(step));
  }
  if (!manifest_extra.is_null() && !manifest_extra.is_object()) {
    throw std::invalid_argument("checkpoint: manifest_extra must be a JSON object, got " +
                                std::string(manifest_extra.type_name()));
  }
  for (const char* reserved : {"format_version", "step", "files", "best"}) {
    if (manifest_extra.is_object() && manifest_extra.contains(reserved)) {
      throw std::invalid_argument(std::string("checkpoint: manifest_extra may not set the key '") +
                                  reserved + "' (the store writes it)");
    }
  }
  for (const auto& [name, writer] : files) {
    check_file_name(name);
    if (!writer) throw std::invalid_argument("checkpoint: no writer for file '" + name + "'");
  }

  remove_stale_temp_folders(dir_);
  const std::string name = step_folder_name(step);
  const std::string final_dir = dir_ + "/" + name;
  const std::string temp_dir =
      dir_ + "/" + kTempPrefix + name.substr(5) + "-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(temp_dir, ec);
  if (::mkdir(temp_dir.c_str(), 0755) != 0) throw_io(temp_dir, "create the folder", errno);

  try {
    nlohmann::json manifest = manifest_extra.is_object() ? manifest_extra : nlohmann::json::object();
    manifest["format_version"] = kFormatVersion;
    manifest["step"] = step;
    manifest["best"] = is_best;  // moved into place with the checkpoint: a crash cannot split them
    nlohmann::json listed = nlohmann::json::object();
    for (const auto& [file_name, writer] : files) {
      const std::string path = temp_dir + "/" + file_name;
      with_error_context("writing '" + path + "'", [&] { writer(path); });
      fsync_path(path, /*is_dir=*/false);
      const std::optional<FileDigest> digest = digest_file(path);
      if (!digest) {
        throw std::runtime_error("checkpoint: the writer did not create '" + path + "'");
      }
      listed[file_name] = {{"bytes", digest->bytes}, {"crc32", digest->crc32}};
    }
    manifest["files"] = std::move(listed);
    write_file_atomically(temp_dir + "/" + kManifestName, manifest.dump(2) + "\n");
    fsync_path(temp_dir, /*is_dir=*/true);
    move_into_place(temp_dir, final_dir);
    fsync_path(dir_, /*is_dir=*/true);
  } catch (...) {
    fs::remove_all(temp_dir, ec);
    throw;
  }

  if (is_best) {
    write_file_atomically(dir_ + "/" + kBestMarkerName, name + "\n");
    fsync_path(dir_, /*is_dir=*/true);
  }

  // Retention: the newest keep_last folders by step, plus the best one when keep_best.
  const std::vector<std::string> all = list();
  const std::string best_name = settings_.keep_best ? best_folder_name() : "";
  const std::size_t keep = static_cast<std::size_t>(settings_.keep_last);
  // Each one is first renamed to a temporary name, so that a crash while removing it leaves a
  // folder that is ignored and cleaned up by the next save, never a partial step-* folder.
  for (std::size_t i = 0; i + keep < all.size(); ++i) {
    const std::string old_name = fs::path(all[i]).filename().string();
    if (old_name == best_name) continue;
    const std::string doomed = dir_ + "/" + kTempPrefix + old_name.substr(5) + "-" +
                               std::to_string(::getpid()) + "-old";
    fs::remove_all(doomed, ec);
    if (::rename(all[i].c_str(), doomed.c_str()) != 0) {
      throw_io(all[i], "remove the old checkpoint", errno);
    }
    fs::remove_all(doomed, ec);
    if (ec) {
      throw std::runtime_error("checkpoint: cannot remove the old checkpoint '" + doomed +
                               "': " + ec.message());
    }
  }
  return final_dir;
}

std::vector<std::string> CheckpointStore::list() const {
  std::vector<std::pair<std::int64_t, std::string>> found;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_, ec)) {
    const std::optional<std::int64_t> step = parse_step_folder_name(entry.path().filename().string());
    std::error_code type_ec;
    if (step && entry.is_directory(type_ec)) found.emplace_back(*step, entry.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> paths;
  for (auto& [step, path] : found) paths.push_back(std::move(path));
  return paths;
}

std::string CheckpointStore::verify(const std::string& checkpoint_dir) {
  const std::string manifest_path = checkpoint_dir + "/" + kManifestName;
  std::ifstream in(manifest_path);
  if (!in) return "missing manifest.json";
  nlohmann::json manifest;
  try {
    in >> manifest;
  } catch (const nlohmann::json::exception& e) {
    return std::string("manifest.json unparsable: ") + e.what();
  }
  if (!manifest.is_object() || !manifest.contains("format_version") ||
      !manifest["format_version"].is_number_integer() || !manifest.contains("step") ||
      !manifest["step"].is_number_integer() || !manifest.contains("files") ||
      !manifest["files"].is_object()) {
    return "manifest.json unparsable: lacks an integer \"format_version\", an integer \"step\" or "
           "a \"files\" object";
  }
  if (manifest["format_version"].get<int>() != kFormatVersion) {
    return "manifest.json has format_version " + manifest["format_version"].dump() +
           ", this build reads " + std::to_string(kFormatVersion);
  }
  const std::optional<std::int64_t> folder_step =
      parse_step_folder_name(fs::path(checkpoint_dir).filename().string());
  const std::int64_t step = manifest["step"].get<std::int64_t>();
  if (folder_step && *folder_step != step) {
    return "manifest.json says step " + std::to_string(step) + " but the folder is " +
           fs::path(checkpoint_dir).filename().string();
  }
  for (const auto& [file_name, entry] : manifest["files"].items()) {
    if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_integer() ||
        !entry.contains("crc32") || !entry["crc32"].is_number_unsigned()) {
      return "manifest.json unparsable: the entry of file '" + file_name +
             "' lacks integer \"bytes\" and \"crc32\"";
    }
    const std::optional<FileDigest> digest = digest_file(checkpoint_dir + "/" + file_name);
    if (!digest) return "file '" + file_name + "' is missing";
    const std::int64_t bytes = entry["bytes"].get<std::int64_t>();
    if (digest->bytes != bytes) {
      return "file '" + file_name + "' size mismatch: manifest says " + std::to_string(bytes) +
             " bytes, found " + std::to_string(digest->bytes);
    }
    const std::uint32_t crc32 = entry["crc32"].get<std::uint32_t>();
    if (digest->crc32 != crc32) {
      return "file '" + file_name + "' checksum mismatch: manifest says crc32 " + hex32(crc32) +
             ", computed " + hex32(digest->crc32);
    }
  }
  return "";
}

std::optional<CheckpointInfo> CheckpointStore::latest_valid(
    std::vector<std::string>* warnings) const {
  const std::vector<std::string> all = list();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const std::string reason = verify(*it);
    if (reason.empty()) {
      CheckpointInfo info;
      info.path = *it;
      std::ifstream in(*it + "/" + kManifestName);
      in >> info.manifest;
      info.step = info.manifest["step"].get<std::int64_t>();
      return info;
    }
    const std::string warning = "skipping checkpoint '" + *it + "': " + reason;
    if (warnings != nullptr) {
      warnings->push_back(warning);
    } else {
      std::cerr << "xpm: warning: " << warning << "\n";
    }
  }
  return std::nullopt;
}

std::string CheckpointStore::best_folder_name() const {
  const std::vector<std::string> all = list();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    std::ifstream in(*it + "/" + kManifestName);
    const nlohmann::json manifest = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (manifest.is_object() && manifest.value("best", false) == true) {
      return fs::path(*it).filename().string();
    }
  }
  return read_best_marker(dir_);  // checkpoints written before manifests said it
}

std::optional<CheckpointInfo> CheckpointStore::best() const {
  const std::string name = best_folder_name();
  if (name.empty()) return std::nullopt;
  const std::string path = dir_ + "/" + name;
  if (!fs::is_directory(path) || !verify(path).empty()) return std::nullopt;
  CheckpointInfo info;
  info.path = path;
  std::ifstream in(path + "/" + kManifestName);
  in >> info.manifest;
  info.step = info.manifest["step"].get<std::int64_t>();
  return info;
}

}  // namespace xpm
