// fit_solve.cpp — solving: the least squares of a CostFormula's coefficients with Ceres, with
// the infeasible bounds as hinges (see fit_solve.hpp).
//
// Linear formulas, with B_ik = formula.basis(dims_i)[k], o_i = formula.offset(dims_i),
// y_i = measured bytes, Y = max_i y_i and s_k = max_i |B_ik| (column scale):
//
//   minimize_x  1/2 sum_i rho(r_i(x)^2),   r_i(x) = (o_i + sum_k B_ik * Y / s_k * x_k - y_i) / y_i
//   subject to  x_k >= 0 (when FitOptions::non_negative)
//
// and coefficient_k = x_k * Y / s_k. The residual is linear in x, so each point's cost function
// returns a constant Jacobian row J_ik = B_ik * Y / (s_k * y_i), O(1) like x. rho is the robust
// loss (identity by default). Before solving, J must have full column rank (find_dependence);
// the start is the exact (non-negative) least-squares solution.
//
// Other formulas: r_i(x) = (formula.predict(x .* s, dims_i) - y_i) / y_i, s_k = |initial value
// of k| (1 when 0), same bounds and loss. Where every coefficient enters linearly inside max()
// (max_affine_variants, fit_start.hpp), the prediction is the largest of a few affine variants
// and its Jacobian row is the winning variant's, computed from rows built once per point (the
// formula selection fits hundreds of such candidates); else central numeric differences.
#include "fit_solve.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Dense>

#include "fit_identifiability.hpp"
#include "fit_start.hpp"
#include "nnls.hpp"
#include "number_format.hpp"

namespace xpm::detail {
namespace {

// One point's relative residual r = r0 + J x, one parameter block of all scaled coefficients.
class LinearRelativeResidual final : public ceres::CostFunction {
 public:
  LinearRelativeResidual(Eigen::RowVectorXd jacobian, double r0)
      : jacobian_(std::move(jacobian)), r0_(r0) {
    set_num_residuals(1);
    mutable_parameter_block_sizes()->push_back(static_cast<int>(jacobian_.size()));
  }

  bool Evaluate(double const* const* parameters, double* residuals,
                double** jacobians) const override {
    const Eigen::Index k = jacobian_.size();
    Eigen::Map<const Eigen::VectorXd> x(parameters[0], k);
    residuals[0] = r0_ + jacobian_.dot(x);
    if (jacobians != nullptr && jacobians[0] != nullptr) {
      Eigen::Map<Eigen::RowVectorXd>(jacobians[0], k) = jacobian_;
    }
    return true;
  }

 private:
  Eigen::RowVectorXd jacobian_;  // [coefficients]
  double r0_;                    // (o_i - y_i) / y_i
};

// One point's relative residual of any formula, for numeric differentiation.
class PredictRelativeResidual {
 public:
  PredictRelativeResidual(const CostFormula& formula, std::vector<double> dims, double bytes,
                          std::vector<double> scales)
      : formula_(formula), dims_(std::move(dims)), bytes_(bytes), scales_(std::move(scales)) {}

  bool operator()(double const* const* parameters, double* residuals) const {
    std::vector<double> coefficients(scales_.size());
    for (std::size_t k = 0; k < scales_.size(); ++k) coefficients[k] = parameters[0][k] * scales_[k];
    residuals[0] = (formula_.predict(coefficients, dims_) - bytes_) / bytes_;
    return std::isfinite(residuals[0]);
  }

 private:
  const CostFormula& formula_;
  std::vector<double> dims_;
  double bytes_;
  std::vector<double> scales_;
};

// One point's relative residual of a formula that is the maximum of affine variants:
// r = (max_v (rows_v . (x .* s) + offset_v) - y) / y, the winning variant's row as Jacobian.
class MaxAffineRelativeResidual final : public ceres::CostFunction {
 public:
  // `rows` [variants, k + 1] in bytes (max_affine_variants); `scales` [k].
  MaxAffineRelativeResidual(const Eigen::MatrixXd& rows, double bytes, const std::vector<double>& scales)
      : rows_(rows.leftCols(rows.cols() - 1)), offsets_(rows.col(rows.cols() - 1)) {
    for (Eigen::Index j = 0; j < rows_.cols(); ++j) rows_.col(j) *= scales[static_cast<std::size_t>(j)] / bytes;
    offsets_ = (offsets_.array() - bytes) / bytes;
    set_num_residuals(1);
    mutable_parameter_block_sizes()->push_back(static_cast<int>(rows_.cols()));
  }

