// fit_regimes.cpp — fit_coefficients: the fit of every point, or of every point but the
// single-record probes when they lie below the trend of the others (then fitted on their own
// where they can be: FitSummary::single_record_coefficients), or above it (then scaled:
// FitSummary::single_record_factor) (see fit.hpp, FitOptions::single_record_regime).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "xpm/planner/fit.hpp"

#include "fit_points.hpp"
#include "number_format.hpp"

namespace xpm {
namespace {

// A single-record probe over-predicted by less than this is on the trend: nothing to leave out.
constexpr double kBelowTrend = 0.002;
// ... and one under-predicted by at most this still counts as on the trend (not above it).
constexpr double kOnTrend = 0.001;
// A fit of every point within this at every point explains them all: nothing is left out.
constexpr double kExplained = 0.01;
// A single-record probe under-predicted by more than this lies above the trend of the others.
constexpr double kAboveTrend = 0.01;

struct Split {
  std::vector<std::size_t> single;  // measurements at batch size 1
  std::vector<std::size_t> rest;
};

Split split_single_records(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options) {
  Split out;
  const std::size_t b = formula.variable_index(options.batch_size_variable);
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    (measurements[i].dims[b] == 1 ? out.single : out.rest).push_back(i);
  }
  return out;
}

std::vector<Measurement> select(const std::vector<Measurement>& measurements,
                                const std::vector<std::size_t>& indices) {
  std::vector<Measurement> out;
  for (std::size_t i : indices) out.push_back(measurements[i]);
  return out;
}

double rel_error(const CostFormula& formula, const FitResult& fit, const Measurement& m) {
  return (formula.predict(fit.coefficients, m.dims) - m.bytes) / m.bytes;
}

std::size_t distinct_shapes(const std::vector<Measurement>& measurements) {
  std::vector<std::vector<double>> shapes;
  for (const Measurement& m : measurements) shapes.push_back(m.dims);
  std::sort(shapes.begin(), shapes.end());
  return static_cast<std::size_t>(std::unique(shapes.begin(), shapes.end()) - shapes.begin());
}

// Whether `coefficients` predict at least what every out-of-memory probe of one record ran out at.
bool above_single_record_bounds(const CostFormula& formula, const std::vector<double>& coefficients,
                                const std::vector<InfeasibleBound>& bounds, std::size_t batch_size_index) {
  for (const InfeasibleBound& bound : bounds)
    if (bound.dims[batch_size_index] == 1 && formula.predict(coefficients, bound.dims) < bound.exceeds_bytes)
      return false;
  return true;
}

// The fit of the single-record points alone (below the trend of the others): taken when they
// hold two more distinct shapes than coefficients, and it is usable, explains each of them
// within kExplained, fitted and held out, and predicts at least what each out-of-memory probe
// of one record ran out at. Empty otherwise (the formula cannot tell its terms apart at batch
// size 1, or the points do not follow it).
std::vector<double> single_record_coefficients(const CostFormula& formula, const std::vector<Measurement>& singles,
                                               const std::vector<InfeasibleBound>& bounds,
                                               const FitOptions& options) {
  if (distinct_shapes(singles) < formula.coefficient_names().size() + 2) return {};
  FitOptions alone = options;
  alone.single_record_regime = false;
  try {
    const FitResult fit = detail::fit_points(formula, singles, {}, alone);
    const FitSummary& s = fit.summary;
    if (s.usable && s.max_rel_error <= kExplained && s.leave_one_out_max_rel_error <= kExplained &&
        above_single_record_bounds(formula, fit.coefficients, bounds,
                                   formula.variable_index(options.batch_size_variable)))
      return fit.coefficients;
  } catch (const std::invalid_argument&) {
  }
  return {};
}

// FitSummary::left_out_note for `count` single-record probes left out, above or below the trend;
// lowest and highest: their errors under the others' fit.
std::string single_records_note(const FitSummary& s, std::size_t count, bool above, double lowest, double highest) {
  const std::string probes =
      std::to_string(count) + " probe" + (count == 1 ? "" : "s") + " at " + s.batch_size_variable + " = 1";
  if (above) {
    return probes + " lie above the trend of the larger microbatches (the fit of the others under-predicts them by "
           "up to " + detail::percent(-lowest) + "): a microbatch of one record can take other kernels (a "
           "convolution's im2col path at batch 1, with a column buffer). They are left out of the fit, and "
           "predictions at " + s.batch_size_variable + " = 1 are scaled by " +
           detail::short_double(s.single_record_factor) + " (the largest measured / predicted), so they err on "
           "the safe side";
  }
  return probes + " lie below the trend of the larger microbatches (the fit of the others over-predicts them by " +
         detail::percent(lowest) + " to " + detail::percent(highest) + "): a microbatch of one record often "
         "takes other kernels or skips copies (a transpose of a size-1 batch dimension is already contiguous). "
         "They are left out of the fit; " +
         (s.single_record_coefficients.empty()
              ? "predictions at " + s.batch_size_variable + " = 1 err on the safe side by up to " +
                    detail::percent(highest) +
                    (lowest < 0 ? " (and under by at most " + detail::percent(-lowest) + ")" : "")
              : "fitted on their own (within " + detail::percent(kExplained) + ", held out), they predict " +
                    s.batch_size_variable + " = 1 by the smaller of that fit and the others'");
}

// The fit of the other points, with the single-record points put back into the per-point
// errors (the leave-one-out error of a left-out point is its error: it was left out); below
// the trend, with the fit of their own when they follow the formula alone.
FitResult without_single_records(const CostFormula& formula,
                                 const std::vector<Measurement>& measurements, const Split& split,
                                 FitResult rest, const std::vector<InfeasibleBound>& bounds,
                                 const FitOptions& options) {
  FitSummary& s = rest.summary;
  std::vector<double> errors(measurements.size()), loo;
  const bool has_loo = !s.leave_one_out_rel_errors.empty();
  if (has_loo) loo.resize(measurements.size());
  for (std::size_t r = 0; r < split.rest.size(); ++r) {
    errors[split.rest[r]] = s.rel_errors[r];
    if (has_loo) loo[split.rest[r]] = s.leave_one_out_rel_errors[r];
  }
  double lowest = HUGE_VAL, highest = -HUGE_VAL, factor = 1;
  for (std::size_t i : split.single) {
    errors[i] = rel_error(formula, rest, measurements[i]);
    lowest = std::min(lowest, errors[i]);
    highest = std::max(highest, errors[i]);
    factor = std::max(factor, 1 / (1 + errors[i]));  // measured / predicted
  }
  const bool above = lowest < -kAboveTrend;
  s.single_record_factor = above ? factor : 1.0;
  for (std::size_t i : split.single) {
    errors[i] = (1 + errors[i]) * s.single_record_factor - 1;  // as the model predicts them
    if (has_loo) loo[i] = errors[i];
  }
  if (!above)
    s.single_record_coefficients =
        single_record_coefficients(formula, select(measurements, split.single), bounds, options);
  if (!s.single_record_coefficients.empty()) {
    for (std::size_t i : split.single) {  // the smaller of the two fits, as the model predicts them
      const double own = formula.predict(s.single_record_coefficients, measurements[i].dims);
      errors[i] = std::min(errors[i], (own - measurements[i].bytes) / measurements[i].bytes);
      if (has_loo) loo[i] = errors[i];
    }
  }
  s.rel_errors = std::move(errors);
  if (has_loo) s.leave_one_out_rel_errors = std::move(loo);
  for (std::size_t& i : s.held_out_undetermined) i = split.rest[i];
  for (std::size_t& i : s.held_out_extrapolated) i = split.rest[i];
  s.left_out = split.single;
  s.left_out_note = single_records_note(s, split.single.size(), above, lowest, highest);
  return rest;
}

// The fit without the single records predicts held-out shapes better (or held-out error is not
// known for the fit of every point).
bool lower_held_out(const FitResult& rest, const FitResult& all) {
  const double without = rest.summary.surrounded_held_out_max_rel_error;
  const double with = all.summary.surrounded_held_out_max_rel_error;
  return std::isnan(with) || (!std::isnan(without) && without < with);
}

}  // namespace

