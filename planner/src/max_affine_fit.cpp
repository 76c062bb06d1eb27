// max_affine_fit.cpp — global least squares over max() assignments (see max_affine_fit.hpp).
#include "max_affine_fit.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "nnls.hpp"

namespace xpm::detail {
namespace {

// Ridge on the scaled coefficients: every restricted problem has a unique solution (a piece that
// wins nowhere leaves its coefficients free), at a cost below any tolerance that matters.
constexpr double kRidge = 1e-14;
// Slack of cost comparisons (pruning, improvement): relative, and absolute in the cost (a sum of
// squared relative residuals; 1e-13 is far below any error that matters to a memory plan).
constexpr double kCostSlack = 1e-10;
constexpr double kAbsoluteSlack = 1e-13;
// Slack of the region constraints, in relative-residual units.
constexpr double kRegionSlack = 1e-9;

using Assignment = std::vector<std::size_t>;  // piece per point; kUnassigned for none
constexpr std::size_t kUnassigned = std::numeric_limits<std::size_t>::max();

struct Restricted {
  bool feasible = false;
  Eigen::VectorXd x;
  double cost = HUGE_VAL;  // sum over the assigned points of the squared assigned residual
};

class Solver {
 public:
  explicit Solver(const MaxAffineProblem& problem) : problem_(problem), k_(problem.coefficients) {
    // Column scales: the solver works on y_j = x_j * scale_j, every column O(1).
    scales_ = Eigen::VectorXd::Ones(static_cast<Eigen::Index>(k_));
    for (Eigen::Index j = 0; j < static_cast<Eigen::Index>(k_); ++j) {
      double largest = 0;
      for (const MaxAffinePoint& p : problem_.points) {
        largest = std::max(largest, p.residuals.col(j).cwiseAbs().maxCoeff());
      }
      if (largest > 0 && std::isfinite(largest)) scales_(j) = largest;
    }
    for (const MaxAffinePoint& p : problem_.points) {
      Eigen::MatrixXd scaled = p.residuals;
      for (Eigen::Index j = 0; j < static_cast<Eigen::Index>(k_); ++j) {
        scaled.col(j) /= scales_(j);
      }
      points_.push_back(std::move(scaled));
    }
  }

  std::size_t point_count() const { return points_.size(); }
  Eigen::Index pieces(std::size_t i) const { return points_[i].rows(); }
  std::size_t coefficient_count() const { return k_; }
  Eigen::VectorXd unscale(const Eigen::VectorXd& y) const { return y.cwiseQuotient(scales_); }
  Eigen::VectorXd scale(const Eigen::VectorXd& x) const { return x.cwiseProduct(scales_); }  // x: [k]

  double residual(std::size_t i, Eigen::Index v, const Eigen::VectorXd& y) const {
    const Eigen::Index k = static_cast<Eigen::Index>(k_);
    return points_[i].row(v).head(k).dot(y) + points_[i](v, k);
  }

  Eigen::Index winner(std::size_t i, const Eigen::VectorXd& y) const {
    Eigen::Index best = 0;
    for (Eigen::Index v = 1; v < pieces(i); ++v) {
      if (residual(i, v, y) > residual(i, best, y)) best = v;
    }
    return best;
  }

  double full_cost(const Eigen::VectorXd& y) const {
    double sum = 0;
    for (std::size_t i = 0; i < points_.size(); ++i) {
      const double r = residual(i, winner(i, y), y);
      sum += r * r;
    }
    return std::isfinite(sum) ? sum : HUGE_VAL;
  }

  Assignment winners(const Eigen::VectorXd& y) const {
    Assignment out(points_.size());
    for (std::size_t i = 0; i < points_.size(); ++i) out[i] = static_cast<std::size_t>(winner(i, y));
    return out;
  }

  // Least squares of the assigned residuals, x >= 0 when non_negative, without the region
  // constraints (assignment iteration).
  Eigen::VectorXd fit_assigned(const Assignment& assignment) const {
    Eigen::MatrixXd a;
    Eigen::VectorXd b;
    design(assignment, a, b);
    if (problem_.non_negative) return non_negative_least_squares(a, b);
    return a.colPivHouseholderQr().solve(b);
  }