  bool Evaluate(double const* const* parameters, double* residuals,
                double** jacobians) const override {
    Eigen::Map<const Eigen::VectorXd> x(parameters[0], rows_.cols());
    Eigen::Index winner = 0;
    const double value = (rows_ * x + offsets_).maxCoeff(&winner);
    residuals[0] = value;
    if (jacobians != nullptr && jacobians[0] != nullptr) {
      Eigen::Map<Eigen::RowVectorXd>(jacobians[0], rows_.cols()) = rows_.row(winner);
    }
    return std::isfinite(value);
  }

 private:
  Eigen::MatrixXd rows_;     // [variants, k]: d(relative residual) / dx per variant
  Eigen::VectorXd offsets_;  // [variants]: the relative residual at x = 0
};

// max_affine_variants of `formula` at `dims` when they reproduce its predictions at `start`
// (the analytic residuals below rest on them), else nullopt (numeric differences).
std::optional<std::vector<Eigen::MatrixXd>> matching_variants(const CostFormula& formula,
                                                              const std::vector<std::vector<double>>& dims,
                                                              const std::vector<double>& start) {
  auto variants = max_affine_variants(formula, dims);
  if (!variants) return std::nullopt;
  const Eigen::Map<const Eigen::VectorXd> at(start.data(), static_cast<Eigen::Index>(start.size()));
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const Eigen::MatrixXd& rows = (*variants)[i];
    const double predicted = formula.predict(start, dims[i]);
    const double rebuilt = (rows.leftCols(rows.cols() - 1) * at + rows.col(rows.cols() - 1)).maxCoeff();
    if (!(std::abs(rebuilt - predicted) <= 1e-9 * std::max(1.0, std::abs(predicted)))) return std::nullopt;
  }
  return variants;
}

// The analytic residuals of `formula` at the measurements when it is the maximum of affine
// variants that reproduce its predictions at `start`; else empty (numeric differences).
std::vector<std::unique_ptr<ceres::CostFunction>> max_affine_residuals(const CostFormula& formula,
                                                                       const std::vector<Measurement>& measurements,
                                                                       const std::vector<double>& start,
                                                                       const std::vector<double>& scales) {
  std::vector<std::vector<double>> dims;
  for (const Measurement& m : measurements) dims.push_back(m.dims);
  const auto variants = matching_variants(formula, dims, start);
  std::vector<std::unique_ptr<ceres::CostFunction>> out;
  for (std::size_t i = 0; variants && i < measurements.size(); ++i) {
    out.push_back(std::make_unique<MaxAffineRelativeResidual>((*variants)[i], measurements[i].bytes, scales));
  }
  return out;
}

// The hinge aims a little above exceeds_bytes so that the penalty's equilibrium, a hair below
// its target, still satisfies the bound.
constexpr double kBoundMargin = 1e-6;
// Extra solves with 10x the hinge weight while a bound is violated.
constexpr int kBoundRounds = 4;

double hinge_target(const InfeasibleBound& bound) { return bound.exceeds_bytes * (1 + kBoundMargin); }

// One infeasible bound's hinge, linear formulas: weight * max(0, t0 - row . x).
class LinearHingeResidual final : public ceres::CostFunction {
 public:
  LinearHingeResidual(Eigen::RowVectorXd row, double t0, double weight)
      : row_(std::move(row)), t0_(t0), weight_(weight) {
    set_num_residuals(1);
    mutable_parameter_block_sizes()->push_back(static_cast<int>(row_.size()));
  }

  bool Evaluate(double const* const* parameters, double* residuals,
                double** jacobians) const override {
    const Eigen::Index k = row_.size();
    Eigen::Map<const Eigen::VectorXd> x(parameters[0], k);
    const double shortfall = t0_ - row_.dot(x);
    const bool active = shortfall > 0;
    residuals[0] = active ? weight_ * shortfall : 0.0;
    if (jacobians != nullptr && jacobians[0] != nullptr) {
      Eigen::Map<Eigen::RowVectorXd> jacobian(jacobians[0], k);
      if (active) {
        jacobian = -weight_ * row_;
      } else {
        jacobian.setZero();
      }
    }
    return true;
  }

