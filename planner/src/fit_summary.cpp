// fit_summary.cpp — FitOptions::validate and the FitSummary reports (see fit.hpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "xpm/planner/fit.hpp"

#include "number_format.hpp"
#include "xpm/planner/enum_names.hpp"

namespace xpm {

namespace {
constexpr EnumNames<RobustLoss, 3> kRobustLossNames{
    {{RobustLoss::kNone, "none"}, {RobustLoss::kHuber, "huber"}, {RobustLoss::kCauchy, "cauchy"}}};
}  // namespace

std::string to_string(RobustLoss loss) { return enum_name(kRobustLossNames, loss); }

RobustLoss parse_robust_loss(const std::string& text, const std::string& source) {
  return parse_enum(kRobustLossNames, text, source);
}
namespace {

using detail::format_double;
using detail::percent;
using detail::short_double;

}  // namespace

void FitOptions::validate() const {
  if (max_iterations < 1) {
    throw std::invalid_argument("FitOptions: max_iterations must be >= 1, got " +
                                std::to_string(max_iterations));
  }
  const std::pair<const char*, double> tolerances[] = {
      {"function_tolerance", function_tolerance},
      {"gradient_tolerance", gradient_tolerance},
      {"parameter_tolerance", parameter_tolerance},
      {"identifiability_tolerance", identifiability_tolerance}};
  for (const auto& [name, value] : tolerances) {
    if (!(std::isfinite(value) && value >= 0)) {
      throw std::invalid_argument(std::string("FitOptions: ") + name +
                                  " must be finite and >= 0, got " + format_double(value));
    }
  }
  if (!(std::isfinite(robust_loss_scale) && robust_loss_scale > 0)) {
    throw std::invalid_argument("FitOptions: robust_loss_scale must be finite and > 0, got " +
                                format_double(robust_loss_scale));
  }
  if (!(usable_max_rel_error >= 0)) {  // +inf allowed: no limit
    throw std::invalid_argument("FitOptions: usable_max_rel_error must be >= 0, got " +
                                format_double(usable_max_rel_error));
  }
  if (!(std::isfinite(infeasible_bound_weight) && infeasible_bound_weight > 0)) {
    throw std::invalid_argument("FitOptions: infeasible_bound_weight must be finite and > 0, got " +
                                format_double(infeasible_bound_weight));
  }
  for (const auto& [name, value] : initial_values) {
    if (!std::isfinite(value)) {
      throw std::invalid_argument("FitOptions: initial_values['" + name +
                                  "'] must be finite, got " + format_double(value));
    }
  }
}

std::string FitSummary::held_out_sentence() const {
  std::ostringstream os;
  os << "held-out (leave-one-out) max relative error ";
  if (std::isnan(surrounded_held_out_max_rel_error)) {
    os << "none where the other shapes surround it";
  } else {
    os << percent(surrounded_held_out_max_rel_error) << " where the other shapes surround it ("
       << surrounded_held_out_count << (surrounded_held_out_count == 1 ? " point)" : " points)");
  }
  if (!held_out_extrapolated.empty()) {
    os << ", " << percent(extrapolated_held_out_max_rel_error) << " by extrapolation at "
       << held_out_extrapolated.size() << (held_out_extrapolated.size() == 1 ? " point" : " points")
       << " outside the others' range";
  }
  if (!held_out_note.empty()) os << "; " << held_out_note;
  return os.str();
}

std::string FitSummary::brief_report() const {
  std::ostringstream os;
  const std::size_t fitted = rel_errors.size() - left_out.size();
  if (converged && iterations == 0) {
    os << "Fit solved exactly";  // a linear formula under its bounds, without iterations
  } else {
    os << (converged ? "Fit converged" : "Fit did NOT converge") << " after " << iterations
       << (iterations == 1 ? " iteration" : " iterations");
  }
  os << " on " << fitted << (fitted == 1 ? " point" : " points");
  if (!left_out.empty()) {
    os << " (" << left_out.size() << " at " << batch_size_variable << " = 1 left out)";
  }
  os << " ("
     << (linear ? "linear" : "non-linear") << " least squares, " << coefficient_count
     << (coefficient_count == 1 ? " coefficient" : " coefficients") << ", robust loss "
     << to_string(robust_loss) << "): max relative error " << percent(max_rel_error) << ", mean "
     << percent(mean_rel_error) << ", ";
  if (leave_one_out_note.empty() && !leave_one_out_rel_errors.empty()) {
    os << held_out_sentence() << ".";
  } else {
    os << "held-out (leave-one-out) " << (leave_one_out_note.empty() ? "not computed" : leave_one_out_note)
       << ".";
  }
  if (infeasible_bound_count > 0) {
    const auto violated = static_cast<std::size_t>(std::count(
        infeasible_bound_satisfied.begin(), infeasible_bound_satisfied.end(), false));
    os << " " << infeasible_bound_count
       << (infeasible_bound_count == 1 ? " infeasible-probe bound" : " infeasible-probe bounds")
       << ": " << (violated == 0 ? "all satisfied" : std::to_string(violated) + " violated") << ".";
  }
  if (usable) {
    os << " Usable.";
  } else {
    os << " Not usable: ";
    for (std::size_t i = 0; i < reasons.size(); ++i) os << (i ? "; " : "") << reasons[i];
    if (reasons.empty()) os << "no fit";
    os << ".";
  }
  if (!converged && !solver_report.empty()) os << " Solver: " << solver_report;
  return os.str();
}

std::string FitSummary::full_report() const {
  std::ostringstream os;
  os << brief_report() << "\n";
  for (std::size_t i = 0; i < rel_errors.size(); ++i) {
    os << "  point " << i << ": relative error " << percent(rel_errors[i]);
    if (std::find(left_out.begin(), left_out.end(), i) != left_out.end()) {
      os << " (left out of the fit)\n";
      continue;
    }
    if (std::find(held_out_undetermined.begin(), held_out_undetermined.end(), i) != held_out_undetermined.end()) {
      os << ", leave-one-out: no figure (the other shapes do not determine it)";
    } else if (i < leave_one_out_rel_errors.size()) {
      os << ", leave-one-out " << percent(leave_one_out_rel_errors[i]);
      if (std::find(held_out_extrapolated.begin(), held_out_extrapolated.end(), i) != held_out_extrapolated.end()) {
        os << " (extrapolation)";
      }
    }
    os << "\n";
  }
  for (std::size_t b = 0; b < infeasible_bound_predicted_bytes.size(); ++b) {
    os << "  infeasible bound " << b << ": predicted " << short_double(infeasible_bound_predicted_bytes[b])
       << " bytes, " << (b < infeasible_bound_satisfied.size() && infeasible_bound_satisfied[b]
                            ? "satisfied"
                            : "VIOLATED")
       << "\n";
  }
  if (!start.empty()) os << "  start: " << start << "\n";
  if (!residual_structure.empty()) os << "  " << residual_structure << "\n";
  if (!left_out_note.empty()) os << "  " << left_out_note << "\n";
  if (!dormant_note.empty()) os << "  " << dormant_note << "\n";
  return os.str();
}

}  // namespace xpm