  // The restricted problem of `assignment` (kUnassigned points left out): least squares of the
  // assigned residuals where every assigned piece wins at its point.
  Restricted solve_restricted(const Assignment& assignment) const {
    const Eigen::Index k = static_cast<Eigen::Index>(k_);
    Eigen::MatrixXd a;
    Eigen::VectorXd b;
    design(assignment, a, b);
    // Constraints g . y >= h: the assigned piece at least every other piece, and y >= 0.
    std::vector<Eigen::RowVectorXd> g_rows;
    std::vector<double> h_values;
    for (std::size_t i = 0; i < points_.size(); ++i) {
      const std::size_t s = assignment[i];
      if (s == kUnassigned) continue;
      const Eigen::Index si = static_cast<Eigen::Index>(s);
      for (Eigen::Index v = 0; v < pieces(i); ++v) {
        if (v == si) continue;
        Eigen::RowVectorXd g = points_[i].row(si).head(k) - points_[i].row(v).head(k);
        const double h = points_[i](v, k) - points_[i](si, k);
        if (g.cwiseAbs().maxCoeff() == 0) {
          if (h > kRegionSlack) return {};  // the other piece is higher everywhere
          continue;
        }
        g_rows.push_back(std::move(g));
        h_values.push_back(h);
      }
    }
    if (problem_.non_negative) {
      for (Eigen::Index j = 0; j < k; ++j) {
        Eigen::RowVectorXd g = Eigen::RowVectorXd::Zero(k);
        g(j) = 1;
        g_rows.push_back(std::move(g));
        h_values.push_back(0);
      }
    }
    Eigen::MatrixXd g(static_cast<Eigen::Index>(g_rows.size()), k);
    for (std::size_t c = 0; c < g_rows.size(); ++c) g.row(static_cast<Eigen::Index>(c)) = g_rows[c];
    const Eigen::VectorXd h = Eigen::Map<const Eigen::VectorXd>(h_values.data(), g.rows());
    Restricted out;
    const std::optional<Eigen::VectorXd> y = least_squares_with_inequalities(a, b, g, h, kRegionSlack);
    if (!y) return out;
    out.feasible = true;
    out.x = *y;
    const Eigen::Index t = a.rows() - k;  // without the ridge rows
    out.cost = (a.topRows(t) * *y - b.head(t)).squaredNorm();
    return out;
  }

 private:
  // Rows [assigned points, k] and right-hand side of the assigned residuals (r = a y - b), with
  // the ridge rows appended.
  void design(const Assignment& assignment, Eigen::MatrixXd& a, Eigen::VectorXd& b) const {
    const Eigen::Index k = static_cast<Eigen::Index>(k_);
    Eigen::Index t = 0;
    for (std::size_t s : assignment) t += s == kUnassigned ? 0 : 1;
    a.setZero(t + k, k);
    b.setZero(t + k);
    Eigen::Index row = 0;
    for (std::size_t i = 0; i < points_.size(); ++i) {
      const std::size_t s = assignment[i];
      if (s == kUnassigned) continue;
      const Eigen::Index si = static_cast<Eigen::Index>(s);
      a.row(row) = points_[i].row(si).head(k);
      b(row) = -points_[i](si, k);
      ++row;
    }
    a.bottomRows(k).diagonal().setConstant(std::sqrt(kRidge));
  }

  const MaxAffineProblem& problem_;
  std::size_t k_;
  Eigen::VectorXd scales_;
  std::vector<Eigen::MatrixXd> points_;  // scaled residual pieces
};

struct Best {
  Eigen::VectorXd y;
  double cost = HUGE_VAL;