 private:
  Eigen::RowVectorXd row_;  // [coefficients] d(prediction / exceeds) / dx
  double t0_;               // (target - offset) / exceeds
  double weight_;
};

// One infeasible bound's hinge of a formula that is the maximum of affine variants:
// weight * max(0, (target - max_v (rows_v . (x .* s) + offset_v)) / exceeds), the winning
// variant's row as Jacobian where it is active.
class MaxAffineHingeResidual final : public ceres::CostFunction {
 public:
  // `rows` [variants, k + 1] in bytes (max_affine_variants at the bound's dims); `scales` [k].
  MaxAffineHingeResidual(const Eigen::MatrixXd& rows, const InfeasibleBound& bound,
                         const std::vector<double>& scales, double weight)
      : rows_(rows.leftCols(rows.cols() - 1)),
        offsets_(rows.col(rows.cols() - 1) / bound.exceeds_bytes),
        target_(hinge_target(bound) / bound.exceeds_bytes),
        weight_(weight) {
    for (Eigen::Index j = 0; j < rows_.cols(); ++j) {
      rows_.col(j) *= scales[static_cast<std::size_t>(j)] / bound.exceeds_bytes;
    }
    set_num_residuals(1);
    mutable_parameter_block_sizes()->push_back(static_cast<int>(rows_.cols()));
  }

  bool Evaluate(double const* const* parameters, double* residuals,
                double** jacobians) const override {
    Eigen::Map<const Eigen::VectorXd> x(parameters[0], rows_.cols());
    Eigen::Index winner = 0;
    const double shortfall = target_ - (rows_ * x + offsets_).maxCoeff(&winner);
    const bool active = shortfall > 0;
    residuals[0] = active ? weight_ * shortfall : 0.0;
    if (jacobians != nullptr && jacobians[0] != nullptr) {
      Eigen::Map<Eigen::RowVectorXd> jacobian(jacobians[0], rows_.cols());
      if (active) {
        jacobian = -weight_ * rows_.row(winner);
      } else {
        jacobian.setZero();
      }
    }
    return std::isfinite(shortfall);
  }

 private:
  Eigen::MatrixXd rows_;     // [variants, k]: d(prediction / exceeds) / dx per variant
  Eigen::VectorXd offsets_;  // [variants]: prediction / exceeds at x = 0
  double target_;            // the hinge's target / exceeds
  double weight_;
};

// The analytic hinges of `bounds` when `formula` is the maximum of affine variants that
// reproduce its predictions at `start` there; else empty (numeric differences).
std::vector<std::unique_ptr<ceres::CostFunction>> max_affine_hinges(const CostFormula& formula,
                                                                    const std::vector<InfeasibleBound>& bounds,
                                                                    const std::vector<double>& start,
                                                                    const std::vector<double>& scales, double weight) {
  std::vector<std::vector<double>> dims;
  for (const InfeasibleBound& bound : bounds) dims.push_back(bound.dims);
  const auto variants = matching_variants(formula, dims, start);
  std::vector<std::unique_ptr<ceres::CostFunction>> out;
  for (std::size_t i = 0; variants && i < bounds.size(); ++i) {
    out.push_back(std::make_unique<MaxAffineHingeResidual>((*variants)[i], bounds[i], scales, weight));
  }
  return out;
}

// One infeasible bound's hinge, any formula, for numeric differentiation:
// weight * max(0, (target - predict) / exceeds).
class PredictHingeResidual {
 public:
  PredictHingeResidual(const CostFormula& formula, const InfeasibleBound& bound,
                       std::vector<double> scales, double weight)
      : formula_(formula),
        dims_(bound.dims),
        exceeds_bytes_(bound.exceeds_bytes),
        target_bytes_(hinge_target(bound)),
        scales_(std::move(scales)),
        weight_(weight) {}

  bool operator()(double const* const* parameters, double* residuals) const {
    std::vector<double> coefficients(scales_.size());
    for (std::size_t k = 0; k < scales_.size(); ++k) coefficients[k] = parameters[0][k] * scales_[k];
    const double shortfall = (target_bytes_ - formula_.predict(coefficients, dims_)) / exceeds_bytes_;
    residuals[0] = weight_ * std::max(0.0, shortfall);
    return std::isfinite(residuals[0]);
  }

