// Checkpoints of a Learner run: the files of one checkpoint, the resume state, finding the one to
// resume from.
#include "xpm/trainer/state/learner_checkpoint.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "xpm/planner/atomic_file.hpp"
#include "xpm/trainer/loop/error_context.hpp"

namespace xpm {
namespace {

template <typename T>
T required(const nlohmann::json& json, const char* name) {
  if (!json.contains(name)) {
    throw std::invalid_argument(std::string("checkpoint state.json: field '") + name + "' is missing");
  }
  try {
    return json.at(name).get<T>();
  } catch (const nlohmann::json::exception& error) {
    throw std::invalid_argument(std::string("checkpoint state.json: field '") + name +
                                "' is malformed: " + error.what());
  }
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

nlohmann::json LearnerResumeState::to_json() const {
  return {{"epoch", epoch},
          {"step", step},
          {"epoch_position", epoch_position},
          {"total_steps", total_steps},
          {"world_size", world_size},
          {"capacity_bytes", capacity_bytes},
          {"sampler_state", sampler_state},
          {"epoch_order", epoch_order},
          {"memory_model", memory_model},
          {"microbatch_size", microbatch_size},
          {"power_divisor", power_divisor},
          {"counters", counters},
          {"early_stopping", early_stopping},
          {"early_stopped", early_stopped},
          {"loss_scaler", loss_scaler},
          {"task_state", task_state},
          {"learner_settings", learner_settings},
          {"calibration", calibration}};
}

LearnerResumeState LearnerResumeState::from_json(const nlohmann::json& json) {
  LearnerResumeState state;
  state.epoch = required<std::int64_t>(json, "epoch");
  state.step = required<std::int64_t>(json, "step");
  state.epoch_position = required<std::int64_t>(json, "epoch_position");
  state.total_steps = required<std::int64_t>(json, "total_steps");
  state.world_size = required<int>(json, "world_size");
  state.capacity_bytes = required<std::int64_t>(json, "capacity_bytes");
  state.sampler_state = required<std::string>(json, "sampler_state");
  state.epoch_order = required<std::vector<std::int64_t>>(json, "epoch_order");
  state.memory_model = required<nlohmann::json>(json, "memory_model");
  state.microbatch_size = required<std::int64_t>(json, "microbatch_size");
  state.power_divisor = required<std::int64_t>(json, "power_divisor");
  state.counters = required<nlohmann::json>(json, "counters");
  state.early_stopping = required<nlohmann::json>(json, "early_stopping");
  state.early_stopped = required<bool>(json, "early_stopped");
  if (json.contains("loss_scaler")) state.loss_scaler = required<std::vector<double>>(json, "loss_scaler");
  if (json.contains("task_state")) state.task_state = json.at("task_state");
  if (json.contains("learner_settings")) state.learner_settings = json.at("learner_settings");
  if (json.contains("calibration")) state.calibration = json.at("calibration");
  return state;
}

void save_module_state(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& item : module.named_parameters()) archive.write(item.key(), item.value());
  for (const auto& item : module.named_buffers()) archive.write(item.key(), item.value(), /*is_buffer=*/true);
  archive.save_to(path);
}

void save_parameters_atomically(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& item : module.named_parameters()) archive.write(item.key(), item.value());
  std::ostringstream bytes;
  archive.save_to(bytes);
  write_file_atomically(path, bytes.str());
}

void load_module_state(const std::string& path, torch::nn::Module& module) {
  torch::serialize::InputArchive archive;
  with_error_context("reading '" + path + "'", [&] { archive.load_from(path); });
  torch::NoGradGuard no_grad;
  const auto copy_into = [&](const std::string& name, torch::Tensor& target, bool is_buffer) {
    torch::Tensor stored;
    if (!archive.try_read(name, stored, is_buffer)) {
      throw std::runtime_error("'" + path + "' has no entry '" + name + "'");
    }
    if (!stored.sizes().equals(target.sizes()) || stored.scalar_type() != target.scalar_type()) {
      throw std::runtime_error("'" + path + "': entry '" + name + "' has shape " +
                               c10::str(stored.sizes()) + ", the model's is " + c10::str(target.sizes()));
    }
    target.copy_(stored);
  };
  for (auto& item : module.named_parameters()) copy_into(item.key(), item.value(), false);
  for (auto& item : module.named_buffers()) copy_into(item.key(), item.value(), true);
}

void load_optimizer_state(const std::string& path, torch::optim::Optimizer& optimizer) {
  with_error_context("restoring the optimizer from '" + path + "'",
                     [&] { torch::load(optimizer, path); });
}

torch::Tensor load_generator_state(const std::string& path, int rank) {
  torch::serialize::InputArchive archive;
  torch::Tensor state;
  with_error_context("reading '" + path + "'", [&] { archive.load_from(path); });
  if (!archive.try_read("rank" + std::to_string(rank), state)) {
    throw std::runtime_error("'" + path + "' has no generator state for rank " + std::to_string(rank));
  }
  return state;
}

std::string save_learner_checkpoint(CheckpointStore& store, const torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer,
                                    const std::vector<torch::Tensor>& generator_states,
                                    const LearnerResumeState& state, const nlohmann::json& config,
                                    const std::string& kind, bool is_best) {
  const std::map<std::string, CheckpointFileWriter> optimizer_files = {
      {"optimizer.pt", [&](const std::string& path) { torch::save(optimizer, path); }}};
  return save_learner_checkpoint(store, module, optimizer_files, generator_states, state, config, kind,
                                 is_best);
}

std::string save_learner_checkpoint(CheckpointStore& store, const torch::nn::Module& module,
                                    const std::map<std::string, CheckpointFileWriter>& optimizer_files,
                                    const std::vector<torch::Tensor>& generator_states,
                                    const LearnerResumeState& state, const nlohmann::json& config,
                                    const std::string& kind, bool is_best) {
  std::map<std::string, CheckpointFileWriter> files = optimizer_files;
  files["model.pt"] = [&](const std::string& path) { save_module_state(module, path); };
  files["rng.pt"] = [&](const std::string& path) {
    torch::serialize::OutputArchive archive;
    for (std::size_t r = 0; r < generator_states.size(); ++r) {
      archive.write("rank" + std::to_string(r), generator_states[r]);
    }
    archive.save_to(path);
  };
  files["state.json"] = [&](const std::string& path) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << state.to_json().dump(1) << '\n';
    if (!out.flush()) throw std::runtime_error("cannot write '" + path + "'");
  };
  const nlohmann::json extra = {{"config", config},
                                {"kind", kind},
                                {"torch_version", TORCH_VERSION},
                                {"epoch", state.epoch}};
  return store.save(state.step, extra, files, is_best);
}

