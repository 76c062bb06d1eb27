// nnls.cpp — non-negative least squares (see nnls.hpp).
#include "nnls.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace xpm::detail {

Eigen::VectorXd non_negative_least_squares(const Eigen::MatrixXd& a, const Eigen::VectorXd& b) {
  const Eigen::Index k = a.cols();
  Eigen::VectorXd x = Eigen::VectorXd::Zero(k);
  std::vector<bool> passive(static_cast<std::size_t>(k), false);
  const double tolerance = 10 * std::numeric_limits<double>::epsilon() *
                           a.cwiseAbs().colwise().sum().maxCoeff() *
                           static_cast<double>(std::max(a.rows(), k));
  const auto solve_passive = [&]() {
    std::vector<Eigen::Index> columns;
    for (Eigen::Index j = 0; j < k; ++j) {
      if (passive[static_cast<std::size_t>(j)]) columns.push_back(j);
    }
    Eigen::MatrixXd sub(a.rows(), static_cast<Eigen::Index>(columns.size()));
    for (std::size_t c = 0; c < columns.size(); ++c) {
      sub.col(static_cast<Eigen::Index>(c)) = a.col(columns[c]);
    }
    const Eigen::VectorXd z = sub.colPivHouseholderQr().solve(b);
    Eigen::VectorXd s = Eigen::VectorXd::Zero(k);
    for (std::size_t c = 0; c < columns.size(); ++c) s(columns[c]) = z(static_cast<Eigen::Index>(c));
    return s;
  };
  for (int outer = 0; outer < 3 * static_cast<int>(k) + 10; ++outer) {
    const Eigen::VectorXd w = a.transpose() * (b - a * x);
    Eigen::Index best = -1;
    for (Eigen::Index j = 0; j < k; ++j) {
      if (!passive[static_cast<std::size_t>(j)] && w(j) > tolerance &&
          (best < 0 || w(j) > w(best))) {
        best = j;
      }
    }
    if (best < 0) break;  // Kuhn-Tucker conditions hold
    passive[static_cast<std::size_t>(best)] = true;
    for (int inner = 0; inner < 3 * static_cast<int>(k) + 10; ++inner) {
      if (std::none_of(passive.begin(), passive.end(), [](bool p) { return p; })) break;
      const Eigen::VectorXd s = solve_passive();
      bool feasible = true;
      double alpha = 1.0;
      for (Eigen::Index j = 0; j < k; ++j) {
        if (passive[static_cast<std::size_t>(j)] && s(j) <= 0) {
          feasible = false;
          alpha = std::min(alpha, x(j) / (x(j) - s(j)));
        }
      }
      if (feasible) {
        x = s;
        break;
      }
      x += alpha * (s - x);
      for (Eigen::Index j = 0; j < k; ++j) {
        if (passive[static_cast<std::size_t>(j)] && x(j) <= tolerance) {
          passive[static_cast<std::size_t>(j)] = false;
          x(j) = 0;
        }
      }
    }
  }
  return x;
}

std::optional<Eigen::VectorXd> least_squares_with_inequalities(const Eigen::MatrixXd& a,
                                                               const Eigen::VectorXd& b,
                                                               const Eigen::MatrixXd& g,
                                                               const Eigen::VectorXd& h, double slack) {
  const Eigen::Index k = a.cols();
  const Eigen::Index m = g.rows();
  const Eigen::HouseholderQR<Eigen::MatrixXd> qr(a);
  const Eigen::MatrixXd r = qr.matrixQR().topRows(k).triangularView<Eigen::Upper>();
  const Eigen::VectorXd f = (qr.householderQ().transpose() * b).head(k);
  // y = R^-1 (z + f): minimize |z| subject to E z >= e, E = G R^-1, e = h - E f.
  const auto upper = r.triangularView<Eigen::Upper>();
  Eigen::MatrixXd e_matrix = upper.transpose().solve(g.transpose()).transpose();
  Eigen::VectorXd e = h - e_matrix * f;
  // Each constraint scaled to a unit row (the same half-space): NNLS's tolerance grows with its
  // largest column, and one constraint 1e11 times another's size hid the small ones.
  for (Eigen::Index c = 0; c < m; ++c) {
    const double norm = e_matrix.row(c).norm();
    if (norm > 0 && std::isfinite(norm)) e_matrix.row(c) /= norm, e(c) /= norm;
  }
  Eigen::VectorXd z = Eigen::VectorXd::Zero(k);
  if (m > 0 && e.maxCoeff() > 0) {
    // LDP by NNLS: u >= 0 minimizing |[E^T; e^T] u - (0, ..., 0, 1)|.
    Eigen::MatrixXd system(k + 1, m);
    system.topRows(k) = e_matrix.transpose();
    system.row(k) = e.transpose();
    Eigen::VectorXd target = Eigen::VectorXd::Zero(k + 1);
    target(k) = 1;
    const Eigen::VectorXd u = non_negative_least_squares(system, target);
    const Eigen::VectorXd residual = system * u - target;
    if (!(residual.norm() > 1e-12) || !(std::abs(residual(k)) > 1e-300)) return std::nullopt;
    z = -residual.head(k) / residual(k);
  }
  const Eigen::VectorXd y = upper.solve(z + f);
  if (!y.allFinite()) return std::nullopt;
  if (m > 0 && (g * y - h).minCoeff() < -slack * std::max(1.0, h.cwiseAbs().maxCoeff())) {
    return std::nullopt;
  }
  return y;
}

}  // namespace xpm::detail
