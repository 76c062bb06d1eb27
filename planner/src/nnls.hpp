// nnls.hpp — private to xpm::planner: non-negative linear least squares and least squares under
// linear inequalities built on it, shared by the fit (fit_solve.cpp), the automatic start of
// non-linear fits (fit_start.cpp) and the max() search (max_affine_fit.cpp).
#pragma once

#include <optional>

#include <Eigen/Dense>

namespace xpm::detail {

/// min |A x - b| subject to x >= 0: Lawson and Hanson's active-set algorithm ("Solving Least
/// Squares Problems", 1974, chapter 23). Meant for A of full column rank; for a rank-deficient A
/// it returns a basic solution (column-pivoted QR on the passive set).
Eigen::VectorXd non_negative_least_squares(const Eigen::MatrixXd& a, const Eigen::VectorXd& b);

/// min |A y - b| subject to G y >= h (Lawson and Hanson, chapter 23: LSI to LDP to NNLS). A [n, k]
/// must have full column rank; G [m, k], h [m]. nullopt when the constraints cannot all hold, or
/// when the solution misses one by more than `slack` * max(1, max |h|).
std::optional<Eigen::VectorXd> least_squares_with_inequalities(const Eigen::MatrixXd& a,
                                                               const Eigen::VectorXd& b,
                                                               const Eigen::MatrixXd& g,
                                                               const Eigen::VectorXd& h, double slack);

}  // namespace xpm::detail
