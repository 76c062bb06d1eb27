// xpm-plan fit options and report (see fit_report.hpp).
#include "fit_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <regex>

#include "common.hpp"
#include "xpm/planner/formula_selection.hpp"

namespace xpm_plan {

std::string cli_text(std::string text, const std::vector<std::string>& labels) {
  static const std::regex point(R"(\bpoint (\d+) \()");
  std::string out;
  auto from = text.cbegin();
  for (std::sregex_iterator it(text.begin(), text.end(), point), end; it != end; ++it) {
    const std::size_t index = std::stoul((*it)[1].str());
    out.append(from, (*it)[0].first);
    out += index < labels.size() ? labels[index] + " (" : it->str();
    from = (*it)[0].second;
  }
  out.append(from, text.cend());
  return option_names(std::move(out));
}

FitRequest fit_request_from(const boost::program_options::variables_map& vm) {
  FitRequest r;
  r.allow_negative = vm["allow-negative"].as<bool>();
  r.nonlinear = vm["nonlinear"].as<bool>();
  if (vm.count("initial")) {
    r.initial = parse_assignments(vm["initial"].as<std::vector<std::string>>(), "initial");
  }
  try {
    r.robust_loss = xpm::parse_robust_loss(vm["robust-loss"].as<std::string>(), "--robust-loss");
  } catch (const std::invalid_argument& e) {
    throw InputError(e.what());
  }
  r.robust_scale = vm["robust-scale"].as<double>();
  if (!vm["robust-scale"].defaulted() && r.robust_loss == xpm::RobustLoss::kNone) {
    throw InputError("--robust-scale applies to a robust loss only: give --robust-loss huber or cauchy");
  }
  r.usable_max_rel_error = vm["usable-max-rel-error"].as<double>();
  if (!(r.robust_scale > 0) || !std::isfinite(r.robust_scale)) {
    throw InputError("--robust-scale must be > 0, got " + number_text(r.robust_scale));
  }
  if (!(r.usable_max_rel_error > 0) || !std::isfinite(r.usable_max_rel_error)) {
    throw InputError("--usable-max-rel-error must be > 0, got " + number_text(r.usable_max_rel_error));
  }
  return r;
}

xpm::CostFormula make_formula(const std::string& text, const std::vector<std::string>& coefficients,
                              const std::vector<std::string>& variables, const FitRequest& request) {
  try {
    xpm::CostFormulaOptions options;
    options.allow_nonlinear = request.nonlinear;
    return xpm::CostFormula(text, coefficients, variables, options);
  } catch (const xpm::FormulaError& e) {
    const bool nonlinear_term = e.message().find("not linear") != std::string::npos ||
                                e.message().find("two coefficients") != std::string::npos;
    throw InputError("--formula '" + text + "': " + e.brief() +
                     (nonlinear_term && !request.nonlinear ? " (--nonlinear allows it)" : ""));
  } catch (const std::invalid_argument& e) {  // names: duplicates, both coefficient and variable
    throw InputError("--formula '" + text + "': " + first_line(e.what()));
  }
}

namespace {

xpm::FitOptions fit_options_of(const FitRequest& request, const std::string& batch_size_variable) {
  xpm::FitOptions options;
  options.non_negative = !request.allow_negative;
  options.robust_loss = request.robust_loss;
  options.robust_loss_scale = request.robust_scale;
  options.initial_values = request.initial;
  options.batch_size_variable = batch_size_variable;
  options.usable_max_rel_error = request.usable_max_rel_error;
  try {
    options.validate();
  } catch (const std::invalid_argument& e) {
    throw InputError("fit options: " + first_line(e.what()));
  }
  return options;
}

void set_verdict(FitOutcome& outcome, const MeasurementSet& set) {
  const xpm::FitSummary& s = outcome.result.summary;
  outcome.labels = set.labels;
  outcome.usable = s.usable;
  for (const std::string& reason : s.reasons) {
    outcome.unusable_reason += (outcome.unusable_reason.empty() ? "" : "; ") + cli_text(reason, outcome.labels);
  }
}

// The fit's reasons in this tool's words (cli_text).
std::vector<std::string> cli_reasons(const std::vector<std::string>& reasons, const std::vector<std::string>& labels) {
  std::vector<std::string> out;
  for (const std::string& reason : reasons) out.push_back(cli_text(reason, labels));
  return out;
}

}  // namespace

FitOutcome fit_automatic_formula(const std::vector<std::string>& variables, const MeasurementSet& set,
                                 const FitRequest& request, const std::string& batch_size_variable,
                                 const std::vector<xpm::InfeasibleBound>& bounds, bool has_floor,
                                 const std::vector<std::string>& summed_variables) {
  if (!request.initial.empty()) throw InputError("--initial does not apply to --formula auto");
  xpm::FormulaSelectionOptions selection;
  selection.batch_size_variable = batch_size_variable;
  selection.summed_variables = summed_variables;
  selection.fit = fit_options_of(request, batch_size_variable);
  selection.floor = !has_floor;
  FitOutcome outcome;
  try {
    xpm::FormulaSelection chosen = xpm::select_formula(variables, set.measurements, bounds, selection);
    outcome.result = std::move(chosen.fit);
    outcome.selection_report = chosen.report();
    outcome.chosen_formula = std::move(chosen.formula);
  } catch (const std::invalid_argument& e) {
    throw InputError(set.path + ": --formula auto: " + option_names(first_line(e.what())));
  }
  set_verdict(outcome, set);
  return outcome;
}

FitOutcome fit_measurements(const xpm::CostFormula& formula, const MeasurementSet& set,
                            const FitRequest& request, const std::string& batch_size_variable,
                            const std::vector<xpm::InfeasibleBound>& bounds) {
  const xpm::FitOptions options = fit_options_of(request, batch_size_variable);
  if (!request.initial.empty() && formula.is_linear()) {
    throw InputError("--initial applies to non-linear formulas only (max(...), or terms such as "
                     "l^p with --nonlinear); '" + formula.text() + "' is fitted linearly");
  }
  for (const auto& [name, value] : request.initial) {
    const auto& names = formula.coefficient_names();
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      throw InputError("--initial: '" + name + "' is not a coefficient of the formula");
    }
    (void)value;
  }
  FitOutcome outcome;
  try {
    outcome.result = xpm::fit_coefficients(formula, set.measurements, bounds, options);
  } catch (const std::invalid_argument& e) {  // includes IdentifiabilityError
    throw InputError(set.path + ": " + option_names(first_line(e.what())));
  }
  set_verdict(outcome, set);
  return outcome;
}