 private:
  const CostFormula& formula_;
  std::vector<double> dims_;
  double exceeds_bytes_;
  double target_bytes_;
  std::vector<double> scales_;
  double weight_;
};

ceres::LossFunction* make_loss(const FitOptions& options) {
  if (options.robust_loss == RobustLoss::kHuber) return new ceres::HuberLoss(options.robust_loss_scale);
  if (options.robust_loss == RobustLoss::kCauchy) return new ceres::CauchyLoss(options.robust_loss_scale);
  return nullptr;
}

ceres::Solver::Options solver_options(const FitOptions& options) {
  ceres::Solver::Options o;
  o.minimizer_type = ceres::TRUST_REGION;
  o.trust_region_strategy_type = ceres::LEVENBERG_MARQUARDT;
  o.linear_solver_type = ceres::DENSE_QR;
  o.max_num_iterations = options.max_iterations;
  o.function_tolerance = options.function_tolerance;
  o.gradient_tolerance = options.gradient_tolerance;
  o.parameter_tolerance = options.parameter_tolerance;
  o.logging_type = ceres::SILENT;
  o.minimizer_progress_to_stdout = false;
  o.num_threads = 1;
  std::string error;
  if (!o.IsValid(&error)) throw std::invalid_argument("fit: invalid Ceres options: " + error);
  return o;
}

// Non-linear least squares with the bounds' hinges, from `start` (coefficients, declared order).
Solution solve_nonlinear(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                         double weight, const std::vector<double>& start) {
  const std::size_t k = formula.coefficient_names().size();
  std::vector<double> scales(k);
  std::vector<double> x(k);
  for (std::size_t j = 0; j < k; ++j) {
    scales[j] = start[j] != 0 ? std::abs(start[j]) : 1.0;
    x[j] = start[j] / scales[j];
  }
  ceres::Problem problem;
  std::vector<std::unique_ptr<ceres::CostFunction>> analytic = max_affine_residuals(formula, measurements, start, scales);
  for (std::unique_ptr<ceres::CostFunction>& cost : analytic) {
    problem.AddResidualBlock(cost.release(), make_loss(options), x.data());
  }
  for (const Measurement& m : analytic.empty() ? measurements : std::vector<Measurement>{}) {
    using Cost = ceres::DynamicNumericDiffCostFunction<PredictRelativeResidual, ceres::CENTRAL>;
    auto* cost = new Cost(new PredictRelativeResidual(formula, m.dims, m.bytes, scales));
    cost->AddParameterBlock(static_cast<int>(k));
    cost->SetNumResiduals(1);
    problem.AddResidualBlock(cost, make_loss(options), x.data());
  }
  std::vector<std::unique_ptr<ceres::CostFunction>> hinges =
      bounds.empty() ? decltype(analytic){} : max_affine_hinges(formula, bounds, start, scales, weight);
  for (std::unique_ptr<ceres::CostFunction>& cost : hinges) problem.AddResidualBlock(cost.release(), nullptr, x.data());
  for (const InfeasibleBound& bound : hinges.empty() ? bounds : std::vector<InfeasibleBound>{}) {
    using Cost = ceres::DynamicNumericDiffCostFunction<PredictHingeResidual, ceres::CENTRAL>;
    auto* cost = new Cost(new PredictHingeResidual(formula, bound, scales, weight));
    cost->AddParameterBlock(static_cast<int>(k));
    cost->SetNumResiduals(1);
    problem.AddResidualBlock(cost, nullptr, x.data());
  }
  if (options.non_negative) {
    for (int j = 0; j < static_cast<int>(k); ++j) problem.SetParameterLowerBound(x.data(), j, 0.0);
  }
  Solution s;
  ceres::Solve(solver_options(options), &problem, &s.summary);
  s.coefficients.resize(k);
  for (std::size_t j = 0; j < k; ++j) {
    double c = x[j] * scales[j];
    if (options.non_negative) c = std::max(c, 0.0);
    s.coefficients[j] = c;
  }
  return s;
}

void add_steps(Solution& to, const Solution& from) {
  to.summary.num_successful_steps += from.summary.num_successful_steps;
  to.summary.num_unsuccessful_steps += from.summary.num_unsuccessful_steps;
}

// One solve at hinge weight `weight`. `start` may be null for a linear formula only.
Solution solve_at_weight(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                         double weight, const std::vector<double>* start) {
  if (formula.is_linear()) {
    return solve_linear(formula, measurements, bounds, options, weight, start);
  }
  Solution first = solve_nonlinear(formula, measurements, bounds, options, weight, *start);
  // The start fixed the scales; when the solution is far from them (a 1e6-byte constant
  // started at 1), solve again from the solution with the solution as scales, so the final
  // steps and tolerances work on O(1) parameters.
  bool rescale = false;
  for (std::size_t j = 0; j < start->size(); ++j) {
    const double s = (*start)[j] != 0 ? std::abs((*start)[j]) : 1.0;
    const double ratio = std::abs(first.coefficients[j]) / s;
    rescale = rescale || (first.coefficients[j] != 0 && (ratio > 10 || ratio < 0.1));
  }
  if (!rescale) return first;
  Solution second =
      solve_nonlinear(formula, measurements, bounds, options, weight, first.coefficients);
  if (!(second.summary.final_cost <= first.summary.final_cost)) return first;
  add_steps(second, first);
  return second;
}

std::size_t violated_bounds(const CostFormula& formula, const std::vector<InfeasibleBound>& bounds,
                            const std::vector<double>& coefficients) {
  std::size_t violated = 0;
  for (const InfeasibleBound& bound : bounds) {
    violated += formula.predict(coefficients, bound.dims) >= bound.exceeds_bytes ? 0 : 1;
  }
  return violated;
}

}  // namespace