  bool offer(const Solver& solver, const Eigen::VectorXd& candidate) {
    if (!candidate.allFinite()) return false;
    const double c = solver.full_cost(candidate);
    if (!(c < cost * (1 - kCostSlack))) return false;
    cost = c;
    y = candidate;
    return true;
  }
};

// Assignment iteration from `start`: fit, reassign to the winners, while the cost falls.
void iterate_assignments(const Solver& solver, Assignment assignment, Best& best) {
  double last = HUGE_VAL;
  for (int round = 0; round < 50; ++round) {
    const Eigen::VectorXd y = solver.fit_assigned(assignment);
    if (!y.allFinite()) return;
    const double cost = solver.full_cost(y);
    best.offer(solver, y);
    if (!(cost < last * (1 - kCostSlack))) return;
    last = cost;
    Assignment next = solver.winners(y);
    if (next == assignment) return;
    assignment = std::move(next);
  }
}

// The single-point reassignments (point, piece) nearest the boundary of `assignment`'s region at
// `y`: the smallest gaps between the assigned piece's residual and another piece's, at most
// `count` (ties: lower point, then lower piece). A point deep inside its piece's region is only
// reassigned by moving far from the fit, so the near ones are the ones that can lower the cost.
std::vector<std::pair<std::size_t, Eigen::Index>> nearest_flips(const Solver& solver, const Eigen::VectorXd& y,
                                                                const Assignment& assignment, std::size_t count) {
  std::vector<std::tuple<double, std::size_t, Eigen::Index>> flips;
  for (std::size_t i = 0; i < solver.point_count(); ++i) {
    const Eigen::Index s = static_cast<Eigen::Index>(assignment[i]);
    const double assigned = solver.residual(i, s, y);
    for (Eigen::Index v = 0; v < solver.pieces(i); ++v) {
      if (v != s) flips.emplace_back(std::abs(assigned - solver.residual(i, v, y)), i, v);
    }
  }
  const std::size_t kept = std::min(count, flips.size());
  std::partial_sort(flips.begin(), flips.begin() + static_cast<std::ptrdiff_t>(kept), flips.end());
  std::vector<std::pair<std::size_t, Eigen::Index>> out;
  for (std::size_t f = 0; f < kept; ++f) out.emplace_back(std::get<1>(flips[f]), std::get<2>(flips[f]));
  return out;
}

void multi_start(const Solver& solver, const MaxAffineSearchOptions& options, Best& best,
                 std::int64_t& nodes) {
  const std::size_t n = solver.point_count();
  Eigen::Index most = 1;
  for (std::size_t i = 0; i < n; ++i) most = std::max(most, solver.pieces(i));
  for (Eigen::Index v = 0; v < most; ++v) {
    Assignment start(n);
    for (std::size_t i = 0; i < n; ++i) {
      start[i] = static_cast<std::size_t>(std::min(v, solver.pieces(i) - 1));
    }
    iterate_assignments(solver, start, best);
  }
  std::mt19937_64 random(0x5eed);
  for (int s = 0; s < options.random_starts; ++s) {
    Assignment start(n);
    for (std::size_t i = 0; i < n; ++i) {
      start[i] = static_cast<std::size_t>(random() % static_cast<std::uint64_t>(solver.pieces(i)));
    }
    iterate_assignments(solver, start, best);
  }
  for (const Eigen::VectorXd& seed : options.seeds) {
    if (seed.size() != static_cast<Eigen::Index>(solver.coefficient_count()) || !seed.allFinite()) continue;
    const Eigen::VectorXd y = solver.scale(seed);
    iterate_assignments(solver, solver.winners(y), best);  // its pieces, not its values
  }
  // The best assignment's restricted problem, then single-point reassignments while one helps.
  if (best.y.size() == 0) return;
  Assignment assignment = solver.winners(best.y);
  for (int round = 0; round < 20; ++round) {
    bool improved = false;
    const Restricted here = solver.solve_restricted(assignment);
    ++nodes;
    if (here.feasible) improved = best.offer(solver, here.x) || improved;
    for (const auto& [i, v] : nearest_flips(solver, best.y, assignment, options.flips_per_round)) {
      Assignment flipped = assignment;
      flipped[i] = static_cast<std::size_t>(v);
      const Restricted r = solver.solve_restricted(flipped);
      ++nodes;
      if (r.feasible && best.offer(solver, r.x)) improved = true;
    }
    if (!improved) break;
    assignment = solver.winners(best.y);
  }
}

class BranchAndBound {
 public:
  BranchAndBound(const Solver& solver, const MaxAffineSearchOptions& options, Best& best)
      : solver_(solver), options_(options), best_(best) {}