nlohmann::json fit_summary_json(const xpm::FitSummary& s, const FitOutcome& outcome) {
  auto finite_or_null = [](double v) {
    return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
  };
  nlohmann::json loo = nlohmann::json::array();
  for (double e : s.leave_one_out_rel_errors) loo.push_back(finite_or_null(e));
  return {{"converged", s.converged},
          {"usable", outcome.usable},
          {"reasons", cli_reasons(s.reasons, outcome.labels)},
          {"linear", s.linear},
          {"robust_loss", xpm::to_string(s.robust_loss)},
          {"iterations", s.iterations},
          {"max_rel_error", s.max_rel_error},
          {"mean_rel_error", s.mean_rel_error},
          {"rel_errors", s.rel_errors},
          {"leave_one_out_max_rel_error", finite_or_null(s.leave_one_out_max_rel_error)},
          {"leave_one_out_rel_errors", std::move(loo)},
          {"leave_one_out_note", cli_text(s.leave_one_out_note, outcome.labels)},
          {"surrounded_held_out_max_rel_error", finite_or_null(s.surrounded_held_out_max_rel_error)},
          {"extrapolated_held_out_max_rel_error", finite_or_null(s.extrapolated_held_out_max_rel_error)},
          {"held_out_extrapolated", s.held_out_extrapolated},
          {"held_out_undetermined", s.held_out_undetermined},
          {"held_out_note", cli_text(s.held_out_note, outcome.labels)},
          {"solver_report", s.solver_report},
          {"start", s.start},
          {"residual_structure", s.residual_structure},
          {"left_out_note", s.left_out_note},
          {"infeasible_bound_count", s.infeasible_bound_count},
          {"brief_report", cli_text(s.brief_report(), outcome.labels)}};
}

