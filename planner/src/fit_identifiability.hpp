// fit_identifiability.hpp — private to xpm::planner: whether the measurements determine every
// coefficient (fit_identifiability.cpp): before solving a linear formula (fit_solve.cpp), at the
// fitted point of a non-linear one (fit.cpp), and for held-out refits (fit_held_out.cpp).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Dense>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// A coefficient whose (scaled) column lies in the span of earlier ones, or is zero.
struct Dependence {
  std::size_t dependent;              // column index
  std::vector<std::size_t> partners;  // earlier columns it combines (empty: zero column)
};

/// Walks the columns of `jacobian` [points, coefficients] in declared order and returns the
/// first one whose unit column is within `tolerance` of the span of the independent columns
/// before it (a pivoted, sequential QR rank test).
std::optional<Dependence> find_dependence(const Eigen::MatrixXd& jacobian, double tolerance);

/// Message and names for a dependence; `where` is "by the probe shapes" or "at the fitted point".
std::pair<std::string, std::vector<std::string>> describe_dependence(
    const CostFormula& formula, const std::vector<Measurement>& measurements, const Dependence& d,
    const std::string& where);

/// Central-difference Jacobian of the relative residuals [points, coefficients] at
/// `coefficients`, each column scaled by max(|coefficient|, 1) so columns are comparable.
Eigen::MatrixXd numeric_jacobian(const CostFormula& formula,
                                 const std::vector<Measurement>& measurements,
                                 const std::vector<double>& coefficients);

/// Non-linear fits, after solving: every coefficient must change the prediction at some
/// measurement at the fitted point, independently of the others. A max() argument that adds
/// nothing at any measurement (it never wins, or ties a sibling of the same shape everywhere),
/// whose zeroing changes no prediction there and which a sibling of the same shape covers (e.g.
/// the second of two quadratic pieces when one explains every probe), is set to 0, coefficient by
/// coefficient, and named in the summary; any other dependence makes the fit unusable.
void check_identified_at_fit(const CostFormula& formula, const std::vector<Measurement>& measurements,
                             const FitOptions& options, FitResult& result);

}  // namespace xpm::detail
