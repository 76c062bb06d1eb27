// xpm-train report RUN_DIR [--out DIR] [--tensorboard]: figures of a training run from its
// metrics.jsonl (and summary.json when present), as SVG files:
//   loss.svg                 training loss per optimizer step (and validation loss)
//   validation_accuracy.svg  validation token accuracy per step (when the run validated)
//   tokens_per_s.svg         training throughput per step
//   memory.svg               peak allocated vs predicted peak vs capacity bytes, per step
// With --tensorboard, also a TensorBoard event file (xpm_train_tensorboard.hpp) of the same
// scalars under DIR/tensorboard/.
//
//   xpm-train report runs/tagger            # writes runs/tagger/report/*.svg
//
// Exit codes: 0 success, 2 bad input (missing folder or file, malformed line: its line number),
// 1 other failure (cannot write the output).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xpm {

/// One optimizer-step line of metrics.jsonl. Fields absent or null in the line are nullopt.
struct TrainStepMetrics {
  std::int64_t step = 0;
  std::optional<double> loss;                  // training loss of the step
  std::optional<double> tokens_per_s;          // real tokens / step duration
  std::optional<double> peak_allocated_bytes;  // measured peak of the step
  std::optional<double> predicted_peak_bytes;  // the memory model's prediction (predictive batcher)
  std::optional<double> capacity_bytes;        // the budget the batcher planned against
};

/// One validation: a metrics.jsonl line with a "validation" object (token_accuracy, loss), or
/// an entry of summary.json's "validations" (val_token_accuracy).
struct TrainValidationMetrics {
  std::int64_t step = 0;
  std::optional<double> token_accuracy;  // fraction in [0, 1]
  std::optional<double> loss;
};

struct TrainMetrics {
  std::vector<TrainStepMetrics> steps;              // in file order
  std::vector<TrainValidationMetrics> validations;  // in file order
};

/// Bad content of a run folder's file; what() reads "<path> line <n>: <reason>" or
/// "<path>: <reason>".
struct TrainReportInputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// Reads metrics.jsonl: one JSON object per line, each with an integer "step"; lines with a
/// "validation" object (or a top-level "val_token_accuracy") are validations, the others
/// optimizer steps. Blank lines are skipped. Throws TrainReportInputError naming the path and
/// the 1-based line number of a malformed line, or when the file cannot be opened.
TrainMetrics read_train_metrics(const std::string& path);

/// The four figures (file name -> SVG document) for `metrics`; `summary` (summary.json, or null)
/// adds a line of notes and, when metrics.jsonl has no validation lines, the validations it
/// lists. A figure without any data is left out (validation_accuracy.svg for a run that did not
/// validate).
std::vector<std::pair<std::string, std::string>> train_report_figures(
    const TrainMetrics& metrics, const nlohmann::json& summary);

/// The `xpm-train report` command; argv[0] is "report". Returns the exit code.
int run_train_report(int argc, char** argv);

}  // namespace xpm