namespace {

std::string percent(double rel) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.4f %%", rel * 100);
  return buf;
}

bool is_left_out(const xpm::FitSummary& s, std::size_t i) {
  return std::find(s.left_out.begin(), s.left_out.end(), i) != s.left_out.end();
}

// A measurement's prediction in the residuals: the formula's, or for a point left out of the fit
// (at batch size 1) the model's, single-record factor or coefficients included.
double residual_prediction(const xpm::MemoryModel& model, const xpm::FitSummary& s, std::size_t i,
                           const std::vector<double>& dims) {
  return is_left_out(s, i) ? model.predict_bytes(dims) : model.formula().predict(model.coefficients(), dims);
}

// Every fitted point: measured, predicted, relative and held-out errors.
nlohmann::json residuals_json(const xpm::MemoryModel& model, const MeasurementSet& set,
                              const xpm::FitSummary& s) {
  nlohmann::json points = nlohmann::json::array();
  for (std::size_t i = 0; i < set.measurements.size(); ++i) {
    const auto& m = set.measurements[i];
    const double predicted = residual_prediction(model, s, i, m.dims);
    nlohmann::json point = {{"source", set.labels[i]},
                            {"dims", dims_json(model, m.dims)},
                            {"measured_bytes", m.bytes},
                            {"predicted_bytes", predicted},
                            {"rel_error", (predicted - m.bytes) / m.bytes},
                            {"leave_one_out_rel_error", nullptr},
                            {"left_out", is_left_out(s, i)}};
    if (i < s.leave_one_out_rel_errors.size() && std::isfinite(s.leave_one_out_rel_errors[i])) {
      point["leave_one_out_rel_error"] = s.leave_one_out_rel_errors[i];
    }
    points.push_back(std::move(point));
  }
  return points;
}

// Every infeasible bound: its dims and capacity, the prediction there and whether it holds.
nlohmann::json infeasible_bounds_json(const xpm::MemoryModel& model, const xpm::FitSummary& s) {
  nlohmann::json bounds = nlohmann::json::array();
  for (std::size_t b = 0; b < model.infeasible_probes().size(); ++b) {
    const xpm::InfeasibleBound& bound = model.infeasible_probes()[b];
    nlohmann::json entry = {{"dims", dims_json(model, bound.dims)},
                            {"exceeds_bytes", bound.exceeds_bytes},
                            {"predicted_bytes", nullptr},
                            {"satisfied", nullptr}};
    if (b < s.infeasible_bound_predicted_bytes.size()) {
      entry["predicted_bytes"] = s.infeasible_bound_predicted_bytes[b];
      entry["satisfied"] = static_cast<bool>(s.infeasible_bound_satisfied[b]);
    }
    bounds.push_back(std::move(entry));
  }
  return bounds;
}

// The report as one JSON object (--json).
nlohmann::json fit_report_json(const xpm::MemoryModel& model, const MeasurementSet& set,
                               const xpm::FitSummary& s, const FitOutcome& outcome,
                               const std::string& output, const std::string& figure) {
  const xpm::CostFormula& formula = model.formula();
  const auto& names = formula.coefficient_names();
  const auto terms = coefficient_terms(formula);
  nlohmann::json j;
  j["formula"] = formula.text();
  j["canonical"] = formula.canonical();
  j["identity_hash"] = formula.identity_hash();
  j["coefficients"] = model.to_json()["coefficients"];
  nlohmann::json units = nlohmann::json::object();
  for (std::size_t k = 0; k < names.size(); ++k) {
    units[names[k]] = coefficient_unit(terms[k], formula.is_linear());
  }
  j["coefficient_units"] = std::move(units);
  j["variables"] = formula.variable_names();
  j["batch_size_variable"] = model.batch_size_variable();
  j["floor_bytes"] = model.floor_bytes();
  const nlohmann::json model_json = model.to_json();
  j["floor_formula"] = model_json.contains("floor_formula") ? model_json["floor_formula"] : nlohmann::json(nullptr);
  j["floor_report"] = model.metadata().contains("floor") ? model.metadata()["floor"]["report"] : nlohmann::json(nullptr);
  j["points"] = set.measurements.size();
  const nlohmann::json summary_json = fit_summary_json(s, outcome);
  for (const auto& item : summary_json.items()) j[item.key()] = item.value();
  j["residuals"] = residuals_json(model, set, s);
  nlohmann::json infeasible = nlohmann::json::array();
  for (const auto& d : set.infeasible) infeasible.push_back(dims_json(model, d));
  j["infeasible_probes"] = std::move(infeasible);
  j["infeasible_probe_sources"] = set.infeasible_labels;  // where each came from: "line 38"
  j["infeasible_bounds"] = infeasible_bounds_json(model, s);
  nlohmann::json below = nlohmann::json::array();
  for (const auto& m : set.below_floor) below.push_back(dims_json(model, m.dims));
  j["below_floor_sources"] = set.below_floor_labels;
  j["below_floor_not_fitted"] = std::move(below);
  if (!outcome.usable) j["unusable_reason"] = outcome.unusable_reason;
  j["formula_selection"] = outcome.selection_report.empty() ? nlohmann::json(nullptr)
                                                            : nlohmann::json(outcome.selection_report);
  j["output"] = output.empty() ? nlohmann::json(nullptr) : nlohmann::json(output);
  j["figure"] = figure.empty() ? nlohmann::json(nullptr) : nlohmann::json(figure);
  return j;
}

