// fit_held_out.hpp — private to xpm::planner: leave-one-shape-out refits of a fit
// (fit_held_out.cpp), for its verdict (fit.cpp, fit_verdict.cpp).
#pragma once

#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// Leave-one-shape-out: every group of points with the same dims is left out in turn, the others
/// refitted (non-linear fits start from the full solution), and the group predicted. A shape
/// whose prediction the others do not determine gets no figure (NaN; held_out_note says what
/// it rests on); one outside the others' range is extrapolation, reported apart. Fills the
/// held-out figures of result.summary; reads result.coefficients.
void leave_one_shape_out(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                         FitResult& result);

}  // namespace xpm::detail
