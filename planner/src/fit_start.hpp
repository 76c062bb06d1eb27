// fit_start.hpp — private to xpm::planner: the automatic start of non-linear fits (fit.cpp,
// fit_held_out.cpp).
//
//   AutomaticStart s = automatic_start(formula, measurements, options, ones);
//   // s.coefficients: p of a*bs*l^p + c from a grid search, a and c by least squares at that p
//
// The formula's structure (planner/src/formula_ast.hpp) sorts the coefficients into three roles:
//  - exponent: inside the exponent of a power (p in l^p, bs^(q+1)): searched on a grid,
//    coarse (0 to 4 by 0.25, from -2 when negative coefficients are allowed) then finer around
//    the best value (steps 0.05, 0.01, 0.002), one coefficient at a time, a few sweeps;
//  - linear: enters each term linearly and alone, possibly inside max(...) (a in a*bs*l^p,
//    a and b in max(a*bs*l, b*bs)): given the exponents, solved by (non-negative) linear least
//    squares on the relative residuals. A max(...) that holds linear coefficients is replaced
//    first by the sum of its arguments, then, at each point, by the argument that wins there
//    under the current coefficients, refitting until the cost stops falling (the least-squares
//    partition algorithm for max-affine fits); at the best exponents, when the formula is the
//    maximum of at most 64 variants affine in these coefficients, their global least-squares
//    optimum over which argument wins at each point (max_affine_fit.hpp);
//  - fixed: any other use (a*b*bs, a^2, bs/(a + b), the base of a power with a fitted exponent):
//    kept at the fallback start.
// Every candidate is scored by the true cost, the sum of squared relative residuals of
// CostFormula::predict; the best one is the start.
#pragma once

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

struct AutomaticStart {
  std::vector<double> coefficients;  // formula.coefficient_names() order
  double cost = std::numeric_limits<double>::infinity();  // sum of squared relative residuals
  std::string description;  // e.g. "automatic: p = 1.7 by grid search, a and c by least squares"
};

/// The automatic start of a non-linear fit of `formula` to `measurements` (validated by the
/// caller). `fallback` (declared order) gives the values of the fixed coefficients and is
/// returned, with its cost, when no candidate beats it. Honors options.non_negative. `near`
/// (declared order, or nullptr): the coefficients of a fit of nearly the same measurements (the
/// full fit, for a held-out refit); where max() is resolved globally, the arguments that win
/// under them start one more search, so the search begins near that fit's optimum.
AutomaticStart automatic_start(const CostFormula& formula,
                               const std::vector<Measurement>& measurements,
                               const FitOptions& options, const std::vector<double>& fallback,
                               const std::vector<double>* near = nullptr);

/// A formula whose every coefficient enters linearly, possibly inside max() (max(a*bs*l + c1,
/// b*bs + c2), max(f, a*bs*l^2 + c)), at most 64 combinations of max() arguments: at each of
/// `dims`, the rows [variants, k + 1] of its variants affine in the coefficients, the prediction
/// max_v rows.row(v).head(k) . coefficients + rows(v, k), bytes (duplicate rows dropped). The
/// solver's analytic residuals (fit_solve.cpp) use them. nullopt for any other formula, or when
/// a row is not finite.
std::optional<std::vector<Eigen::MatrixXd>> max_affine_variants(const CostFormula& formula,
                                                                const std::vector<std::vector<double>>& dims);

}  // namespace xpm::detail
