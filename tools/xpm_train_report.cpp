// xpm-train report (see xpm_train_report.hpp).
#include "xpm_train_report.hpp"

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <utility>
#include <vector>

#include "cli_arguments.hpp"
#include "xpm/planner/atomic_file.hpp"
#include "xpm_plan/svg_plot.hpp"
#include "xpm_train_tensorboard.hpp"

namespace xpm {
namespace {

namespace fs = std::filesystem;
namespace po = boost::program_options;
using xpm_plan::Figure;
using xpm_plan::Panel;
using xpm_plan::Series;
using xpm_plan::SeriesKind;
using xpm_plan::make_series;

constexpr double kMiB = 1024.0 * 1024.0;

/// The number at `key` of `object`; nullopt when absent or null (NaN is written as null).
/// Throws std::invalid_argument when present but not a number.
std::optional<double> optional_number(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) {
    throw std::invalid_argument(std::string("\"") + key + "\" is not a number: " + it->dump());
  }
  return it->get<double>();
}

/// Dots with tooltips on a line's points (the SVG writer draws a line without tooltips), so a
/// short run's values can be read by hovering; a long run's line stays a plain line.
constexpr std::size_t kMaxDottedPoints = 200;

std::string short_number(double v, const char* format = "%.4g") {
  char text[64];
  std::snprintf(text, sizeof text, format, v);
  return text;
}

/// Appends (step, value x scale) when the value is present and finite, with the tooltip
/// "<label>, step <step>: <value x scale><unit>".
void add_point(Series& series, std::int64_t step, const std::optional<double>& value,
               double scale = 1.0, const std::string& unit = "") {
  if (!value || !std::isfinite(*value)) return;
  series.x.push_back(static_cast<double>(step));
  series.y.push_back(*value * scale);
  series.tooltips.push_back(series.label + ", step " + std::to_string(step) + ": " +
                            short_number(*value * scale) + unit);
}

/// Up to two lines describing the run from summary.json's best-known fields: the setup and the
/// results. Empty when summary.json is absent or has none of them.
std::vector<std::string> summary_notes(const nlohmann::json& summary) {
  std::vector<std::string> notes;
  if (!summary.is_object()) return notes;
  std::string setup, results;
  auto add = [](std::string& line, const std::string& text) {
    line += (line.empty() ? "" : ", ") + text;
  };
  auto number = [&](const char* key) -> std::optional<double> {
    const auto it = summary.find(key);
    if (it == summary.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  };
  if (summary.contains("batcher") && summary["batcher"].is_string()) {
    add(setup, summary["batcher"].get<std::string>() + " batcher");
  }
  if (const auto v = number("world_size")) add(setup, "world size " + short_number(*v));
  if (const auto v = number("train_steps")) add(setup, short_number(*v, "%.0f") + " steps");
  if (const auto v = number("final_loss")) add(results, "final loss " + short_number(*v));
  if (const auto v = number("val_token_accuracy")) {
    add(results, "validation token accuracy " + short_number(*v * 100, "%.2f") + " %");
  }
  if (const auto v = number("tokens_per_s")) add(results, short_number(*v, "%.0f") + " tokens/s");
  if (!setup.empty()) notes.push_back("summary.json: " + setup);
  if (!results.empty()) notes.push_back((setup.empty() ? "summary.json: " : "") + results);
  return notes;
}

Figure figure(const std::string& title, const nlohmann::json& summary) {
  Figure fig;
  fig.title = title;
  fig.notes = summary_notes(summary);
  return fig;
}

/// Appends `line` and, when it has at most kMaxDottedPoints points (or `always_dots`), its
/// points as unlabeled dots carrying the tooltips.
void add_line(Panel& panel, Series line, bool always_dots = false) {
  if (line.x.empty()) return;
  const bool dots = always_dots || line.x.size() <= kMaxDottedPoints;
  Series points = line;
  points.kind = SeriesKind::kPoints;
  points.label = "";
  panel.series.push_back(std::move(line));
  if (dots) panel.series.push_back(std::move(points));
}

/// A panel with step on the x axis, starting at 0.
Panel& step_panel(Figure& fig, const std::string& y_label) {
  Panel& panel = fig.add_panel("step", y_label);
  panel.x_min = 0;
  return panel;
}

/// Notes under the memory figure: the largest |predicted - peak allocated| / peak allocated over
/// the steps that have both, and the largest peak allocated against the capacity.
std::vector<std::string> memory_notes(const TrainMetrics& metrics) {
  double max_rel_error = 0, max_peak = 0, capacity = 0;
  std::size_t compared = 0;
  for (const TrainStepMetrics& s : metrics.steps) {
    if (s.peak_allocated_bytes) max_peak = std::max(max_peak, *s.peak_allocated_bytes);
    if (s.capacity_bytes) capacity = std::max(capacity, *s.capacity_bytes);
    if (s.peak_allocated_bytes && s.predicted_peak_bytes && *s.peak_allocated_bytes > 0) {
      max_rel_error = std::max(max_rel_error,
                               std::fabs(*s.predicted_peak_bytes - *s.peak_allocated_bytes) /
                                   *s.peak_allocated_bytes);
      ++compared;
    }
  }
  std::vector<std::string> notes;
  if (compared > 0) {
    notes.push_back("predicted vs peak allocated: max |relative error| " +
                    short_number(max_rel_error * 100, "%.3g") + " % over " +
                    std::to_string(compared) + " steps");
  }
  if (max_peak > 0) {
    notes.push_back("max peak allocated " + short_number(max_peak / kMiB, "%.1f") + " MiB" +
                    (capacity > 0 ? " of " + short_number(capacity / kMiB, "%.1f") +
                                        " MiB capacity"
                                  : std::string()));
  }
  return notes;
}

/// Validations from summary.json's "validations" list ({step, val_token_accuracy}).
std::vector<TrainValidationMetrics> summary_validations(const nlohmann::json& summary) {
  std::vector<TrainValidationMetrics> validations;
  if (!summary.is_object() || !summary.contains("validations") ||
      !summary["validations"].is_array()) {
    return validations;
  }
  for (const nlohmann::json& entry : summary["validations"]) {
    if (!entry.is_object() || !entry.contains("step") || !entry["step"].is_number_integer()) {
      continue;
    }
    TrainValidationMetrics v;
    v.step = entry["step"].get<std::int64_t>();
    v.token_accuracy = optional_number(entry, "val_token_accuracy");
    v.loss = optional_number(entry, "val_loss");
    validations.push_back(v);
  }
  return validations;
}

po::options_description report_options() {
  po::options_description desc(
      "xpm-train report RUN_DIR [--out DIR] [--tensorboard]\n"
      "Draws a training run's curves from RUN_DIR/metrics.jsonl (and RUN_DIR/summary.json when\n"
      "present) as SVG files: loss.svg, validation_accuracy.svg (when the run validated),\n"
      "tokens_per_s.svg, memory.svg (peak allocated vs predicted peak vs capacity).\n"
      "Exit codes: 0 success, 2 bad input, 1 cannot write the output.\nOptions");
  desc.add_options()
      ("help,h", "show this help")
      ("run-dir", po::value<std::string>(), "the run folder written by xpm-train (positional)")
      ("out", po::value<std::string>(), "output folder (default RUN_DIR/report)")
      ("tensorboard", po::bool_switch()->default_value(false),
       "also write a TensorBoard event file of the same scalars to OUT/tensorboard/");
  return desc;
}

}  // namespace

TrainMetrics read_train_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw TrainReportInputError(path + ": cannot open the file");
  TrainMetrics metrics;
  std::string text;
  std::int64_t line_number = 0;
  while (std::getline(in, text)) {
    ++line_number;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + " line " + std::to_string(line_number) + ": ";
    nlohmann::json line;
    try {
      line = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      throw TrainReportInputError(where + "not valid JSON (" + e.what() + ")");
    }
    if (!line.is_object()) throw TrainReportInputError(where + "expected a JSON object");
    if (!line.contains("step") || !line["step"].is_number_integer()) {
      throw TrainReportInputError(where + "no integer \"step\"");
    }
    const std::int64_t step = line["step"].get<std::int64_t>();
    try {
      if (line.contains("validation") || line.contains("val_token_accuracy")) {
        TrainValidationMetrics v;
        v.step = step;
        if (line.contains("validation")) {
          const nlohmann::json& validation = line["validation"];
          if (!validation.is_object()) {
            throw std::invalid_argument("\"validation\" is not an object");
          }
          v.token_accuracy = optional_number(validation, "token_accuracy");
          v.loss = optional_number(validation, "loss");
        } else {
          v.token_accuracy = optional_number(line, "val_token_accuracy");
          v.loss = optional_number(line, "val_loss");
        }
        metrics.validations.push_back(v);
      } else {
        TrainStepMetrics s;
        s.step = step;
        s.loss = optional_number(line, "loss");
        s.tokens_per_s = optional_number(line, "tokens_per_s");
        s.peak_allocated_bytes = optional_number(line, "peak_allocated_bytes");
        s.predicted_peak_bytes = optional_number(line, "predicted_peak_bytes");
        s.capacity_bytes = optional_number(line, "capacity_bytes");
        metrics.steps.push_back(s);
      }
    } catch (const std::invalid_argument& e) {
      throw TrainReportInputError(where + e.what());
    }
  }
  if (in.bad()) throw TrainReportInputError(path + ": read error");
  if (metrics.steps.empty()) {
    throw TrainReportInputError(path + ": no optimizer-step lines (is this a run folder?)");
  }
  return metrics;
}

