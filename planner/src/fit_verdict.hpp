// fit_verdict.hpp — private to xpm::planner: a fit's figures and the reasons that make it
// unusable (fit_verdict.cpp), which fit_points (fit.cpp) adds to FitSummary::reasons.
#pragma once

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "fit_solve.hpp"
#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// The solver's figures and the relative error at every point; returns the worst point and
/// the first whose prediction is not finite (if any).
std::pair<std::size_t, std::optional<std::size_t>> fill_statistics(
    const CostFormula& formula, const std::vector<Measurement>& measurements,
    const std::vector<InfeasibleBound>& bounds, const FitOptions& options, const Solution& solution,
    FitResult& result);

/// Not converged, a prediction that is not finite, too large an error at the points or at
/// held-out shapes (after leave_one_shape_out).
void add_accuracy_reasons(const CostFormula& formula, const std::vector<Measurement>& measurements,
                          const FitOptions& options, const Solution& solution, std::size_t worst,
                          std::optional<std::size_t> not_finite, FitSummary& s);

/// Every probe that ran out of memory must be predicted at or above the capacity it ran under.
void add_bound_reasons(const CostFormula& formula, const std::vector<InfeasibleBound>& bounds, FitResult& result);

/// The prediction must not decrease as the batch size grows (by one, or doubled) at any point.
void add_decreasing_reason(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options, FitResult& result);

}  // namespace xpm::detail