// The formula, its coefficients with their units, the floor and the moving floor formula.
void print_formula_and_floor(std::ostream& os, const xpm::MemoryModel& model) {
  const xpm::CostFormula& formula = model.formula();
  const auto& names = formula.coefficient_names();
  const auto terms = coefficient_terms(formula);
  const auto& coefficients = model.coefficients();
  os << "formula:      " << formula.canonical() << "  (identity " << formula.identity_hash()
     << ")\n"
     << "coefficients: " << (formula.is_linear() ? "(bytes per unit of the term each multiplies)"
                                                 : "(non-linear formula)")
     << "\n";
  for (std::size_t k = 0; k < names.size(); ++k) {
    os << "  " << names[k] << " = " << coefficient_text(coefficients[k], terms[k], formula.is_linear())
       << "\n";
  }
  os << "floor:        " << bytes_text(model.floor_bytes()) << " bytes ("
     << mib_text(model.floor_bytes()) << "); predictions are max(floor, formula)\n";
  if (const xpm::FloorFormula* moving = model.floor_formula()) {
    os << "floor formula: " << moving->formula.canonical() << " (";
    for (std::size_t k = 0; k < moving->coefficients.size(); ++k) {
      os << (k ? ", " : "") << moving->formula.coefficient_names()[k] << " = "
         << bytes_text(moving->coefficients[k]);
    }
    os << "); predictions are max(floor, floor formula, formula)\n";
  }
  if (model.metadata().contains("floor")) {
    os << "  " << model.metadata()["floor"]["report"].get<std::string>() << "\n";
  }
}

// One line per fitted point, and the points below the floor that were not fitted.
void print_residuals(std::ostream& os, const xpm::MemoryModel& model, const MeasurementSet& set,
                     const xpm::FitSummary& s) {
  os << "residuals ((predicted - measured) / measured; left out: predicted by a fit without "
        "that point):\n";
  for (std::size_t i = 0; i < set.measurements.size(); ++i) {
    const auto& m = set.measurements[i];
    const bool left_out = is_left_out(s, i);
    const double predicted = residual_prediction(model, s, i, m.dims);
    os << "  " << dims_text(model, m.dims) << ": measured " << bytes_text(m.bytes)
       << ", predicted " << bytes_text(predicted) << ", " << percent((predicted - m.bytes) / m.bytes);
    if (left_out && s.single_record_factor > 1) {
      char factor[32];
      std::snprintf(factor, sizeof factor, "%.4g", s.single_record_factor);
      os << ", not fitted (above the trend; scaled by " << factor << ")";
    } else if (left_out && !s.single_record_coefficients.empty()) {
      os << ", not fitted with the others (below the trend; fitted on its own)";
    } else if (left_out) {
      os << ", not fitted (below the trend)";
    } else if (i < s.leave_one_out_rel_errors.size() && std::isfinite(s.leave_one_out_rel_errors[i])) {
      os << ", left out " << percent(s.leave_one_out_rel_errors[i]);
    }
    os << "  (" << set.labels[i] << ")\n";
  }
  if (!set.below_floor.empty()) {
    const bool plateau = model.metadata().contains("floor") && model.metadata()["floor"].value("plateau", false);
    os << set.below_floor.size() << " measurements " << (plateau ? "on the floor's plateau (up to 1 % above it)" : "at or below the floor")
       << " were not fitted (--above-floor-only; the prediction there is the floor):";
    for (std::size_t i = 0; i < set.below_floor.size(); ++i) {
      os << "  [" << dims_text(model, set.below_floor[i].dims) << "]"
         << (i < set.below_floor_labels.size() ? " (" + set.below_floor_labels[i] + ")" : "");
    }
    os << "\n";
  }
}