std::vector<std::pair<std::string, std::string>> train_report_figures(
    const TrainMetrics& metrics, const nlohmann::json& summary) {
  std::vector<std::pair<std::string, std::string>> figures;
  const std::vector<TrainValidationMetrics> validations =
      metrics.validations.empty() ? summary_validations(summary) : metrics.validations;

  {
    Figure fig = figure("Loss per optimizer step", summary);
    Panel& panel = step_panel(fig, "loss");
    Series train = make_series("training loss", SeriesKind::kLine, "#1f77b4");
    for (const TrainStepMetrics& s : metrics.steps) add_point(train, s.step, s.loss);
    add_line(panel, std::move(train));
    Series validation = make_series("validation loss", SeriesKind::kPoints, "#ff7f0e");
    for (const TrainValidationMetrics& v : validations) add_point(validation, v.step, v.loss);
    if (!validation.x.empty()) panel.series.push_back(std::move(validation));
    figures.emplace_back("loss.svg", fig.render());
  }
  {
    Series accuracy = make_series("validation token accuracy", SeriesKind::kLine, "#2ca02c");
    for (const TrainValidationMetrics& v : validations) {
      add_point(accuracy, v.step, v.token_accuracy, 100.0, " %");
    }
    if (!accuracy.x.empty()) {
      Figure fig = figure("Validation token accuracy", summary);
      Panel& panel = step_panel(fig, "token accuracy (%)");
      add_line(panel, std::move(accuracy), /*always_dots=*/true);
      figures.emplace_back("validation_accuracy.svg", fig.render());
    }
  }
  {
    Figure fig = figure("Training throughput", summary);
    Panel& panel = step_panel(fig, "tokens/s");
    panel.include_zero_y = true;
    Series tokens = make_series("tokens/s", SeriesKind::kLine, "#9467bd");
    for (const TrainStepMetrics& s : metrics.steps) add_point(tokens, s.step, s.tokens_per_s);
    add_line(panel, std::move(tokens));
    figures.emplace_back("tokens_per_s.svg", fig.render());
  }
  {
    Figure fig = figure("Memory per optimizer step", summary);
    for (std::string& note : memory_notes(metrics)) fig.notes.push_back(std::move(note));
    Panel& panel = step_panel(fig, "MiB");
    Series peak = make_series("peak allocated", SeriesKind::kLine, "#1f77b4");
    Series predicted = make_series("predicted peak", SeriesKind::kLine, "#ff7f0e");
    Series capacity = make_series("capacity", SeriesKind::kLine, "#d62728");
    for (const TrainStepMetrics& s : metrics.steps) {
      add_point(peak, s.step, s.peak_allocated_bytes, 1.0 / kMiB, " MiB");
      add_point(predicted, s.step, s.predicted_peak_bytes, 1.0 / kMiB, " MiB");
      add_point(capacity, s.step, s.capacity_bytes, 1.0 / kMiB, " MiB");
    }
    for (Series* series : {&peak, &predicted, &capacity}) add_line(panel, std::move(*series));
    figures.emplace_back("memory.svg", fig.render());
  }
  return figures;
}

