// fit_points.hpp — private to xpm::planner: the fit of every given point (fit.cpp), under the
// public fit_coefficients (fit_regimes.cpp), which may leave some points out.
#pragma once

#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// Throws std::invalid_argument, "<who>: measurement 3 has bytes = -5; bytes must be finite and
/// > 0", for the first measurement with another count of dims than `variable_names`, a dim that
/// is not finite, or bytes that are not finite and > 0.
void validate_measurements(const std::string& who, const std::vector<std::string>& variable_names,
                           const std::vector<Measurement>& measurements);

/// Throws what fit_coefficients documents for bad options and inputs.
void validate_fit_inputs(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options);

/// fit_coefficients over exactly `measurements` (validated by the caller).
FitResult fit_points(const CostFormula& formula, const std::vector<Measurement>& measurements,
                     const std::vector<InfeasibleBound>& bounds, const FitOptions& options);

}  // namespace xpm::detail
