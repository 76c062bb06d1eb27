// TaggingJobConfig: validation (errors name the field and its value) and the resolved config as
// JSON (config.json of the run folder).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "xpm/planner/formula.hpp"
#include "xpm/planner_torch/device_meter.hpp"
#include "xpm/trainer/loop/hook_library.hpp"
#include "xpm/trainer/options/lr_schedule.hpp"
#include "xpm/trainer/options/precision.hpp"
#include "xpm/trainer/distributed/sharded_optimizer.hpp"
#include "xpm/tasks/tagging_job.hpp"

namespace xpm {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("TaggingJobConfig." + message);
}

}  // namespace

void TaggingJobConfig::validate() const {
  require(!data_dir.empty(), "data_dir must not be empty");
  require(!run_dir.empty(), "run_dir must not be empty");
  require(max_steps >= 0, "max_steps must be >= 0, got " + std::to_string(max_steps));
  require(epochs >= 1, "epochs must be >= 1, got " + std::to_string(epochs));
  require(outer_batch_size >= 1, "outer_batch_size must be >= 1, got " +
                                     std::to_string(outer_batch_size));
  require(threads >= 0, "threads must be >= 0 (0: automatic), got " + std::to_string(threads));
  tagging_device(device, "--device");
  require(bucket_cap_bytes >= 1, "bucket_cap_bytes must be >= 1, got " + std::to_string(bucket_cap_bytes));
  require(collective_timeout_s > 0, "collective_timeout_s must be > 0, got " +
                                        std::to_string(collective_timeout_s));
  require(rendezvous_timeout_s > 0, "rendezvous_timeout_s must be > 0, got " +
                                        std::to_string(rendezvous_timeout_s));
  distributed_options().validate();
  require(vocab_size >= 3, "vocab_size must be >= 3, got " + std::to_string(vocab_size));
  require(learning_rate > 0, "learning_rate must be > 0, got " + std::to_string(learning_rate));
  require(weight_decay >= 0, "weight_decay must be >= 0, got " + std::to_string(weight_decay));
  require(warmup_steps >= 1, "warmup_steps must be >= 1, got " + std::to_string(warmup_steps));
  require(memory_cap_bytes >= 0, "memory_cap_bytes must be >= 0, got " +
                                     std::to_string(memory_cap_bytes));
  require(memory_cap_factor >= 0, "memory_cap_factor must be >= 0, got " +
                                      std::to_string(memory_cap_factor));
  require(memory_cap_factor == 0 || memory_cap_factor > 1,
          "memory_cap_factor must be 0 (off) or > 1 (a multiple of the static memory), got " +
              std::to_string(memory_cap_factor));
  require(memory_fraction > 0 && memory_fraction <= 1,
          "memory_fraction must be in (0, 1], got " + std::to_string(memory_fraction));
  require(extra_overhead_bytes >= 0, "extra_overhead_bytes must be >= 0, got " +
                                         std::to_string(extra_overhead_bytes));
  require(memory_cap_bytes == 0 || memory_cap_factor == 0,
          "memory_cap_bytes and TaggingJobConfig.memory_cap_factor are exclusive: give one (got " +
              std::to_string(memory_cap_bytes) + " and " + std::to_string(memory_cap_factor) + ")");
  require(microbatch_size >= 0, "microbatch_size must be >= 1 (0: the outer batch size), got " +
                                    std::to_string(microbatch_size));
  require(microbatch_size <= outer_batch_size,
          "microbatch_size must be at most TaggingJobConfig.outer_batch_size (" +
              std::to_string(outer_batch_size) + "), got " + std::to_string(microbatch_size));
  require(microbatch_size == 0 || batcher != BatcherKind::kPredictive,
          "microbatch_size is for the fixed and power batchers (TaggingJobConfig.batcher fixed or "
          "power); the predictive batcher chooses its microbatches from the memory model");
  // 16-mixed (float16 autocast, loss scaling) needs --device cuda.
  check_precision_supported(precision, torch::Device(device.rfind("cuda", 0) == 0 ? torch::kCUDA : torch::kCPU));
  require(sharding == ShardingStrategy::kNoShard || batcher == BatcherKind::kPredictive,
          "sharding '" + to_string(sharding) + "' runs in the predictive batcher's data-parallel step, but "
              "TaggingJobConfig.batcher is '" + to_string(batcher) + "', which steps a plain AdamW (use sharding "
              "no_shard or batcher predictive)");
  require(sharding == ShardingStrategy::kNoShard || freeze_until_step == 0,
          "freeze_until_step " + std::to_string(freeze_until_step) + " cannot be used with sharding '" +
              to_string(sharding) + "': the sharded optimizer "
          "flattens the trainable parameters once, so parameters unfrozen later would never be stepped");
  require(!model.activation_checkpointing || architecture == TaggingArchitecture::kTransformer,
          "model.activation_checkpointing recomputes the Transformer's encoder layers; the '" +
              to_string(architecture) + "' architecture has none (use architecture transformer)");
  require(log_every >= 1, "log_every must be >= 1, got " + std::to_string(log_every));
  require(underprediction_tolerance >= 0, "underprediction_tolerance must be >= 0, got " +
                                             std::to_string(underprediction_tolerance));
  require(validate_every >= 0, "validate_every must be >= 0, got " + std::to_string(validate_every));
  require(validate_every_epochs >= 0,
          "validate_every_epochs must be >= 0, got " + std::to_string(validate_every_epochs));
  require(validation_warmup >= 0,
          "validation_warmup must be >= 0 (validations), got " + std::to_string(validation_warmup));
  require(early_stopping_patience >= 0, "early_stopping_patience must be >= 0 (0: off), got " +
                                            std::to_string(early_stopping_patience));
  require(checkpoint_every_steps >= 0,
          "checkpoint_every_steps must be >= 0, got " + std::to_string(checkpoint_every_steps));
  require(checkpoint_every_epochs >= 0,
          "checkpoint_every_epochs must be >= 0, got " + std::to_string(checkpoint_every_epochs));
  require(keep_checkpoints >= 1, "keep_checkpoints must be >= 1, got " + std::to_string(keep_checkpoints));
  require(freeze_until_step >= 0,
          "freeze_until_step must be >= 0 (0: the whole run), got " + std::to_string(freeze_until_step));
  require(freeze_until_step == 0 || !freeze.empty(),
          "freeze_until_step needs TaggingJobConfig.freeze (a regex of parameter names)");
  if (!freeze.empty()) {
    LayerFreezerOptions freezer{freeze, std::nullopt};
    if (freeze_until_step > 0) freezer.until_step = freeze_until_step;
    freezer.validate();  // a bad regex: std::invalid_argument naming it
  }
  require(clip_grad_norm >= 0 && std::isfinite(clip_grad_norm),
          "clip_grad_norm must be finite and >= 0 (0: no clipping), got " + std::to_string(clip_grad_norm));
  require(stop_after_steps >= 0,
          "stop_after_steps must be >= 0 (0: off), got " + std::to_string(stop_after_steps));
  require(variables.size() == 2 && variables[0] == "bs" && variables[1] == "l",
          "variables must be bs,l for the tagging task (batch size, padded length)");
  require(sort_by.empty() || sort_by == "l", "sort_by must be 'l' or empty, got '" + sort_by + "'");
  require(max_validation_sentences >= 0, "max_validation_sentences must be >= 0, got " +
                                             std::to_string(max_validation_sentences));
  require(probe_points.empty() || probe_points.size() >= coefficients.size(),
          "probe_points: " + std::to_string(probe_points.size()) + " given, at least one per "
          "coefficient (" + std::to_string(coefficients.size()) + ") needed");
  for (const ProbePoint& point : probe_points) {
    for (const auto& [name, value] : point.values) {
      require(value >= 1 && value <= 1e6 && value == std::floor(value),
              "probe_points: " + name + " = " + std::to_string(value) +
                  " must be a whole number in [1, 1000000]");
    }
  }
  CostFormula(formula, coefficients, variables);  // FormulaError (invalid_argument) now, not later
  const std::vector<std::string> used = coefficient_names_in(formula, variables);
  for (const std::string& name : coefficients) {
    require(std::find(used.begin(), used.end(), name) != used.end(),
            "coefficients: '" + name + "' does not appear in the formula '" + formula +
                "' (it could not be fitted)");
  }
  if (architecture == TaggingArchitecture::kBilstm) {
    bilstm.validate();
  } else {
    model.validate();
  }
}