int run_train_report(int argc, char** argv) {
  const po::options_description desc = report_options();
  po::positional_options_description positional;
  positional.add("run-dir", 1);
  po::variables_map vm;
  try {
    po::store(xpm_cli::parse_command_line(std::vector<std::string>(argv + 1, argv + argc), desc, positional,
                                          "xpm-train report takes one RUN_DIR; see xpm-train report --help"),
              vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::cerr << "xpm-train report: error: " << e.what() << " (see xpm-train report --help)\n";
    return 2;
  } catch (const std::invalid_argument& e) {
    std::cerr << "xpm-train report: error: " << e.what() << "\n";
    return 2;
  }
  if (vm.count("help")) {
    std::cout << desc;
    return 0;
  }
  if (!vm.count("run-dir")) {
    std::cerr << "xpm-train report: error: no RUN_DIR given (see xpm-train report --help)\n";
    return 2;
  }
  const std::string run_dir = vm["run-dir"].as<std::string>();
  const std::string out_dir =
      vm.count("out") ? vm["out"].as<std::string>() : (fs::path(run_dir) / "report").string();

  TrainMetrics metrics;
  nlohmann::json summary;
  try {
    if (!fs::is_directory(run_dir)) {
      throw TrainReportInputError("the run folder '" + run_dir + "' does not exist");
    }
    metrics = read_train_metrics((fs::path(run_dir) / "metrics.jsonl").string());
    const std::string summary_path = (fs::path(run_dir) / "summary.json").string();
    if (fs::exists(summary_path)) {
      std::ifstream in(summary_path);
      try {
        in >> summary;
      } catch (const nlohmann::json::exception& e) {
        throw TrainReportInputError(summary_path + ": not valid JSON (" + e.what() + ")");
      }
    }
  } catch (const TrainReportInputError& e) {
    std::cerr << "xpm-train report: error: " << e.what() << "\n";
    return 2;
  }

  try {
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (ec) throw std::runtime_error("cannot create '" + out_dir + "': " + ec.message());
    for (const auto& [name, svg] : train_report_figures(metrics, summary)) {
      const std::string path = (fs::path(out_dir) / name).string();
      write_file_atomically(path, svg);
      std::cout << "wrote " << path << "\n";
    }
    if (vm["tensorboard"].as<bool>()) {
      const std::string tb_dir = (fs::path(out_dir) / "tensorboard").string();
      fs::create_directories(tb_dir, ec);
      if (ec) throw std::runtime_error("cannot create '" + tb_dir + "': " + ec.message());
      std::cout << "wrote " << write_tensorboard_events(metrics, tb_dir) << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "xpm-train report: error: " << e.what() << "\n";
    return 1;
  }
  std::cout << "xpm-train report: " << metrics.steps.size() << " steps, "
            << metrics.validations.size() << " validation lines\n";
  return 0;
}

}  // namespace xpm
