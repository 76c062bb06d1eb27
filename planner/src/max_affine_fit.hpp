// max_affine_fit.hpp — private to xpm::planner: the global least-squares fit of a formula that is
// a maximum of pieces affine in its linear coefficients (fit_start.cpp builds the pieces).
//
//   MaxAffineProblem problem;                 // one MaxAffinePoint per measurement
//   problem.points[i].residuals = ...;        // [pieces, k + 1]: residual of piece v is
//                                             //   row(v).head(k) . x + row(v)(k)
//   MaxAffineSolution s = solve_max_affine(problem, {});
//   // s.x minimizes sum_i (max_v residual_iv(x))^2 over x >= 0, s.assignment the winning pieces
//
// Why. A formula with max() (max(f, a*bs*l^2 + b*bs*l + c), or a peak that moves between
// operations, max(p1, p2) + c) has a least-squares cost with one convex piece per assignment of a
// winning argument to every point, and a local method (Ceres, or iterating "refit, reassign")
// stops in whichever piece it starts in: measured, f = 0 and several percent of error where an
// exact fit exists. Residuals are relative ((predicted - measured) / measured), so the maximum of
// the pieces' residuals is the residual of the maximum.
//
// Method. For an assignment s (point i -> piece s_i), the cost restricted to the region where
// s_i wins at every point is a least-squares problem with linear inequality constraints
//   minimize sum_i r_{i,s_i}(x)^2  subject to  r_{i,s_i}(x) >= r_{i,v}(x) for every v, x >= 0,
// solved exactly (Lawson and Hanson's LSI -> LDP -> NNLS reduction, chapter 23, with a 1e-14
// ridge on the scaled coefficients so every restricted problem has a unique solution). The
// regions cover every x, so the least cost over all assignments is the global optimum (to 1e-13
// in the cost, a sum of squared relative residuals).
//  - Up to MaxAffineSearchOptions::exhaustive_max_points points: depth-first branch and bound
//    over the assignments, point by point. A node's restricted problem over the points assigned
//    so far bounds every completion from below (more points add cost and constraints), so a node
//    at or above the best full cost is pruned; the first child tried is the piece that wins at
//    the node's solution, and the full cost at every node's solution updates the incumbent. The
//    search is exact unless it hits max_nodes (MaxAffineSolution::exhaustive is false then;
//    measured, 2,000 restricted problems: 110 searches of a three-variable selection took up to
//    23,323 without it, and 34 % of the selection's time, for the same chosen fit).
//  - Beyond: assignment iteration (fit every point to its assigned piece without the region
//    constraints, reassign each point to the piece that wins at the fit, repeat while the cost
//    falls) from several starts (the sum of the pieces, each piece alone at every point, and
//    seeded random assignments, and the winners at MaxAffineSearchOptions::seeds), then the
//    restricted problem of the best assignment and single-point reassignments while one
//    lowers the cost (each round the flips_per_round nearest the region's boundary: the
//    smallest gaps between a point's assigned and another piece's residual). Not guaranteed
//    global; documented as such in docs/formula.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <Eigen/Dense>

namespace xpm::detail {

struct MaxAffinePoint {
  /// [pieces, k + 1]: piece v's relative residual at this point is
  /// residuals.row(v).head(k) . x + residuals(v, k). At least one row.
  Eigen::MatrixXd residuals;
};

struct MaxAffineProblem {
  std::vector<MaxAffinePoint> points;
  std::size_t coefficients = 0;  // k
  bool non_negative = true;      // x >= 0
};

struct MaxAffineSearchOptions {
  std::size_t exhaustive_max_points = 16;  // branch and bound up to this many points
  /// Restricted problems branch and bound may solve: a budget in solver work, never in time, so
  /// the same points give the same fit on any machine. Stopped there, the best found is kept.
  std::int64_t max_nodes = 2000;
  int random_starts = 16;                  // beyond exhaustive_max_points: seeded random starts
  std::size_t flips_per_round = 24;        // after the starts: single-point reassignments tried
                                           // per round, those nearest the region's boundary
  /// Coefficient vectors ([k] each) whose winning pieces start one more assignment iteration,
  /// after the others: a refit of nearly the same points (a held-out refit) starts from the
  /// pieces of the fit it departs from, so the reassignments that follow begin near its optimum.
  /// Only the pieces are taken, not the values: a coefficient the points leave free is not
  /// carried over from the seed (a held-out refit takes no value from the point it leaves out).
  std::vector<Eigen::VectorXd> seeds;
};

struct MaxAffineSolution {
  Eigen::VectorXd x;                    // [k], the best coefficients found
  double cost = 0;                      // sum_i (max_v residual_iv(x))^2
  std::vector<std::size_t> assignment;  // the piece that wins at x, per point
  std::int64_t nodes = 0;               // restricted problems solved
  bool exhaustive = false;              // branch and bound finished: x is the global optimum
  bool stopped = false;                 // branch and bound ran and stopped at max_nodes
};

/// Sum over points of the squared largest residual at `x`.
double max_affine_cost(const MaxAffineProblem& problem, const Eigen::VectorXd& x);

/// The global (or, beyond exhaustive_max_points, best found) minimum of max_affine_cost.
MaxAffineSolution solve_max_affine(const MaxAffineProblem& problem,
                                   const MaxAffineSearchOptions& options = {});

}  // namespace xpm::detail
