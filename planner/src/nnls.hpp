// nnls.hpp — private to xpm::planner: non-negative linear least squares, shared by the fit
// (fit_solve.cpp) and the automatic start of non-linear fits (fit_start.cpp).
#pragma once

#include <Eigen/Dense>

namespace xpm::detail {

/// min |A x - b| subject to x >= 0: Lawson and Hanson's active-set algorithm ("Solving Least
/// Squares Problems", 1974, chapter 23). Meant for A of full column rank; for a rank-deficient A
/// it returns a basic solution (column-pivoted QR on the passive set).
Eigen::VectorXd non_negative_least_squares(const Eigen::MatrixXd& a, const Eigen::VectorXd& b);

}  // namespace xpm::detail