  /// False when it stopped at max_nodes.
  bool run() {
    const std::size_t n = solver_.point_count();
    Assignment assignment(n, kUnassigned);
    for (std::size_t i = 0; i < n; ++i) {
      if (solver_.pieces(i) == 1) {
        assignment[i] = 0;  // one piece: nothing to choose
      } else {
        order_.push_back(i);
      }
    }
    descend(assignment, 0);
    return !stopped_;
  }

  std::int64_t nodes() const { return nodes_; }

 private:
  void descend(Assignment& assignment, std::size_t depth) {
    if (stopped_) return;
    if (nodes_ >= options_.max_nodes) {
      stopped_ = true;
      return;
    }
    const Restricted node = solver_.solve_restricted(assignment);
    ++nodes_;
    if (!node.feasible) return;
    const double bound = node.cost;
    // No completion does better than the incumbent.
    if (bound >= best_.cost * (1 - kCostSlack) - kAbsoluteSlack) return;
    best_.offer(solver_, node.x);
    // The node's own solution already costs its bound in full: nothing below does better.
    if (solver_.full_cost(node.x) <= bound * (1 + kCostSlack) + kAbsoluteSlack) return;
    if (depth == order_.size()) return;
    const std::size_t i = order_[depth];
    // The piece that wins at the node's solution first, then the others by their residual there.
    std::vector<Eigen::Index> pieces(static_cast<std::size_t>(solver_.pieces(i)));
    std::iota(pieces.begin(), pieces.end(), 0);
    std::sort(pieces.begin(), pieces.end(), [&](Eigen::Index l, Eigen::Index r) {
      return solver_.residual(i, l, node.x) > solver_.residual(i, r, node.x);
    });
    for (Eigen::Index v : pieces) {
      assignment[i] = static_cast<std::size_t>(v);
      descend(assignment, depth + 1);
    }
    assignment[i] = kUnassigned;
  }

  const Solver& solver_;
  const MaxAffineSearchOptions& options_;
  Best& best_;
  std::vector<std::size_t> order_;
  std::int64_t nodes_ = 0;
  bool stopped_ = false;
};

}  // namespace

double max_affine_cost(const MaxAffineProblem& problem, const Eigen::VectorXd& x) {
  const Eigen::Index k = static_cast<Eigen::Index>(problem.coefficients);
  double sum = 0;
  for (const MaxAffinePoint& p : problem.points) {
    const Eigen::VectorXd r = p.residuals.leftCols(k) * x + p.residuals.col(k);
    const double largest = r.maxCoeff();
    sum += largest * largest;
  }
  return std::isfinite(sum) ? sum : HUGE_VAL;
}

MaxAffineSolution solve_max_affine(const MaxAffineProblem& problem,
                                   const MaxAffineSearchOptions& options) {
  const Solver solver(problem);
  Best best;
  MaxAffineSolution out;
  multi_start(solver, options, best, out.nodes);
  if (problem.points.size() <= options.exhaustive_max_points) {
    BranchAndBound search(solver, options, best);
    out.exhaustive = search.run();
    out.stopped = !out.exhaustive;
    out.nodes += search.nodes();
  }
  if (best.y.size() == 0) best.y = Eigen::VectorXd::Zero(static_cast<Eigen::Index>(problem.coefficients));
  out.x = solver.unscale(best.y);
  if (problem.non_negative) out.x = out.x.cwiseMax(0.0);
  out.cost = max_affine_cost(problem, out.x);
  out.assignment = solver.winners(best.y);
  return out;
}

}  // namespace xpm::detail
