// residual_structure.hpp — private to xpm::planner: does a fit leave residuals with structure
// (signs grouped along a variable) that says the formula misses a change of regime?
//
//   std::string note = residual_structure(formula, measurements, summary.rel_errors);
//   // "residuals are grouped by l: negative for l in [16, 45], positive for l in [90, 180] ..."
//
// Method: for each variable with at least 3 distinct values, the points are ordered by it (ties
// by the other variables) and the signs of their relative residuals counted in runs; the
// Wald-Wolfowitz runs test gives z = (runs - mean) / sd under random signs. A variable with
// z < -2 (far fewer runs than chance: p < 0.025) flags structure when the largest residual is
// at least 0.1 % (below that the fit is good enough for any plan). The note names the
// variable, the runs, and suggests a max() of pieces of the formula's shape (the peak moving
// from one operation to another as the shape changes).
#pragma once

#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// The note, or "" when the residuals show no structure (or there are fewer than 8 points).
std::string residual_structure(const CostFormula& formula, const std::vector<Measurement>& measurements,
                               const std::vector<double>& rel_errors);

/// `text` with every identifier in `names` replaced by prefix + name + suffix.
std::string rename_identifiers(const std::string& text, const std::vector<std::string>& names,
                               const std::string& prefix, const std::string& suffix);

}  // namespace xpm::detail