FitResult fit_coefficients(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options) {
  return fit_coefficients(formula, measurements, {}, options);
}

FitResult fit_coefficients(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const std::vector<InfeasibleBound>& bounds, const FitOptions& options) {
  detail::validate_fit_inputs(formula, measurements, bounds, options);
  FitResult all = detail::fit_points(formula, measurements, bounds, options);
  all.summary.batch_size_variable = options.batch_size_variable;
  if (!options.single_record_regime || options.batch_size_variable.empty()) return all;
  if (all.summary.usable && all.summary.max_rel_error <= kExplained) return all;
  const Split split = split_single_records(formula, measurements, options);
  // Enough other points to fit and to leave one out.
  if (split.single.empty() || split.rest.size() < formula.coefficient_names().size() + 2) return all;
  FitResult rest;
  try {
    rest = detail::fit_points(formula, select(measurements, split.rest), bounds, options);
  } catch (const std::invalid_argument&) {
    return all;  // the others cannot identify the coefficients alone
  }
  rest.summary.batch_size_variable = options.batch_size_variable;
  // Every single record below the trend (or on it), or every one above it (or on it).
  bool below = true, notably_below = false, above = true, notably_above = false;
  for (std::size_t i : split.single) {
    const double e = rel_error(formula, rest, measurements[i]);
    below = below && e >= -kOnTrend;
    notably_below = notably_below || e >= kBelowTrend;
    above = above && e <= kOnTrend;
    notably_above = notably_above || e < -kAboveTrend;
  }
  const bool apart = (below && notably_below) || (above && notably_above);
  if (!apart || !rest.summary.usable ||
      !(rest.summary.max_rel_error < all.summary.max_rel_error) || !lower_held_out(rest, all)) {
    return all;
  }
  return without_single_records(formula, measurements, split, std::move(rest), bounds, options);
}

}  // namespace xpm