void check_optimizer_loadable(const LearnerCheckpoint& checkpoint, int world_size, ShardingStrategy sharding) {
  const std::string& path = checkpoint.info.path;
  if (std::filesystem::exists(path + "/optimizer.pt")) return;  // full state: any world, any sharding
  const int saved_world = checkpoint.state.world_size;
  if (saved_world == world_size && sharding == ShardingStrategy::kShardGradOp) return;
  throw std::invalid_argument(
      "--resume: checkpoint '" + path + "' holds sharded optimizer state (optimizer-rank<r>.pt of " +
      std::to_string(saved_world) + " rank(s), --sharding shard_grad_op); this run has world size " +
      std::to_string(world_size) + " and --sharding " + to_string(sharding) +
      ": resume with --sharding shard_grad_op at world size " + std::to_string(saved_world) +
      ", or write full checkpoints (--optimizer-checkpoint full) to change either");
}

LearnerCheckpoint read_learner_checkpoint(const std::string& path) {
  const std::string reason = CheckpointStore::verify(path);
  if (!reason.empty()) throw std::runtime_error(reason);
  LearnerCheckpoint checkpoint;
  checkpoint.info.path = path;
  try {
    checkpoint.info.manifest = nlohmann::json::parse(read_text(path + "/manifest.json"));
    checkpoint.info.step = checkpoint.info.manifest.at("step").get<std::int64_t>();
    checkpoint.state = LearnerResumeState::from_json(nlohmann::json::parse(read_text(path + "/state.json")));
  } catch (const nlohmann::json::exception& error) {
    throw std::runtime_error(std::string("malformed JSON: ") + error.what());
  } catch (const std::invalid_argument& error) {
    throw std::runtime_error(error.what());
  }
  if (checkpoint.state.step != checkpoint.info.step) {
    throw std::runtime_error("state.json is at step " + std::to_string(checkpoint.state.step) +
                             ", the manifest at step " + std::to_string(checkpoint.info.step));
  }
  return checkpoint;
}