nlohmann::json TaggingJobConfig::to_json() const {
  nlohmann::json probes = nlohmann::json::array();
  for (const ProbePoint& point : probe_points) probes.push_back(point.values);
  return {{"data_dir", data_dir},
          {"run_dir", run_dir},
          {"max_steps", max_steps},
          {"epochs", epochs},
          {"outer_batch_size", outer_batch_size},
          {"seed", seed},
          {"threads", threads},
          {"device", device},
          {"validation_every_files", validation_every_files},
          {"vocab_size", vocab_size},
          {"min_word_count", min_word_count},
          {"architecture", to_string(architecture)},
          {"bilstm",
           {{"embedding_dim", bilstm.embedding_dim},
            {"hidden_size", bilstm.hidden_size},
            {"num_layers", bilstm.num_layers},
            {"dropout", bilstm.dropout}}},
          {"model",
           {{"d_model", model.d_model},
            {"nhead", model.nhead},
            {"dim_feedforward", model.dim_feedforward},
            {"num_layers", model.num_layers},
            {"dropout", model.dropout},
            {"max_length", model.max_length},
            {"activation_checkpointing", model.activation_checkpointing}}},
          {"learning_rate", learning_rate},
          {"weight_decay", weight_decay},
          {"weight_decay_groups", weight_decay_groups},
          {"warmup_steps", warmup_steps},
          {"memory_cap_bytes", memory_cap_bytes},
          {"memory_cap_factor", memory_cap_factor},
          {"memory_fraction", memory_fraction},
          {"extra_overhead_bytes", extra_overhead_bytes},
          {"formula", formula},
          {"coefficients", coefficients},
          {"variables", variables},
          {"probe_points", probes},
          {"batcher", to_string(batcher)},
          {"microbatch_size", microbatch_size},
          {"packer", to_string(packer)},
          {"lr_schedule", to_string(lr_schedule)},
          {"precision", to_string(precision)},
          {"sharding", to_string(sharding)},
          {"optimizer_checkpoint", to_string(optimizer_checkpoint)},
          {"sort_by", sort_by},
          {"log_every", log_every},
          {"validate_every", validate_every},
          {"validate_every_epochs", validate_every_epochs},
          {"max_validation_sentences", max_validation_sentences},
          {"validation_metric", to_string(validation_metric)},
          {"validation_mode", to_string(validation_mode)},
          {"validation_warmup", validation_warmup},
          {"early_stopping_patience", early_stopping_patience},
          {"checkpoint_every_steps", checkpoint_every_steps},
          {"checkpoint_every_epochs", checkpoint_every_epochs},
          {"keep_checkpoints", keep_checkpoints},
          {"resume", resume},
          {"stop_after_steps", stop_after_steps},
          {"preemption_signal", preemption_signal == 0 ? std::string("none") : signal_name(preemption_signal)},
          {"freeze", freeze},
          {"freeze_until_step", freeze_until_step},
          {"clip_grad_norm", clip_grad_norm},
          {"memory_model_cache", memory_model_cache},
          {"underprediction_tolerance", underprediction_tolerance},
          {"backend", to_string(backend)},
          {"bucket_cap_bytes", bucket_cap_bytes},
          {"collective_timeout_s", collective_timeout_s},
          {"rendezvous_timeout_s", rendezvous_timeout_s}};
}

