// xpm-plan fit: from command-line options to the planner's formula and fit options, and the
// fit report (text or JSON).
#pragma once

#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "measurements.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/memory_model.hpp"

namespace xpm_plan {

struct FitRequest {
  bool allow_negative = false;             // --allow-negative
  bool nonlinear = false;                  // --nonlinear
  std::map<std::string, double> initial;   // --initial NAME=VALUE
  xpm::RobustLoss robust_loss = xpm::RobustLoss::kNone;  // --robust-loss none|huber|cauchy
  double robust_scale = 0.01;              // --robust-scale: relative residual where it bends
  double usable_max_rel_error = xpm::FitOptions{}.usable_max_rel_error;  // --usable-max-rel-error
};

/// Reads and checks --allow-negative, --nonlinear, --initial, --robust-loss.
FitRequest fit_request_from(const boost::program_options::variables_map& vm);

/// Parses the formula; errors become InputError naming --formula (first line of the message).
xpm::CostFormula make_formula(const std::string& text, const std::vector<std::string>& coefficients,
                              const std::vector<std::string>& variables, const FitRequest& request);

struct FitOutcome {
  xpm::FitResult result;
  bool usable = true;            // the planner's verdict (FitSummary::usable)
  std::string unusable_reason;   // FitSummary::reasons joined, when !usable
  std::optional<xpm::CostFormula> chosen_formula;  // --formula auto: the formula chosen
  std::string selection_report;  // --formula auto: xpm::FormulaSelection::report()
  std::vector<std::string> labels;  // where each fitted point came from (MeasurementSet::labels)
};

/// The planner's text for this tool: its option names (option_names) and each "point N (" (N
/// an index into `labels`, counted from 0) as where that point came from: "line 31 (",
/// "metadata.probes[16] (".
std::string cli_text(std::string text, const std::vector<std::string>& labels);

/// Fits; the planner's input errors (identifiability, too few points) become InputError.
/// The fit refuses a prediction that decreases as `batch_size_variable` grows (not usable).
/// `bounds`: the infeasible probes with a known capacity, lower bounds of the fit.
FitOutcome fit_measurements(const xpm::CostFormula& formula, const MeasurementSet& set,
                            const FitRequest& request, const std::string& batch_size_variable,
                            const std::vector<xpm::InfeasibleBound>& bounds);

/// --formula auto: chooses the formula over `variables` (xpm::select_formula; a floor piece
/// among the candidates unless `has_floor`; `summed_variables` as FormulaSelectionOptions has
/// them) and fits it; errors as fit_measurements.
FitOutcome fit_automatic_formula(const std::vector<std::string>& variables, const MeasurementSet& set,
                                 const FitRequest& request, const std::string& batch_size_variable,
                                 const std::vector<xpm::InfeasibleBound>& bounds, bool has_floor,
                                 const std::vector<std::string>& summed_variables);

/// The fit summary as JSON (converged, iterations, errors, ...).
nlohmann::json fit_summary_json(const xpm::FitSummary& summary, const FitOutcome& outcome);

/// Prints the report: text (formula, coefficients with units, floor, brief report, per-point
/// residuals, infeasible probes, files written) or one JSON object.
void print_fit_report(std::ostream& os, const xpm::MemoryModel& model, const MeasurementSet& set,
                      const xpm::FitSummary& summary, const FitOutcome& outcome, bool json,
                      const std::string& output, const std::string& figure);

}  // namespace xpm_plan