namespace {

// The relative, scaled linear system of a linear formula: J x ~= -r0 with J_ik = B_ik * Y /
// (s_k * y_i), so J and x are O(1) (with x in bytes, Ceres's projected-gradient test
// x - P(x - g) rounds to 0 under the bounds and it stops at once); coefficient_k = x_k * Y / s_k.
struct LinearSystem {
  Eigen::MatrixXd jacobian;  // [n, k]
  Eigen::VectorXd r0;        // [n]
  Eigen::VectorXd scale;     // [k], s_k = max_i |B_ik|
  double y_max = 0;          // Y

  std::vector<double> coefficients(const Eigen::VectorXd& x, bool non_negative) const {
    std::vector<double> out;
    for (Eigen::Index j = 0; j < x.size(); ++j) {
      const double c = x(j) * y_max / scale(j);
      out.push_back(non_negative ? std::max(c, 0.0) : c);  // the bound holds exactly, even for -0
    }
    return out;
  }
};

// Builds the system; throws IdentifiabilityError when the columns of J are dependent (the
// measurements alone must identify every coefficient).
LinearSystem linear_system(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options) {
  const auto& coefs = formula.coefficient_names();
  const Eigen::Index n = static_cast<Eigen::Index>(measurements.size());
  const Eigen::Index k = static_cast<Eigen::Index>(coefs.size());
  Eigen::MatrixXd basis(n, k);
  Eigen::VectorXd offset(n);
  for (Eigen::Index i = 0; i < n; ++i) {
    const auto& dims = measurements[static_cast<std::size_t>(i)].dims;
    const std::vector<double> b = formula.basis(dims);
    for (Eigen::Index j = 0; j < k; ++j) basis(i, j) = b[static_cast<std::size_t>(j)];
    offset(i) = formula.offset(dims);
    if (!std::isfinite(offset(i))) {
      throw std::invalid_argument("fit: the constant terms of the formula are not finite at "
                                  "measurement " + std::to_string(i));
    }
  }
  LinearSystem system;
  system.scale.resize(k);
  for (Eigen::Index j = 0; j < k; ++j) {
    if (!basis.col(j).allFinite()) {
      throw std::invalid_argument("fit: the term of coefficient '" +
                                  coefs[static_cast<std::size_t>(j)] +
                                  "' is not finite at some measurement (overflow?)");
    }
    system.scale(j) = basis.col(j).cwiseAbs().maxCoeff();
  }
  Eigen::VectorXd y(n);
  for (Eigen::Index i = 0; i < n; ++i) y(i) = measurements[static_cast<std::size_t>(i)].bytes;
  system.y_max = y.maxCoeff();
  system.jacobian = (system.y_max * y.cwiseInverse()).asDiagonal() * basis;
  for (Eigen::Index j = 0; j < k; ++j) {
    if (system.scale(j) > 0) system.jacobian.col(j) /= system.scale(j);
  }
  system.r0 = (offset - y).cwiseQuotient(y);
  if (const auto d = find_dependence(system.jacobian, options.identifiability_tolerance)) {
    auto [message, names] = describe_dependence(formula, measurements, *d, "by the probe shapes");
    throw IdentifiabilityError("fit: " + message, std::move(names), coefs[d->dependent]);
  }
  return system;
}

// Bound b as a constraint of the scaled system, row . x >= t0: the prediction at its dims is
// exceeds * (1 - t0 + row . x) with t0 = (target - offset) / exceeds, target its hinge's.
std::pair<Eigen::RowVectorXd, double> bound_row(const CostFormula& formula, const LinearSystem& system,
                                                const InfeasibleBound& bound, std::size_t b) {
  const Eigen::Index k = system.scale.size();
  const std::vector<double> term = formula.basis(bound.dims);
  const double bound_offset = formula.offset(bound.dims);
  Eigen::RowVectorXd row(k);
  for (Eigen::Index j = 0; j < k; ++j) {
    row(j) = term[static_cast<std::size_t>(j)] * system.y_max / system.scale(j) / bound.exceeds_bytes;
  }
  if (!row.allFinite() || !std::isfinite(bound_offset)) {
    throw std::invalid_argument("fit: the formula is not finite at infeasible bound " +
                                std::to_string(b) + " (" + describe_dims(formula, bound.dims) + ")");
  }
  return {row, (hinge_target(bound) - bound_offset) / bound.exceeds_bytes};
}

// The least squares of the system with every bound's hinge target as a hard constraint (and
// x >= 0 when non-negative): the limit of the hinges as their weight grows. nullopt when the
// constraints cannot all hold.
std::optional<Eigen::VectorXd> constrained_least_squares(const CostFormula& formula,
                                                         const LinearSystem& system,
                                                         const std::vector<InfeasibleBound>& bounds,
                                                         bool non_negative) {
  const Eigen::Index k = system.scale.size();
  const Eigen::Index m = static_cast<Eigen::Index>(bounds.size()) + (non_negative ? k : 0);
  Eigen::MatrixXd g = Eigen::MatrixXd::Zero(m, k);
  Eigen::VectorXd h = Eigen::VectorXd::Zero(m);
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    const auto [row, t0] = bound_row(formula, system, bounds[b], b);
    const double norm = row.norm();  // unit rows: the solver's slack is then relative to each
    const double unit = norm > 0 ? norm : 1.0;
    g.row(static_cast<Eigen::Index>(b)) = row / unit;
    h(static_cast<Eigen::Index>(b)) = t0 / unit;
  }
  if (non_negative) g.bottomRows(k).setIdentity();
  return least_squares_with_inequalities(system.jacobian, -system.r0, g, h, 1e-9);
}

}  // namespace

