// floor_model.cpp — constant or fitted floor of a phase-aware memory model (see floor_model.hpp).
#include "xpm/planner/floor_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "number_format.hpp"
#include "xpm/planner/enum_names.hpp"
#include "residual_structure.hpp"

namespace xpm {
namespace {

using detail::percent;

std::vector<std::string> prefixed(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& name : names) out.push_back("floor_" + name);
  return out;
}

double max_rel_error(const CostFormula& formula, const std::vector<double>& coefficients,
                     double constant_bytes, const std::vector<Measurement>& peaks) {
  double worst = 0;
  for (const Measurement& m : peaks) {
    const double predicted = std::max(constant_bytes, formula.predict(coefficients, m.dims));
    worst = std::max(worst, std::abs(predicted - m.bytes) / m.bytes);
  }
  return worst;
}

}  // namespace

void FloorOptions::validate() const {
  if (!(constant_spread >= 0 && std::isfinite(constant_spread))) {
    throw std::invalid_argument("FloorOptions.constant_spread must be finite and >= 0, got " +
                                detail::format_double(constant_spread));
  }
  if (formula.empty() && !coefficient_names.empty()) {
    throw std::invalid_argument("FloorOptions.coefficient_names given without FloorOptions.formula");
  }
}

CostFormula floor_formula_for(const CostFormula& formula, const FloorOptions& options) {
  const std::vector<std::string>& variables = formula.variable_names();
  if (!options.formula.empty()) {
    std::vector<std::string> names = options.coefficient_names.empty()
                                         ? coefficient_names_in(options.formula, variables)
                                         : options.coefficient_names;
    return CostFormula(options.formula, std::move(names), variables);
  }
  if (formula.is_linear()) {
    return CostFormula(detail::rename_identifiers(formula.canonical(), formula.coefficient_names(), "floor_", ""),
                       prefixed(formula.coefficient_names()), variables);
  }
  std::string product;
  for (const std::string& v : variables) product += "*" + v;
  return CostFormula("floor_d" + product + " + floor_f", {"floor_d", "floor_f"}, variables);
}

FloorFit fit_floor(const CostFormula& formula, const std::vector<Measurement>& optimizer_step_peaks,
                   double static_bytes, const FloorOptions& options) {
  options.validate();
  if (optimizer_step_peaks.empty()) {
    throw std::invalid_argument("fit_floor: no optimizer-step peak to fit the floor to");
  }
  FloorFit out;
  double lowest = HUGE_VAL, highest = 0;
  for (const Measurement& m : optimizer_step_peaks) {
    lowest = std::min(lowest, m.bytes);
    highest = std::max(highest, m.bytes);
  }
  const double constant = std::max(static_bytes, highest);
  out.spread = highest > 0 ? (highest - lowest) / highest : 0;
  out.constant_bytes = constant;
  out.constant_max_rel_error = (constant - lowest) / lowest;
  const std::string grows = "the optimizer-step peaks spread " + percent(out.spread) +
                            " across the probes";
  if (options.mode == FloorMode::kConstant ||
      (options.mode == FloorMode::kAutomatic && out.spread <= options.constant_spread)) {
    out.report = "floor: constant " + detail::short_double(constant) + " bytes (the largest " +
                 "optimizer-step peak); " + grows +
                 (options.mode == FloorMode::kConstant ? " (constant floor asked)"
                                                       : ", within " + percent(options.constant_spread));
    return out;
  }
  const CostFormula floor_formula = floor_formula_for(formula, options);
  FitOptions fit_options;
  fit_options.leave_one_out = false;
  FitResult fit;
  try {
    fit = fit_coefficients(floor_formula, optimizer_step_peaks, fit_options);
  } catch (const std::invalid_argument& e) {
    if (options.mode == FloorMode::kFormula) throw;
    out.report = "floor: constant " + detail::short_double(constant) + " bytes although " + grows +
                 ": the floor formula " + floor_formula.canonical() + " cannot be fitted (" +
                 e.what() + ")";
    return out;
  }
  out.formula_max_rel_error =
      max_rel_error(floor_formula, fit.coefficients, static_bytes, optimizer_step_peaks);
  const bool better = fit.summary.usable && out.formula_max_rel_error < out.constant_max_rel_error;
  if (options.mode == FloorMode::kAutomatic && !better) {
    out.report = "floor: constant " + detail::short_double(constant) + " bytes although " + grows +
                 ": the floor formula " + floor_formula.canonical() + " fits them no better (max " +
                 "error " + percent(out.formula_max_rel_error) + " vs " +
                 percent(out.constant_max_rel_error) + ")";
    return out;
  }
  out.constant_bytes = static_bytes;
  out.formula = FloorFormula{floor_formula, fit.coefficients};
  out.report = "floor: formula " + floor_formula.canonical() + " fitted to the optimizer-step " +
               "peaks, because " + grows + " (max error " + percent(out.formula_max_rel_error) +
               "; the constant floor would miss by up to " + percent(out.constant_max_rel_error) +
               ")";
  return out;
}

namespace {
constexpr EnumNames<FloorMode, 3> kFloorModeNames{
    {{FloorMode::kAutomatic, "auto"}, {FloorMode::kConstant, "constant"}, {FloorMode::kFormula, "formula"}}};
}  // namespace

std::optional<PeakPlateau> find_peak_plateau(const std::vector<double>& forward_backward_peak_bytes,
                                             double constant_floor_bytes, double fraction) {
  if (forward_backward_peak_bytes.empty()) return std::nullopt;
  PeakPlateau plateau;
  plateau.floor_bytes = *std::min_element(forward_backward_peak_bytes.begin(), forward_backward_peak_bytes.end());
  plateau.top_bytes = plateau.floor_bytes * (1 + fraction);
  plateau.measurements = static_cast<std::size_t>(
      std::count_if(forward_backward_peak_bytes.begin(), forward_backward_peak_bytes.end(),
                    [&](double bytes) { return bytes <= plateau.top_bytes; }));
  if (plateau.measurements < 2 || !(plateau.floor_bytes > constant_floor_bytes)) return std::nullopt;
  return plateau;
}

double max_step_peak_rel_error(const MemoryModel& model, const std::vector<Measurement>& step_peaks) {
  double worst = 0;
  for (const Measurement& peak : step_peaks)
    worst = std::max(worst, std::abs(model.predict_bytes(peak.dims) - peak.bytes) / peak.bytes);
  return worst;
}

bool plateau_fit_kept(double plateau_error, double floor_error) {
  return plateau_error <= floor_error + 1e-9 * std::max(plateau_error, floor_error);
}

std::string plateau_floor_report(const PeakPlateau& plateau, double constant_floor_bytes) {
  char text[256];
  std::snprintf(text, sizeof text,
                "floor: the plateau of the forward/backward peaks, %.0f bytes (%zu probes within 1 %% of the "
                "smallest, not fitted), above the optimizer-step peaks' %.0f bytes",
                plateau.floor_bytes, plateau.measurements, constant_floor_bytes);
  return text;
}

std::string to_string(FloorMode mode) { return enum_name(kFloorModeNames, mode); }

FloorMode parse_floor_mode(const std::string& text, const std::string& source) {
  return parse_enum(kFloorModeNames, text, source);
}

}  // namespace xpm
