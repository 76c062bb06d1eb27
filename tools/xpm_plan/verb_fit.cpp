// xpm-plan fit: fit a cost formula to measured peaks (CSV or JSON), print the fit report, save
// the memory model and optionally a figure of measured vs predicted bytes with residuals.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <iostream>
#include <optional>
#include <regex>

#include "common.hpp"
#include "figures.hpp"
#include "fit_report.hpp"
#include "measurements.hpp"
#include "verbs.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/floor_model.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/formula_selection.hpp"
#include "xpm/planner/memory_model.hpp"

namespace xpm_plan {
namespace {

// The formula's names that are not variables: the default coefficient list.
std::vector<std::string> infer_coefficients(const std::string& text,
                                            const std::vector<std::string>& variables) {
  std::vector<std::string> names;
  try {
    names = xpm::coefficient_names_in(text, variables);
  } catch (const xpm::FormulaError& e) {
    throw InputError("--formula '" + text + "': " + e.brief());
  }
  if (names.empty()) {
    try {  // a formula that does not parse says where, before its (missing) coefficients are counted
      (void)xpm::CostFormula::with_variables(text, variables);
    } catch (const xpm::FormulaError& e) {
      throw InputError("--formula '" + text + "': " + e.brief());
    } catch (const std::invalid_argument&) {
    }
    std::string listed;
    for (const std::string& v : variables) listed += (listed.empty() ? "" : ", ") + v;
    throw InputError("--formula '" + text + "': no coefficient to fit (no name in it besides the variables " + listed +
                     ")");
  }
  return names;
}

std::map<std::string, xpm::DimAggregation> parse_aggregation(const std::vector<std::string>& args) {
  std::map<std::string, xpm::DimAggregation> out;
  for (const std::string& arg : args) {
    for (const std::string& item : split_list(arg, "aggregation")) {
      const auto eq = item.find('=');
      if (eq == std::string::npos) {
        throw InputError("--aggregation: expected VAR=count|max|sum, got '" + item + "'");
      }
      const std::string name = trim(item.substr(0, eq));
      if (out.count(name)) throw InputError("--aggregation: " + name + " is given twice");
      try {
        out[name] = xpm::parse_dim_aggregation(trim(item.substr(eq + 1)), "the aggregation");
      } catch (const std::invalid_argument& e) {
        throw InputError("--aggregation " + item + ": " + first_line(e.what()));
      }
    }
  }
  return out;
}

std::vector<std::vector<double>> dims_of(const std::vector<xpm::Measurement>& measurements) {
  std::vector<std::vector<double>> out;
  for (const xpm::Measurement& m : measurements) out.push_back(m.dims);
  return out;
}

// --floor-column: the floor fitted to that column (constant or formula, --floor-model); none
// without the column. --floor-model and --floor-formula need the column.
std::optional<xpm::FloorFit> fit_floor_column(const po::variables_map& vm,
                                              const xpm::CostFormula& formula,
                                              const MeasurementSet& set) {
  xpm::FloorOptions options;
  try {
    options.mode = xpm::parse_floor_mode(vm["floor-model"].as<std::string>(), "--floor-model");
  } catch (const std::invalid_argument& e) {
    throw InputError(first_line(e.what()));  // names --floor-model
  }
  if (vm.count("floor-formula")) options.formula = vm["floor-formula"].as<std::string>();
  if (!set.floor_bytes) {
    if (!vm["floor-model"].defaulted() || vm.count("floor-formula")) {
      throw InputError(std::string(vm.count("floor-formula") ? "--floor-formula" : "--floor-model") +
                       " needs --floor-column (the measured floor it is fitted to)");
    }
    return std::nullopt;
  }
  if (set.floor_peaks.empty()) return std::nullopt;  // no feasible measurement: refused later
  try {
    if (!options.formula.empty()) (void)xpm::floor_formula_for(formula, options);  // checked even when unused
    return xpm::fit_floor(formula, set.floor_peaks, 0.0, options);
  } catch (const xpm::FormulaError& e) {
    throw InputError("--floor-formula '" + options.formula + "': " + first_line(e.what()));
  } catch (const std::invalid_argument& e) {
    throw InputError("--floor-column " + vm["floor-column"].as<std::string>() + ": " +
                     first_line(e.what()));
  }
}

std::string all_terms_text(const std::vector<std::string>& variables, const std::string& bs_variable) {
  try {
    return xpm::all_terms_formula(variables, bs_variable, "");
  } catch (const std::invalid_argument& e) {
    throw InputError("--batch-size-variable: " + first_line(e.what()));
  }
}

// The measurements file and what to read from it (--csv or the positional argument,
// --bytes-column, --variables, --floor-column, --batch-size-variable).
MeasurementRequest measurement_request_from(const po::variables_map& vm) {
  MeasurementRequest request;
  if (vm.count("measurements") && vm.count("csv")) {
    throw InputError("give the measurements once: --csv '" + vm["csv"].as<std::string>() +
                     "' and '" + vm["measurements"].as<std::string>() + "'");
  }
  if (vm.count("csv")) {
    request.path = vm["csv"].as<std::string>();
    request.format = MeasurementFormat::kCsv;
  } else if (vm.count("measurements")) {
    request.path = vm["measurements"].as<std::string>();
  } else {
    throw InputError("no measurements file: give it as the first argument or with --csv");
  }
  request.bytes_column = vm["bytes-column"].as<std::string>();
  if (vm.count("variables")) {
    request.variables = split_list(vm["variables"].as<std::string>(), "variables");
  }
  if (vm.count("floor-column")) {
    if (vm.count("floor-bytes")) throw InputError("give --floor-bytes or --floor-column, not both");
    request.floor_column = vm["floor-column"].as<std::string>();
    if (trim(request.floor_column).empty()) throw InputError("--floor-column is empty: give the column's name");
  }
  request.verb = "fit";
  request.count_variable = vm["batch-size-variable"].as<std::string>();
  if (!vm["batch-size-variable"].defaulted() && trim(request.count_variable).empty()) {
    throw InputError("--batch-size-variable is empty: give a variable's name, or leave it out (the first variable)");
  }
  return request;
}

// --probe-capacity-bytes, 0 when not given.
double probe_capacity_option(const po::variables_map& vm) {
  if (!vm.count("probe-capacity-bytes")) return 0;
  const double bytes = vm["probe-capacity-bytes"].as<double>();
  if (!(bytes > 0) || !std::isfinite(bytes)) {
    throw InputError("--probe-capacity-bytes must be > 0, got " + number_text(bytes));
  }
  return bytes;
}

// --coefficients, or the formula's names that are not variables; a declared coefficient the
// formula never uses cannot be fitted.
std::vector<std::string> coefficients_of(const po::variables_map& vm, const std::string& formula_text,
                                         const std::string& given_text,
                                         const std::vector<std::string>& variables) {
  if (!vm.count("coefficients")) return infer_coefficients(given_text, variables);
  const std::vector<std::string> coefficients =
      split_list(vm["coefficients"].as<std::string>(), "coefficients");
  const std::vector<std::string> used = infer_coefficients(formula_text, variables);
  for (const std::string& name : coefficients) {
    if (std::find(variables.begin(), variables.end(), name) != variables.end()) {
      throw InputError("--coefficients: '" + name + "' is a variable (--variables), not a coefficient");
    }
    if (std::find(used.begin(), used.end(), name) == used.end()) {
      throw InputError("--coefficients: '" + name + "' does not appear in --formula '" +
                       formula_text + "'");
    }
  }
  return coefficients;
}

// A coefficient named like a column of the file is most likely a variable left out of
// --variables ('h*bs*l + c' with --variables bs,l and a column h): refused unless --coefficients
// declares it.
void refuse_column_coefficients(const po::variables_map& vm, const std::string& formula_text,
                                const std::vector<std::string>& coefficients, const MeasurementSet& set) {
  if (vm.count("coefficients")) return;
  for (const std::string& name : coefficients) {
    if (std::find(set.columns.begin(), set.columns.end(), name) == set.columns.end()) continue;
    throw InputError("--formula '" + formula_text + "': '" + name + "' is a column of " + set.path +
                     " but not one of --variables, so it would be fitted as a coefficient; add it to "
                     "--variables, or declare the coefficients with --coefficients");
  }
}

// A variable the formula does not use (other than the batch size, which counts records) would be
// asked of every prediction and change none: --variables bs,l,opt for 'a*bs*l + c'.
void refuse_unused_variables(const xpm::CostFormula& formula, const std::string& bs_variable) {
  for (const std::string& name : formula.variable_names()) {
    if (name == bs_variable || std::regex_search(formula.canonical(), std::regex("\\b" + name + "\\b"))) continue;
    throw InputError("--variables: '" + name + "' does not appear in --formula '" + formula.text() +
                     "': every prediction would need it and none would change with it; leave it out");
  }
}

// The floor the fit sits on: --floor-bytes, or fitted to --floor-column.
struct Floor {
  double bytes = 0;
  std::optional<xpm::FloorFit> fit;
  std::optional<xpm::PeakPlateau> plateau;  // the floor is this plateau of the peaks
  bool moving() const { return fit && fit->formula; }
};

// A model with every coefficient 0 and the floor: validates the batch-size variable, the
// aggregation and the floor before fitting.
xpm::MemoryModel floor_only_model(const xpm::CostFormula& formula, std::size_t coefficient_count,
                                  const Floor& floor, const std::string& bs_variable,
                                  const std::map<std::string, xpm::DimAggregation>& aggregation) {
  try {
    xpm::MemoryModel model(formula, std::vector<double>(coefficient_count, 0.0), floor.bytes,
                           bs_variable, aggregation);
    if (floor.moving()) model.set_floor_formula(*floor.fit->formula);
    return model;
  } catch (const std::invalid_argument& e) {
    throw InputError(option_names(first_line(e.what())));
  }
}

// --above-floor-only: drops the measurements at or below the floor; at least as many as
// coefficients must stay.
void keep_above_floor(const xpm::MemoryModel& floor_model, const Floor& floor,
                      std::size_t coefficient_count, MeasurementSet& set) {
  if (!(floor.bytes > 0) && !floor.moving()) {
    throw InputError("--above-floor-only needs a floor: --floor-bytes or --floor-column");
  }
  const std::size_t feasible = set.measurements.size();
  set.keep_above_floor(floor_model);
  if (set.measurements.size() < coefficient_count) {
    throw InputError(set.path + ": --above-floor-only keeps " +
                     std::to_string(set.measurements.size()) + " of " +
                     std::to_string(feasible) + " measurements (above the " +
                     (floor.moving() ? std::string("floor formula") : "floor of " + bytes_text(floor.bytes) + " bytes") +
                     "), fewer than the " +
                     std::to_string(coefficient_count) +
                     " coefficients: probe larger shapes");
  }
}

// Infeasible probes with a known capacity (their own, --probe-capacity-bytes or the file's):
// lower bounds of the fit, limits of the plans.
std::vector<xpm::InfeasibleBound> infeasible_bounds(const MeasurementSet& set,
                                                    double probe_capacity_bytes) {
  if (probe_capacity_bytes == 0 && set.setup.contains("capacity_bytes") &&
      set.setup["capacity_bytes"].is_number()) {
    probe_capacity_bytes = std::max(0.0, set.setup["capacity_bytes"].get<double>());
  }
  std::vector<xpm::InfeasibleBound> bounds;
  for (std::size_t i = 0; i < set.infeasible.size(); ++i) {
    const double capacity = set.infeasible_capacity_bytes[i] > 0 ? set.infeasible_capacity_bytes[i]
                                                                 : probe_capacity_bytes;
    if (capacity > 0) bounds.push_back({set.infeasible[i], capacity});
  }
  return bounds;
}

// The fitted model's metadata: the probes' setup, the fit, the floor, the probes themselves and
// the formula selection (--formula auto).
void set_fit_metadata(xpm::MemoryModel& model, const MeasurementSet& set, const FitOutcome& outcome,
                      const MeasurementRequest& request, std::size_t bound_count,
                      const Floor& floor, bool automatic) {
  nlohmann::json probes = nlohmann::json::array();
  for (const auto& r : set.all_records) probes.push_back(r);
  for (const auto& item : set.setup.items()) model.metadata()[item.key()] = item.value();
  model.metadata()["created_by"] = "xpm-plan fit";
  model.metadata()["source"] = set.path;
  model.metadata()["fit"] = fit_summary_json(outcome.result.summary, outcome);
  model.metadata()["fit"]["fitted_to"] = request.bytes_column;
  model.metadata()["fit"]["points"] = set.measurements.size();
  model.metadata()["fit"]["infeasible_probes"] = set.infeasible.size();
  model.metadata()["fit"]["infeasible_bound_count"] = bound_count;
  model.metadata()["fit"]["below_floor_not_fitted"] = set.below_floor.size();
  if (!request.floor_column.empty()) model.metadata()["floor_from"] = request.floor_column;
  if (floor.fit) {
    model.metadata()["floor"] = {{"report", floor.fit->report},
                                 {"spread", floor.fit->spread},
                                 {"moving", floor.fit->formula.has_value()},
                                 {"plateau", floor.plateau.has_value()}};
    if (floor.plateau) {
      model.metadata()["floor"]["report"] = xpm::plateau_floor_report(*floor.plateau, floor.fit->constant_bytes);
    }
  }
  model.metadata()["probes"] = std::move(probes);
  if (automatic) {
    model.metadata()["formula_selection"] = {{"chosen", model.formula().canonical()},
                                             {"report", outcome.selection_report}};
  }
}

// Renders everything, then writes (--figure, --output): a failure leaves no file behind. An
// unusable fit prints its report and writes nothing (exit code 1).
int report_and_write(const po::variables_map& vm, const xpm::MemoryModel& model,
                     const MeasurementSet& set, const FitOutcome& outcome,
                     const MeasurementRequest& request) {
  const xpm::FitSummary& s = outcome.result.summary;
  const std::string output = vm.count("output") ? vm["output"].as<std::string>() : "";
  const std::string figure = vm.count("figure") ? vm["figure"].as<std::string>() : "";
  std::string figure_svg;
  if (!figure.empty()) figure_svg = fit_figure_svg(model, set, s, request.bytes_column);
  if (!outcome.usable) {
    print_fit_report(std::cout, model, set, s, outcome, vm["json"].as<bool>(), "", "");
    throw InfeasibleError("the fit is not usable: " + outcome.unusable_reason +
                          "; no file written");
  }
  if (!figure.empty()) write_file_atomically(figure, figure_svg);
  if (!output.empty()) model.save(output);
  print_fit_report(std::cout, model, set, s, outcome, vm["json"].as<bool>(), output, figure);
  if (!s.converged) std::cerr << "xpm-plan: warning: the fit did not converge\n";
  return 0;
}

// What every fit of one command shares.
struct FitInputs {
  const po::variables_map& vm;
  const MeasurementRequest& request;
  const FitRequest& fit_request;
  const xpm::CostFormula& formula;  // --formula auto: every candidate term
  const std::vector<std::string>& coefficients;
  const std::vector<std::string>& variables;
  const std::string& bs_variable;
  const std::map<std::string, xpm::DimAggregation>& aggregation;
  const std::vector<xpm::ProbedRange>& probed_ranges;
  bool automatic;
  double probe_capacity_bytes;
};

// A fit over one floor: the measurements it fitted, its outcome and its model.
struct FloorFitted {
  MeasurementSet set;
  FitOutcome outcome;
  xpm::MemoryModel model;
};

FloorFitted fit_over_floor(const FitInputs& in, const Floor& floor, MeasurementSet set) {
  // Not fitted: the measurements at or below the floor, and those on its plateau (within 1 %).
  Floor excluded = floor;
  if (floor.plateau) excluded.bytes = floor.plateau->top_bytes;
  const xpm::MemoryModel floor_model =
      floor_only_model(in.formula, in.coefficients.size(), excluded, in.bs_variable, in.aggregation);
  if (set.measurements.empty()) {
    throw InfeasibleError(set.path + ": no feasible measurement to fit (" +
                          std::to_string(set.infeasible.size()) + " ran out of memory)");
  }
  if (in.vm["above-floor-only"].as<bool>()) keep_above_floor(floor_model, floor, in.coefficients.size(), set);
  const std::vector<xpm::InfeasibleBound> bounds = infeasible_bounds(set, in.probe_capacity_bytes);
  std::vector<std::string> summed;
  for (const auto& [name, how] : in.aggregation) {
    if (how == xpm::DimAggregation::kSum) summed.push_back(name);
  }
  FitOutcome outcome =
      in.automatic ? fit_automatic_formula(in.variables, set, in.fit_request, in.bs_variable, bounds,
                                           floor.bytes > 0 || floor.moving(), summed)
                   : fit_measurements(in.formula, set, in.fit_request, in.bs_variable, bounds);
  xpm::MemoryModel model(in.automatic ? *outcome.chosen_formula : in.formula, outcome.result.coefficients,
                         floor.bytes, in.bs_variable, in.aggregation);
  model.set_infeasible_probes(bounds);
  model.set_single_record_factor(outcome.result.summary.single_record_factor);
  model.set_single_record_coefficients(outcome.result.summary.single_record_coefficients);
  if (floor.moving()) model.set_floor_formula(*floor.fit->formula);
  model.set_probed_ranges(in.probed_ranges);
  set_fit_metadata(model, set, outcome, in.request, bounds.size(), floor, in.automatic);
  return {std::move(set), std::move(outcome), std::move(model)};
}

// Every feasible measurement's step peak: the larger of its bytes and its floor column's value.
std::vector<xpm::Measurement> step_peaks_of(const MeasurementSet& all) {
  std::vector<xpm::Measurement> peaks;
  for (std::size_t i = 0; i < all.measurements.size(); ++i) {
    const double floor = i < all.floor_peaks.size() ? all.floor_peaks[i].bytes : 0.0;
    peaks.push_back({all.measurements[i].dims, std::max(all.measurements[i].bytes, floor)});
  }
  return peaks;
}

}  // namespace

po::options_description fit_options() {
  po::options_description desc(
      "xpm-plan fit [MEASUREMENTS] --formula F --bytes-column C [options]\n"
      "Fits the coefficients of a cost formula to measured peak bytes (Ceres, relative "
      "residuals,\nnon-negative by default), prints the fit report and saves the memory model.\n"
      "MEASUREMENTS is a CSV file, a JSON list of objects, a memory model file (its probes) or\n"
      "`xpm-plan probe --json` output; the format is read from the content. Probes marked\n"
      "infeasible (out of memory) are not fitted as points: with the capacity they ran under\n"
      "(their capacity_bytes, --probe-capacity-bytes, or the file's capacity_bytes) they are\n"
      "lower bounds of the fit and limits of every plan. Dims must be >= 0 (the batch-size\n"
      "variable > 0).\nOptions");
  desc.add_options()
      ("help,h", "show this help")
      ("measurements", po::value<std::string>(),
       "measurements file, CSV or JSON (also the positional argument)")
      ("csv", po::value<std::string>(), "measurements file, read as CSV")
      ("formula", po::value<std::string>()->required(),
       "cost formula in bytes, e.g. 'a*bs*l^2 + b*bs*l + c' or 'max(a*bs*l^2, b*bs*l) + c', "
       "or auto: chosen from the measurements (the batch size times monomials up to degree 2 "
       "in the other variables, a constant, a floor, max() of up to 3 pieces; the best by "
       "held-out error with a penalty for size) (required)")
      ("coefficients", po::value<std::string>(),
       "comma-separated coefficient names (default: the formula's names that are not variables)")
      ("variables", po::value<std::string>(),
       "comma-separated variable names, e.g. bs,l (required for CSV; JSON probe files name "
       "theirs)")
      ("bytes-column", po::value<std::string>()->required(),
       "column (CSV) or key (JSON) with the measured peak bytes to fit, e.g. "
       "forward_backward_peak_bytes (required)")
      ("batch-size-variable", po::value<std::string>()->default_value("", "first variable"),
       "variable that counts records in a microbatch")
      ("probe-capacity-bytes", po::value<double>(),
       "capacity the infeasible probes ran out of, bytes, when they do not record it (default: "
       "the file's capacity_bytes)")
      ("floor-bytes", po::value<double>(),
       "constant floor of every prediction (static memory), bytes (default 0)")
      ("floor-column", po::value<std::string>(),
       "floor = the largest value of this column over the feasible measurements, e.g. "
       "optimizer_step_peak_bytes")
      ("floor-model", po::value<std::string>()->default_value("auto"),
       "with --floor-column: auto (a floor formula when the column grows with the dims, a "
       "constant otherwise), constant or formula")
      ("floor-formula", po::value<std::string>(),
       "with --floor-column: the floor formula fitted to that column, e.g. 'f + d*bs*l' "
       "(default: the formula with its coefficients renamed floor_<name>)")
      ("above-floor-only", po::bool_switch()->default_value(false),
       "fit only the measurements above the floor (where the prediction is the formula, not the "
       "floor); the others are reported. With --floor-column and --floor-model auto, a plateau of "
       "the peaks (two or more within 1 % of the smallest) is tried as the floor too, as training "
       "does")
      ("aggregation", po::value<std::vector<std::string>>()->composing(),
       "VAR=count|max|sum, how records combine per variable (repeatable; default: max)")
      ("allow-negative", po::bool_switch()->default_value(false),
       "let coefficients be negative (default: bounded below by 0)")
      ("nonlinear", po::bool_switch()->default_value(false),
       "allow coefficients used non-linearly, e.g. the exponent p in 'a*bs*l^p + c'")
      ("initial", po::value<std::vector<std::string>>()->composing(),
       "NAME=VALUE starting values for a non-linear fit, e.g. p=1.5 (repeatable)")
      ("robust-loss", po::value<std::string>()->default_value("none"),
       "none, huber or cauchy: down-weight outliers (on relative residuals)")
      ("robust-scale", po::value<double>()->default_value(0.01, "0.01"),
       "relative residual where the robust loss bends (0.01: 1 %)")
      ("usable-max-rel-error", po::value<double>()->default_value(0.05, "0.05"),
       "a fit whose max relative error, or held-out (leave-one-shape-out) max relative error at "
       "the shapes the others surround, exceeds this is not usable (exit code 1, no file); shapes "
       "at the edge are extrapolation, reported apart")
      ("output,o", po::value<std::string>(), "save the memory model JSON here (atomic write)")
      ("figure", po::value<std::string>(),
       "write an SVG figure here: measured vs predicted bytes, and relative residuals")
      ("json", po::bool_switch()->default_value(false), "print one JSON object instead of text");
  return desc;
}

int run_fit(const po::variables_map& vm) {
  // Options first: every bad option is reported before any file is read.
  const MeasurementRequest request = measurement_request_from(vm);
  const FitRequest fit_request = fit_request_from(vm);
  const std::string formula_text = vm["formula"].as<std::string>();
  const double probe_capacity_bytes = probe_capacity_option(vm);
  std::vector<std::pair<std::string, std::string>> written;
  for (const char* option : {"output", "figure"})
    if (vm.count(option)) written.emplace_back(std::string("--") + option, vm[option].as<std::string>());
  check_written_files(written, {{"the measurements file", request.path}});

  if (formula_text.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw InputError("--formula is empty: give a cost formula in bytes, e.g. 'a*bs*l^2 + b*bs*l + c', or auto");
  }
  const bool automatic = formula_text == "auto";
  std::string lower = formula_text;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (!automatic && trim(lower) == "auto") {  // a formula of one coefficient named so: a typo
    throw InputError("--formula '" + formula_text + "' is a constant named " + formula_text +
                     "; for a formula chosen from the measurements write --formula auto (lower case, nothing around it)");
  }
  if (automatic && vm.count("coefficients")) throw InputError("--coefficients does not apply to --formula auto");
  MeasurementSet set = read_measurements(request);
  const std::vector<std::string>& variables = set.variables;
  std::string bs_variable = vm["batch-size-variable"].as<std::string>();
  if (bs_variable.empty()) bs_variable = variables.front();
  // --formula auto: every candidate term stands in for the formula until one is chosen (its
  // variables, the floor formula derived from it).
  const std::string given_text = automatic ? all_terms_text(variables, bs_variable) : formula_text;
  const std::vector<std::string> coefficients = coefficients_of(vm, formula_text, given_text, variables);
  if (!automatic) refuse_column_coefficients(vm, formula_text, coefficients, set);
  const xpm::CostFormula formula = make_formula(given_text, coefficients, variables, fit_request);
  if (!automatic) refuse_unused_variables(formula, bs_variable);
  const auto aggregation = vm.count("aggregation")
                               ? parse_aggregation(vm["aggregation"].as<std::vector<std::string>>())
                               : std::map<std::string, xpm::DimAggregation>{};
  const std::vector<xpm::ProbedRange> probed_ranges =
      set.measurements.empty() ? std::vector<xpm::ProbedRange>{} : xpm::MemoryModel::ranges_of(dims_of(set.measurements));
  Floor floor;
  floor.bytes = vm.count("floor-bytes") ? vm["floor-bytes"].as<double>() : 0.0;
  floor.fit = fit_floor_column(vm, formula, set);
  if (floor.fit) floor.bytes = floor.fit->constant_bytes;
  const FitInputs inputs{vm,          request,     fit_request, formula,       coefficients, variables,
                         bs_variable, aggregation, probed_ranges, automatic, probe_capacity_bytes};
  // Above a measured floor, a plateau of the peaks is a floor too: fitted both ways, the fit
  // that misses the step peaks (the larger of the two columns) least is kept, as in training.
  std::optional<xpm::PeakPlateau> plateau;
  if (floor.fit && vm["above-floor-only"].as<bool>() &&
      xpm::parse_floor_mode(vm["floor-model"].as<std::string>(), "--floor-model") == xpm::FloorMode::kAutomatic) {
    std::vector<double> peaks;
    for (const xpm::Measurement& m : set.measurements) peaks.push_back(m.bytes);
    plateau = xpm::find_peak_plateau(peaks, floor.bytes);
  }
  if (!plateau) {
    FloorFitted fitted = fit_over_floor(inputs, floor, set);
    return report_and_write(vm, fitted.model, fitted.set, fitted.outcome, request);
  }
  Floor on_plateau = floor;
  on_plateau.bytes = plateau->floor_bytes;
  on_plateau.plateau = plateau;
  std::optional<FloorFitted> over_plateau;
  try {
    over_plateau = fit_over_floor(inputs, on_plateau, set);
  } catch (const InputError&) {  // too few measurements above the plateau: the floor column's fit alone
  } catch (const InfeasibleError&) {
  }
  FloorFitted over_floor = fit_over_floor(inputs, floor, set);
  // As training chooses: the usable fit that misses the step peaks least, the plateau's on a tie
  // or when neither is usable.
  const bool plateau_kept =
      over_plateau && (over_plateau->outcome.usable || !over_floor.outcome.usable) &&
      (!over_plateau->outcome.usable || !over_floor.outcome.usable ||
       xpm::plateau_fit_kept(xpm::max_step_peak_rel_error(over_plateau->model, step_peaks_of(set)),
                             xpm::max_step_peak_rel_error(over_floor.model, step_peaks_of(set))));
  const FloorFitted& kept = plateau_kept ? *over_plateau : over_floor;
  return report_and_write(vm, kept.model, kept.set, kept.outcome, request);
}

}  // namespace xpm_plan
