// nnls.cpp — non-negative least squares (see nnls.hpp).
#include "nnls.hpp"

#include <algorithm>
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

}  // namespace xpm::detail