// The probes that ran out of memory, and which of them bound the fit.
void print_infeasible(std::ostream& os, const xpm::MemoryModel& model, const MeasurementSet& set,
                      const xpm::FitSummary& s) {
  if (set.infeasible.empty()) return;
  os << set.infeasible.size() << " probes ran out of memory and were not fitted:";
  for (std::size_t i = 0; i < set.infeasible.size(); ++i) {
    os << "  [" << dims_text(model, set.infeasible[i]) << "]"
       << (i < set.infeasible_labels.size() ? " (" + set.infeasible_labels[i] + ")" : "");
  }
  os << "\n";
  const auto& bounds = model.infeasible_probes();
  if (!bounds.empty()) {
    os << "  used as lower bounds of the fit (the prediction there must reach the capacity "
          "they ran under) and as limits of every plan:\n";
  }
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    os << "    " << dims_text(model, bounds[b].dims) << ": out of memory under "
       << bytes_text(bounds[b].exceeds_bytes) << " bytes";
    if (b < s.infeasible_bound_predicted_bytes.size()) {
      os << ", predicted " << bytes_text(s.infeasible_bound_predicted_bytes[b]) << ": "
         << (s.infeasible_bound_satisfied[b] ? "satisfied" : "VIOLATED");
    }
    os << "\n";
  }
  if (bounds.size() < set.infeasible.size()) {
    os << "  " << set.infeasible.size() - bounds.size()
       << " not used as bounds: the capacity they ran under is unknown (give "
          "--probe-capacity-bytes)\n";
  }
}

// With a floor but every measurement fitted: the ones at or below the floor were fitted by the
// formula (their errors above are the formula's), while the model predicts the floor there.
void print_floor_note(std::ostream& os, const xpm::MemoryModel& model, const MeasurementSet& set) {
  if (!set.below_floor.empty()) return;  // --above-floor-only left them out
  std::size_t at_floor = 0;
  for (const xpm::Measurement& m : set.measurements) at_floor += m.bytes <= model.floor_bytes_at(m.dims) ? 1 : 0;
  if (at_floor == 0) return;
  os << "note: " << at_floor << " measurements lie at or below the floor and were fitted by the formula (the "
     << "errors above are the formula's, the model predicts the floor there); --above-floor-only leaves them out "
     << "of the fit\n";
}

}  // namespace

void print_fit_report(std::ostream& os, const xpm::MemoryModel& model, const MeasurementSet& set,
                      const xpm::FitSummary& s, const FitOutcome& outcome, bool json,
                      const std::string& output, const std::string& figure) {
  if (json) {
    os << fit_report_json(model, set, s, outcome, output, figure).dump() << "\n";
    return;
  }
  print_formula_and_floor(os, model);
  os << outcome.selection_report;
  os << cli_text(s.brief_report(), outcome.labels) << "\n";
  print_residuals(os, model, set, s);
  print_infeasible(os, model, set, s);
  if (!s.start.empty()) os << "start: " << s.start << "\n";
  if (!s.residual_structure.empty()) os << "note: " << s.residual_structure << "\n";
  if (!s.left_out_note.empty()) os << "note: " << cli_text(s.left_out_note, outcome.labels) << "\n";
  if (!s.converged) os << "solver: " << s.solver_report << "\n";
  print_floor_note(os, model, set);
  if (!output.empty()) os << "saved memory model to " << output << "\n";
  if (!figure.empty()) os << "wrote figure " << figure << "\n";
}

}  // namespace xpm_plan
