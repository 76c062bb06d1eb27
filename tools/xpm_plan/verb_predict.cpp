// xpm-plan predict: predicted peak bytes of a memory model at given dims (CSV rows or --dims).
#include <cmath>
#include <cstdint>
#include <iostream>

#include "common.hpp"
#include "csv_table.hpp"
#include "verbs.hpp"

namespace xpm_plan {

po::options_description predict_options() {
  po::options_description desc(
      "xpm-plan predict --model M (--csv FILE | --dims bs=8,l=128) [--json]\n"
      "Predicted peak bytes, max(floor, formula), per CSV row (variables read from the columns\n"
      "of the same names; other columns ignored) or at one point given with --dims. Dims must\n"
      "be >= 0, the batch-size variable > 0 (exit code 2 naming the line and column).\n"
      "--json prints a JSON object: predicted_bytes (one byte count, an integer, per row), rows\n"
      "(per row its source, dims, predicted_bytes and extrapolation: the variables beyond the\n"
      "probed ranges) and extrapolated_rows (how many rows extrapolate).\nOptions");
  desc.add_options()
      ("help,h", "show this help")
      ("model", po::value<std::string>()->required(), "memory model JSON (required)")
      ("csv", po::value<std::string>(), "CSV with one column per variable (also positional)")
      ("dims", po::value<std::vector<std::string>>()->composing(),
       "VAR=VALUE for every variable, e.g. bs=8,l=128 (repeatable or comma-separated)")
      ("json", po::bool_switch()->default_value(false), "print a JSON object instead of text");
  return desc;
}

int run_predict(const po::variables_map& vm) {
  const bool has_csv = vm.count("csv") != 0;
  const bool has_dims = vm.count("dims") != 0;
  if (has_csv == has_dims) throw InputError("give exactly one of --csv FILE and --dims VAR=VALUE,...");
  const xpm::MemoryModel model = load_model(vm["model"].as<std::string>());
  const auto& vars = model.formula().variable_names();

  std::vector<std::vector<double>> rows;
  std::vector<std::string> labels;
  if (has_dims) {
    const auto map = parse_assignments(vm["dims"].as<std::vector<std::string>>(), "dims");
    try {
      rows.push_back(model.formula().dims_from_map(map, "--dims"));
    } catch (const std::invalid_argument& e) {
      throw InputError(first_line(e.what()));
    }
    check_dims(rows.back(), vars, model.batch_size_index(), "predict: --dims");
    labels.push_back("--dims");
  } else {
    const CsvTable table = read_csv(vm["csv"].as<std::string>());
    std::vector<std::size_t> columns;
    for (const auto& v : vars) columns.push_back(table.column(v));
    for (std::size_t r = 0; r < table.rows.size(); ++r) {
      std::vector<double> dims;
      for (std::size_t v = 0; v < columns.size(); ++v) {
        dims.push_back(table.dim(r, columns[v], "predict", v == model.batch_size_index()));
      }
      rows.push_back(std::move(dims));
      labels.push_back("line " + std::to_string(table.line_numbers[r]));
    }
  }

  std::vector<std::int64_t> predicted;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const double bytes = model.predict_bytes(rows[i]);
    if (!std::isfinite(bytes) || std::fabs(bytes) > 9.0e18) {
      throw InputError(labels[i] + ": " + dims_text(model, rows[i]) +
                       ": the prediction is not a finite byte count (" + number_text(bytes) + ")");
    }
    predicted.push_back(std::llround(bytes));
  }
  if (vm["json"].as<bool>()) {
    nlohmann::json details = nlohmann::json::array();
    std::size_t extrapolated = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      nlohmann::json beyond = extrapolation_json(model, rows[i]);
      extrapolated += beyond.empty() ? 0 : 1;
      details.push_back({{"source", labels[i]},
                         {"dims", dims_json(model, rows[i])},
                         {"predicted_bytes", predicted[i]},
                         {"extrapolation", std::move(beyond)}});
    }
    std::cout << nlohmann::json{{"predicted_bytes", predicted},
                                {"rows", std::move(details)},
                                {"extrapolated_rows", extrapolated}}
                     .dump()
              << "\n";
  } else {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::cout << dims_text(model, rows[i]) << ": " << predicted[i] << " bytes ("
                << mib_text(static_cast<double>(predicted[i])) << ")"
                << (has_csv ? "  [" + labels[i] + "]" : "") << extrapolation_text(model, rows[i])
                << "\n";
    }
  }
  return 0;
}

}  // namespace xpm_plan
