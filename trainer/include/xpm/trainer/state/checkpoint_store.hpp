// xpm/trainer/state/checkpoint_store.hpp — checkpoints on disk: one folder per checkpoint, written
// atomically (temporary folder, every file fsynced, manifest last, rename, parent fsynced), with a
// manifest naming each file's size and checksum, the format version, the config and the step;
// the last K kept plus the best; corrupt or partial checkpoints detected and skipped.
//
//   CheckpointSettings settings;            // every 100 steps, keep the last 2 and the best
//   settings.every_steps = 100;
//   CheckpointStore store(run_dir + "/checkpoints", settings);
//   store.save(step, {{"config", config_json}},
//              {{"model.pt", [&](const std::string& path) { torch::save(params, path); }}},
//              /*is_best=*/false);
//   std::vector<std::string> warnings;
//   std::optional<CheckpointInfo> latest = store.latest_valid(&warnings);  // skips corrupt ones
//
// Layout: <dir>/step-00000100/{manifest.json, model.pt, ...}; <dir>/best -> the best checkpoint's
// folder name (a one-line text file written atomically). Only rank 0 writes (callers' duty).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xpm {

struct CheckpointSettings {
  std::int64_t every_steps = 0;   // checkpoint every N optimizer steps (0: not by steps)
  std::int64_t every_epochs = 0;  // checkpoint at the end of every N epochs (0: not by epochs)
  std::int64_t keep_last = 2;     // the newest K checkpoints are kept (>= 1)
  bool keep_best = true;          // the checkpoint marked best is kept too

  /// Throws std::invalid_argument naming the field and its value.
  void validate() const;
};

/// Writes one file of a checkpoint at `path` (inside the temporary folder). Throws on failure.
using CheckpointFileWriter = std::function<void(const std::string& path)>;

struct CheckpointInfo {
  std::string path;          // the checkpoint's folder
  std::int64_t step = 0;     // from the manifest
  nlohmann::json manifest;   // as written, "files" included
};

class CheckpointStore {
 public:
  /// Creates `dir` if missing. Throws std::invalid_argument for bad settings.
  CheckpointStore(std::string dir, CheckpointSettings settings);

  /// True when a checkpoint is due after `step` steps (every_steps) or at the end of epoch
  /// `epoch_completed` (1-based count of finished epochs; pass 0 when not at an epoch end).
  bool due(std::int64_t step, std::int64_t epoch_completed) const;

  /// Writes checkpoint `step`: each writer into a temporary folder, then manifest.json with
  /// {"format_version", "step", "files": {name: {"bytes", "crc32"}}} plus `manifest_extra`'s
  /// keys, fsync, rename into place; marks it best when `is_best`; then deletes checkpoints
  /// beyond keep_last (never the best). Returns the folder. An existing checkpoint of the same
  /// step is replaced. Throws std::runtime_error naming the path on any I/O failure, and a
  /// writer's exception as it is after "writing '<temporary path>': " (error_context.hpp),
  /// leaving earlier checkpoints untouched.
  std::string save(std::int64_t step, const nlohmann::json& manifest_extra,
                   const std::map<std::string, CheckpointFileWriter>& files, bool is_best);

  /// Checkpoints on disk, oldest first, whether valid or not (folder names step-*).
  std::vector<std::string> list() const;
  /// Checks a checkpoint folder: manifest parses, every listed file exists with its size and
  /// checksum. Returns "" when valid, otherwise the reason.
  static std::string verify(const std::string& checkpoint_dir);
  /// The newest valid checkpoint; each invalid newer one is skipped and its reason appended to
  /// `warnings` (may be null). nullopt when none is valid.
  std::optional<CheckpointInfo> latest_valid(std::vector<std::string>* warnings) const;
  /// The checkpoint marked best, if it exists and is valid: the newest checkpoint whose
  /// manifest says "best" (written and moved into place with it, so a crash between a best
  /// checkpoint and its marker loses neither), else the one the `best` marker file names.
  std::optional<CheckpointInfo> best() const;

  const std::string& dir() const { return dir_; }
  const CheckpointSettings& settings() const { return settings_; }

 private:
  std::string best_folder_name() const;  // best()'s folder, without verifying it
  std::string dir_;
  CheckpointSettings settings_;
};

}  // namespace xpm
