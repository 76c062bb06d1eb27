// fit_points.hpp — private to xpm::planner: the fit of every given point (fit.cpp), under the
// public fit_coefficients (fit_regimes.cpp), which may leave some points out.
#pragma once

#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// Throws what fit_coefficients documents for bad options and inputs.
void validate_fit_inputs(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options);

/// fit_coefficients over exactly `measurements` (validated by the caller).
FitResult fit_points(const CostFormula& formula, const std::vector<Measurement>& measurements,
                     const std::vector<InfeasibleBound>& bounds, const FitOptions& options);

}  // namespace xpm::detail
