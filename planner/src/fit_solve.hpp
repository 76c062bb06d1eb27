// fit_solve.hpp — private to xpm::planner: the least squares of a CostFormula's coefficients
// with Ceres, the infeasible bounds as hinges (fit_solve.cpp), for the fit (fit.cpp) and its
// held-out refits (fit_held_out.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ceres/ceres.h>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// A solve: the coefficients (declared order) and Ceres's summary, its steps summed over the
/// solves that led to it.
struct Solution {
  std::vector<double> coefficients;
  ceres::Solver::Summary summary;
  double weight = 0;  // hinge weight of the last solve
  std::string exact_report;  // set when solved exactly without Ceres: how (summary unused)
};

/// Linear least squares with the bounds' hinges of weight `weight`, from `start` (coefficients)
/// or, when null, from the exact (non-negative) least-squares solution of the measurements;
/// throws IdentifiabilityError before solving when the columns of the scaled design matrix are
/// dependent (the measurements alone must identify every coefficient).
/// `exact_is_enough`: without bounds or a robust loss, return the exact least-squares solution
/// without running Ceres (held-out refits: only their coefficients are read).
Solution solve_linear(const CostFormula& formula, const std::vector<Measurement>& measurements,
                      const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                      double weight, const std::vector<double>* start, bool exact_is_enough = false);

/// The exact least squares of a linear formula (no robust loss) with every bound's hinge target
/// as a hard constraint, and coefficients >= 0 when non-negative: what the hinges tend to as
/// their weight grows (Lawson and Hanson's LSI, no Ceres). nullopt when the constraints cannot
/// all hold there. Throws IdentifiabilityError as solve_linear does.
std::optional<std::vector<double>> solve_linear_constrained(const CostFormula& formula,
                                                            const std::vector<Measurement>& measurements,
                                                            const std::vector<InfeasibleBound>& bounds,
                                                            const FitOptions& options);

/// Whether no bound's hinge acts at `coefficients`: every bound predicted at or above the hinge's
/// target (a hair above exceeds_bytes), so the least-squares optimum of the measurements alone is
/// the optimum with the bounds.
bool bounds_hold(const CostFormula& formula, const std::vector<InfeasibleBound>& bounds,
                 const std::vector<double>& coefficients);

/// Solves (linear or not; `start` may be null for a linear formula only); while a bound is
/// violated at the solution, solves again from it with 10x the hinge weight (a few times at most).
/// A linear formula with bounds and no robust loss is solved exactly (solve_linear_constrained)
/// when its constraints can all hold.
Solution solve(const CostFormula& formula, const std::vector<Measurement>& measurements,
               const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
               const std::vector<double>* start);

/// The objective at `coefficients` with the hinge weight of the options: 1/2 sum rho(r_i^2) over
/// the measurements plus 1/2 sum hinge_b^2 over the bounds. Compares solutions from two starts.
double objective(const CostFormula& formula, const std::vector<Measurement>& measurements,
                 const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                 const std::vector<double>& coefficients);

}  // namespace xpm::detail