ValidationSettings TaggingJobConfig::validation_settings() const {
  ValidationSettings settings;
  settings.every_steps = validate_every;
  settings.every_epochs = validate_every_epochs;
  settings.metric = to_string(validation_metric);
  settings.mode = validation_mode ? *validation_mode : default_metric_mode(settings.metric);
  settings.warmup_validations = validation_warmup;
  settings.patience = early_stopping_patience;
  return settings;
}

CheckpointSettings TaggingJobConfig::checkpoint_settings() const {
  CheckpointSettings settings;
  settings.every_steps = checkpoint_every_steps;
  settings.every_epochs = checkpoint_every_epochs;
  settings.keep_last = keep_checkpoints;
  settings.keep_best = true;
  return settings;
}

std::chrono::milliseconds TaggingJobConfig::rendezvous_timeout() const {
  return std::chrono::milliseconds(static_cast<std::int64_t>(rendezvous_timeout_s * 1000));
}

DistributedOptions TaggingJobConfig::distributed_options() const {
  DistributedOptions options;
  options.backend = backend;
  if (options.backend == CollectiveBackend::kAuto) {  // NCCL for CUDA tensors, gloo for CPU ones
    options.backend = device.rfind("cuda", 0) == 0 ? CollectiveBackend::kNccl : CollectiveBackend::kGloo;
  }
  options.collective_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(collective_timeout_s * 1000));
  options.rendezvous_timeout = rendezvous_timeout();
  return options;
}

torch::Device tagging_device(const std::string& text, const std::string& source, int local_rank) {
  return training_device(text, source, local_rank);
}

std::string with_option_names(std::string message) {
  static const std::vector<std::pair<std::string, std::string>> renamed = {
      {"learning_rate", "lr"}, {"model.nhead", "heads"}, {"model.d_model", "d-model"},
      {"model.dim_feedforward", "ff-dim"}, {"model.num_layers", "layers"},
      {"model.dropout", "dropout"}, {"model.activation_checkpointing", "activation-checkpointing"},
      {"coefficients", "coefficients"}};
  const std::string prefix = "TaggingJobConfig.";
  for (std::size_t at = message.find(prefix); at != std::string::npos; at = message.find(prefix)) {
    std::size_t end = at + prefix.size();
    while (end < message.size() && (std::isalnum(static_cast<unsigned char>(message[end])) ||
                                    message[end] == '_' || message[end] == '.')) {
      ++end;
    }
    std::string field = message.substr(at + prefix.size(), end - at - prefix.size());
    std::string option = field;
    for (const auto& [from, to] : renamed) {
      if (field == from) option = to;
    }
    std::replace(option.begin(), option.end(), '_', '-');
    message.replace(at, end - at, "--" + option);
  }
  const std::string batcher_prefix = "PredictiveBatcher: ";
  if (message.rfind(batcher_prefix, 0) == 0) {
    message.replace(0, batcher_prefix.size(),
                    "memory budget (--memory-cap-bytes or --memory-cap-factor, --memory-fraction, "
                    "--extra-overhead-bytes): ");
  }
  const std::string model_prefix = "TransformerTaggerOptions.";
  if (message.rfind(model_prefix, 0) == 0) {  // the model's own check: its fields are options too
    return with_option_names("TaggingJobConfig.model." + message.substr(model_prefix.size()));
  }
  return message;
}

}  // namespace xpm