namespace {

// Every torch archive of the checkpoint opens (a file rewritten with its manifest updated passes
// the checksums but not this). Throws std::runtime_error naming the file with LibTorch's first
// line.
void check_archives_open(const std::string& folder) {
  for (const char* name : {"model.pt", "optimizer.pt", "rng.pt"}) {
    const std::string path = folder + "/" + name;
    if (!std::filesystem::exists(path)) continue;
    try {
      torch::serialize::InputArchive archive;
      archive.load_from(path);
    } catch (const c10::Error& error) {
      const std::string text = error.what_without_backtrace();
      throw std::runtime_error("'" + path + "' cannot be read by LibTorch: " + text.substr(0, text.find('\n')));
    }
  }
}

}  // namespace

std::optional<LearnerCheckpoint> load_latest_learner_checkpoint(const CheckpointStore& store,
                                                                std::vector<std::string>* warnings) {
  // verify() checks sizes and checksums; a state.json that then does not parse (written by
  // another version) or a torch archive that does not open is skipped too, falling back to the
  // next older checkpoint.
  const std::vector<std::string> paths = store.list();
  for (auto it = paths.rbegin(); it != paths.rend(); ++it) {
    try {
      LearnerCheckpoint checkpoint = read_learner_checkpoint(*it);
      check_archives_open(*it);
      return checkpoint;
    } catch (const std::exception& error) {
      if (warnings != nullptr) {
        warnings->push_back("checkpoint '" + *it + "' skipped (falling back to an older one): " + error.what());
      }
    }
  }
  return std::nullopt;
}

namespace {

// Throws std::invalid_argument naming every setting that differs from the checkpoint's.
void check_resume_config(const nlohmann::json& config, const std::set<std::string>& free_keys,
                         const LearnerCheckpoint& checkpoint) {
  const nlohmann::json then = checkpoint.info.manifest.value("config", nlohmann::json::object());
  std::string differences;
  for (const auto& [key, value] : config.items()) {
    if (free_keys.count(key) != 0U) continue;
    const auto it = then.find(key);
    if (it == then.end() || *it != value) {
      differences += (differences.empty() ? "" : "; ") + key + " = " + value.dump() + " (checkpoint: " +
                     (it == then.end() ? std::string("absent") : it->dump()) + ")";
    }
  }
  if (!differences.empty()) {
    throw std::invalid_argument("--resume: checkpoint '" + checkpoint.info.path +
                                "' was written with other settings; resume with the same ones: " +
                                differences);
  }
}

}  // namespace

std::optional<LearnerCheckpoint> find_resume_checkpoint(const std::string& folder,
                                                        const CheckpointSettings& settings,
                                                        DistributedContext& dist,
                                                        const nlohmann::json& config,
                                                        const std::set<std::string>& free_keys,
                                                        const std::function<void(const std::string&)>& warn) {
  std::string path;
  if (dist.is_main()) {
    std::vector<std::string> warnings;
    std::error_code error;
    if (std::filesystem::is_directory(folder, error)) {
      const std::optional<LearnerCheckpoint> found =
          load_latest_learner_checkpoint(CheckpointStore(folder, settings), &warnings);
      if (found) path = found->info.path;
    }
    for (const std::string& warning : warnings) {
      if (warn) warn(warning);
    }
  }
  path = dist.share_from(0, path, dist.options().rendezvous_timeout);
  if (path.empty()) return std::nullopt;
  // Every rank reads the folder rank 0 chose (verified there; verified again here).
  std::optional<LearnerCheckpoint> checkpoint;
  try {
    checkpoint = read_learner_checkpoint(path);
  } catch (const std::runtime_error& error) {
    throw std::runtime_error("--resume: checkpoint '" + path + "': " + error.what());
  }
  check_resume_config(config, free_keys, *checkpoint);
  return checkpoint;
}

}  // namespace xpm