Solution solve_linear(const CostFormula& formula, const std::vector<Measurement>& measurements,
                      const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                      double weight, const std::vector<double>* start, bool exact_is_enough) {
  const LinearSystem system = linear_system(formula, measurements, options);
  const Eigen::Index k = system.scale.size();
  const bool no_loss = options.robust_loss == RobustLoss::kNone;
  // Initial point: the exact least-squares solution (non-negative least squares under the
  // bounds). Ceres then only has to account for the robust loss. Starting from the
  // unconstrained solution clipped to the bounds would not do: there, the projected Gauss-
  // Newton step can be zero and Ceres stops at a point that is not the constrained minimum.
  Eigen::VectorXd x0 = options.non_negative ? non_negative_least_squares(system.jacobian, -system.r0)
                                            : system.jacobian.colPivHouseholderQr().solve(-system.r0);
  if (exact_is_enough && bounds.empty() && no_loss && x0.allFinite()) {
    // Nothing for Ceres to add: the (non-negative) least-squares solution is the optimum.
    Solution s;
    s.summary.termination_type = ceres::CONVERGENCE;
    s.coefficients = system.coefficients(x0, options.non_negative);
    return s;
  }
  if (start != nullptr) {
    for (Eigen::Index j = 0; j < k; ++j) {
      x0(j) = (*start)[static_cast<std::size_t>(j)] * system.scale(j) / system.y_max;
    }
  }
  if (!x0.allFinite()) x0 = Eigen::VectorXd::Ones(k);
  if (options.non_negative) x0 = x0.cwiseMax(0.0);
  std::vector<double> x(x0.data(), x0.data() + k);

  ceres::Problem problem;
  for (Eigen::Index i = 0; i < system.jacobian.rows(); ++i) {
    problem.AddResidualBlock(new LinearRelativeResidual(system.jacobian.row(i), system.r0(i)),
                             make_loss(options), x.data());
  }
  // Hinge of bound b: weight * max(0, t0 - row . x).
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    auto [row, t0] = bound_row(formula, system, bounds[b], b);
    problem.AddResidualBlock(new LinearHingeResidual(std::move(row), t0, weight), nullptr, x.data());
  }
  if (options.non_negative) {
    for (int j = 0; j < static_cast<int>(k); ++j) problem.SetParameterLowerBound(x.data(), j, 0.0);
  }
  Solution s;
  ceres::Solve(solver_options(options), &problem, &s.summary);
  s.coefficients = system.coefficients(Eigen::Map<const Eigen::VectorXd>(x.data(), k), options.non_negative);
  return s;
}

std::optional<std::vector<double>> solve_linear_constrained(const CostFormula& formula,
                                                            const std::vector<Measurement>& measurements,
                                                            const std::vector<InfeasibleBound>& bounds,
                                                            const FitOptions& options) {
  const LinearSystem system = linear_system(formula, measurements, options);
  const auto x = constrained_least_squares(formula, system, bounds, options.non_negative);
  if (!x) return std::nullopt;
  std::vector<double> coefficients = system.coefficients(*x, options.non_negative);
  // The constraints hold to rounding at the hinges' targets, a hair above exceeds_bytes.
  if (violated_bounds(formula, bounds, coefficients) > 0) return std::nullopt;
  return coefficients;
}

bool bounds_hold(const CostFormula& formula, const std::vector<InfeasibleBound>& bounds,
                 const std::vector<double>& coefficients) {
  return std::all_of(bounds.begin(), bounds.end(), [&](const InfeasibleBound& bound) {
    return formula.predict(coefficients, bound.dims) >= hinge_target(bound);
  });
}

Solution solve(const CostFormula& formula, const std::vector<Measurement>& measurements,
               const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
               const std::vector<double>* start) {
  double weight = options.infeasible_bound_weight;
  if (formula.is_linear() && options.robust_loss == RobustLoss::kNone && !bounds.empty()) {
    // The hinges' limit, exactly: Ceres's steps across the hinges' kinks can stall short of it.
    if (auto coefficients = solve_linear_constrained(formula, measurements, bounds, options)) {
      Solution s;
      s.coefficients = std::move(*coefficients);
      s.summary.termination_type = ceres::CONVERGENCE;
      s.summary.num_successful_steps = 0;  // no iterations (Ceres's default is -1)
      s.summary.num_unsuccessful_steps = 0;
      s.weight = weight;
      s.exact_report = "exact least squares with the " + std::to_string(bounds.size()) +
                       (bounds.size() == 1 ? " infeasible-probe bound" : " infeasible-probe bounds") +
                       " as constraints (Lawson and Hanson's LSI, no Ceres)";
      return s;
    }
  }
  Solution s = solve_at_weight(formula, measurements, bounds, options, weight, start);
  for (int round = 0; round < kBoundRounds && violated_bounds(formula, bounds, s.coefficients) > 0;
       ++round) {
    weight *= 10;
    Solution next =
        solve_at_weight(formula, measurements, bounds, options, weight, &s.coefficients);
    add_steps(next, s);
    s = std::move(next);
  }
  s.weight = weight;
  return s;
}

double objective(const CostFormula& formula, const std::vector<Measurement>& measurements,
                 const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                 const std::vector<double>& coefficients) {
  std::unique_ptr<ceres::LossFunction> loss(make_loss(options));
  double sum = 0;
  for (const Measurement& m : measurements) {
    const double r = (formula.predict(coefficients, m.dims) - m.bytes) / m.bytes;
    double rho[3] = {r * r, 1, 0};
    if (loss) loss->Evaluate(r * r, rho);
    sum += 0.5 * rho[0];
  }
  for (const InfeasibleBound& bound : bounds) {
    const double shortfall =
        std::max(0.0, (hinge_target(bound) - formula.predict(coefficients, bound.dims)) /
                          bound.exceeds_bytes);
    sum += 0.5 * std::pow(options.infeasible_bound_weight * shortfall, 2);
  }
  return std::isfinite(sum) ? sum : std::numeric_limits<double>::infinity();
}

}  // namespace xpm::detail
