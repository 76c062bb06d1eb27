// fit.cpp — least squares of a CostFormula's coefficients with Ceres (see fit.hpp).
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
// Other formulas: r_i(x) = (formula.predict(x .* s, dims_i) - y_i) / y_i, central numeric
// differences, s_k = |initial value of k| (1 when 0), same bounds and loss.
#include "xpm/planner/fit.hpp"

#include "number_format.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Dense>
#include <ceres/ceres.h>

#include "fit_points.hpp"
#include "fit_start.hpp"
#include "formula_ast.hpp"
#include "nnls.hpp"
#include "residual_structure.hpp"

namespace xpm {
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

using detail::comma_list;

using detail::and_list;

using detail::format_double;
using detail::percent;
using detail::short_double;

// "bs = 4, l = 64"
std::string describe_dims(const CostFormula& formula, const std::vector<double>& dims) {
  std::string out;
  for (std::size_t v = 0; v < dims.size(); ++v) {
    if (v > 0) out += ", ";
    out += formula.variable_names()[v] + " = " + short_double(dims[v]);
  }
  return out;
}

void validate_inputs(const CostFormula& formula, const std::vector<Measurement>& measurements,
                     const std::vector<InfeasibleBound>& bounds, const FitOptions& options) {
  const auto& coefs = formula.coefficient_names();
  const auto& vars = formula.variable_names();
  if (coefs.empty()) {
    throw std::invalid_argument("fit: formula '" + formula.text() +
                                "' has no coefficient to fit");
  }
  if (measurements.size() < coefs.size()) {
    throw std::invalid_argument("fit: " + std::to_string(measurements.size()) +
                                " measurements for " + std::to_string(coefs.size()) +
                                " coefficients (" + comma_list(coefs) + "); need at least " +
                                std::to_string(coefs.size()));
  }
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    const Measurement& m = measurements[i];
    if (m.dims.size() != vars.size()) {
      throw std::invalid_argument("fit: measurement " + std::to_string(i) + " has " +
                                  std::to_string(m.dims.size()) + " dims, expected " +
                                  std::to_string(vars.size()) + " (" + comma_list(vars) + ")");
    }
    for (std::size_t v = 0; v < vars.size(); ++v) {
      if (!std::isfinite(m.dims[v])) {
        throw std::invalid_argument("fit: measurement " + std::to_string(i) + " has " + vars[v] +
                                    " = " + format_double(m.dims[v]) + "; dims must be finite");
      }
    }
    if (!(std::isfinite(m.bytes) && m.bytes > 0)) {
      throw std::invalid_argument("fit: measurement " + std::to_string(i) + " has bytes = " +
                                  format_double(m.bytes) + "; bytes must be finite and > 0");
    }
  }
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    const InfeasibleBound& bound = bounds[b];
    if (bound.dims.size() != vars.size()) {
      throw std::invalid_argument("fit: infeasible bound " + std::to_string(b) + " has " +
                                  std::to_string(bound.dims.size()) + " dims, expected " +
                                  std::to_string(vars.size()) + " (" + comma_list(vars) + ")");
    }
    for (std::size_t v = 0; v < vars.size(); ++v) {
      if (!std::isfinite(bound.dims[v])) {
        throw std::invalid_argument("fit: infeasible bound " + std::to_string(b) + " has " +
                                    vars[v] + " = " + format_double(bound.dims[v]) +
                                    "; dims must be finite");
      }
    }
    if (!(std::isfinite(bound.exceeds_bytes) && bound.exceeds_bytes > 0)) {
      throw std::invalid_argument("fit: infeasible bound " + std::to_string(b) +
                                  " has exceeds_bytes = " + format_double(bound.exceeds_bytes) +
                                  "; it must be finite and > 0");
    }
  }
  if (!options.batch_size_variable.empty() &&
      std::find(vars.begin(), vars.end(), options.batch_size_variable) == vars.end()) {
    throw std::invalid_argument("fit: FitOptions::batch_size_variable '" +
                                options.batch_size_variable +
                                "' is not a variable of formula '" + formula.canonical() +
                                "' (variables: " + comma_list(vars) + ")");
  }
  for (const auto& [name, value] : options.initial_values) {
    if (std::find(coefs.begin(), coefs.end(), name) == coefs.end()) {
      throw std::invalid_argument("fit: FitOptions::initial_values has '" + name +
                                  "', which is not a coefficient of formula '" +
                                  formula.canonical() + "' (coefficients: " + comma_list(coefs) + ")");
    }
    if (options.non_negative && value < 0) {
      throw std::invalid_argument("fit: FitOptions::initial_values['" + name + "'] = " +
                                  format_double(value) +
                                  " is negative but non_negative is set");
    }
  }
}

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

// A coefficient whose (scaled) column lies in the span of earlier ones, or is zero.
struct Dependence {
  std::size_t dependent;              // column index
  std::vector<std::size_t> partners;  // earlier columns it combines (empty: zero column)
};

// Walks the columns of `jacobian` [points, coefficients] in declared order and returns the
// first one whose unit column is within `tolerance` of the span of the independent columns
// before it (a pivoted, sequential QR rank test).
std::optional<Dependence> find_dependence(const Eigen::MatrixXd& jacobian, double tolerance) {
  const Eigen::Index k = jacobian.cols();
  std::vector<std::size_t> independent;
  for (Eigen::Index j = 0; j < k; ++j) {
    const double norm = jacobian.col(j).norm();
    if (!(norm > 0)) return Dependence{static_cast<std::size_t>(j), {}};
    const Eigen::VectorXd column = jacobian.col(j) / norm;
    if (!independent.empty()) {
      Eigen::MatrixXd basis(jacobian.rows(), static_cast<Eigen::Index>(independent.size()));
      for (std::size_t c = 0; c < independent.size(); ++c) {
        const Eigen::Index col = static_cast<Eigen::Index>(independent[c]);
        basis.col(static_cast<Eigen::Index>(c)) = jacobian.col(col) / jacobian.col(col).norm();
      }
      const Eigen::VectorXd weights = basis.colPivHouseholderQr().solve(column);
      const double distance = (basis * weights - column).norm();
      if (distance <= tolerance) {
        Dependence d{static_cast<std::size_t>(j), {}};
        const double largest = weights.cwiseAbs().maxCoeff();
        for (std::size_t c = 0; c < independent.size(); ++c) {
          if (std::abs(weights(static_cast<Eigen::Index>(c))) > 1e-6 * largest) {
            d.partners.push_back(independent[c]);
          }
        }
        return d;
      }
    }
    independent.push_back(static_cast<std::size_t>(j));
  }
  return std::nullopt;
}

// Variables that take one value at every measurement, among `relevant` (variable indices):
// "every probe has l = 64" or "".
std::string constant_dims_hint(const CostFormula& formula,
                               const std::vector<Measurement>& measurements,
                               const std::vector<bool>& relevant) {
  std::vector<std::string> parts;
  for (std::size_t v = 0; v < formula.variable_names().size(); ++v) {
    if (!relevant[v]) continue;
    const double first = measurements.front().dims[v];
    bool constant = true;
    for (const Measurement& m : measurements) constant = constant && m.dims[v] == first;
    if (constant) parts.push_back(formula.variable_names()[v] + " = " + short_double(first));
  }
  if (parts.empty()) return "";
  return "every probe has " + and_list(parts);
}

// Message and names for a dependence; `where` is "by the probe shapes" or "at the fitted point".
std::pair<std::string, std::vector<std::string>> describe_dependence(
    const CostFormula& formula, const std::vector<Measurement>& measurements, const Dependence& d,
    const std::string& where) {
  const auto& coefs = formula.coefficient_names();
  std::vector<std::size_t> involved = d.partners;
  involved.push_back(d.dependent);
  std::sort(involved.begin(), involved.end());
  std::vector<std::string> names;
  for (std::size_t c : involved) names.push_back(coefs[c]);
  const std::string& dependent = coefs[d.dependent];

  // Variables in the terms of the involved coefficients (linear formulas); all otherwise.
  std::vector<bool> relevant(formula.variable_names().size(), true);
  if (formula.is_linear()) {
    std::fill(relevant.begin(), relevant.end(), false);
    for (const Monomial& m : formula.monomials()) {
      if (m.coefficient < 0 ||
          std::find(involved.begin(), involved.end(), static_cast<std::size_t>(m.coefficient)) ==
              involved.end()) {
        continue;
      }
      for (std::size_t v = 0; v < m.powers.size(); ++v) relevant[v] = relevant[v] || m.powers[v];
    }
  }
  const std::string hint = constant_dims_hint(formula, measurements, relevant);

  std::string message;
  if (d.partners.empty()) {
    if (formula.is_linear()) {
      message = "coefficient '" + dependent + "' multiplies a term that is zero at every " +
                "measurement; the probe points cannot identify it" +
                (hint.empty() ? "" : " (" + hint + ")");
    } else {
      message = "coefficient '" + dependent + "' has no effect on the prediction at any probe " +
                where + " (e.g. a max() argument that never wins); the probe points cannot " +
                "identify it";
    }
    return {message, names};
  }
  std::vector<std::string> partner_names;
  for (std::size_t c : d.partners) partner_names.push_back("'" + coefs[c] + "'");
  message = "coefficients " + and_list(names) + " cannot be separated " + where + ": " +
            (hint.empty() ? "their terms are linearly dependent at the probe shapes" : hint) +
            ", so the term of '" + dependent + "' is a combination of the term" +
            (partner_names.size() > 1 ? "s of " : " of ") + and_list(partner_names) +
            " at every probe; add probes whose dims change these terms differently, or drop '" +
            dependent + "'";
  return {message, names};
}

struct Solution {
  std::vector<double> coefficients;
  ceres::Solver::Summary summary;
  double weight = 0;  // hinge weight of the last solve
};

// Linear least squares with the bounds' hinges of weight `weight`, from `start` (coefficients)
// or, when null, from the exact (non-negative) least-squares solution of the measurements;
// throws IdentifiabilityError before solving when the columns of the scaled design matrix are
// dependent (the measurements alone must identify every coefficient).
// `exact_is_enough`: without bounds or a robust loss, return the exact least-squares solution
// without running Ceres (held-out refits: only their coefficients are read).
Solution solve_linear(const CostFormula& formula, const std::vector<Measurement>& measurements,
                      const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                      double weight, const std::vector<double>* start, bool exact_is_enough = false) {
  const auto& coefs = formula.coefficient_names();
  const Eigen::Index n = static_cast<Eigen::Index>(measurements.size());
  const Eigen::Index k = static_cast<Eigen::Index>(coefs.size());

  // Basis matrix B [n, k], offsets o [n].
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

  // Column scales s_k = max_i |B_ik|.
  Eigen::VectorXd scale(k);
  for (Eigen::Index j = 0; j < k; ++j) {
    if (!basis.col(j).allFinite()) {
      throw std::invalid_argument("fit: the term of coefficient '" +
                                  coefs[static_cast<std::size_t>(j)] +
                                  "' is not finite at some measurement (overflow?)");
    }
    scale(j) = basis.col(j).cwiseAbs().maxCoeff();
  }

  // Relative, scaled linear system: J x ~= -r0 with J_ik = B_ik * y_max / (s_k * y_i), so J and
  // x are O(1). (With x in bytes, Ceres's projected-gradient test x - P(x - g) rounds to 0
  // under the bounds and it stops at once.)
  Eigen::VectorXd y(n);
  for (Eigen::Index i = 0; i < n; ++i) y(i) = measurements[static_cast<std::size_t>(i)].bytes;
  const double y_max = y.maxCoeff();
  Eigen::MatrixXd jacobian = (y_max * y.cwiseInverse()).asDiagonal() * basis;
  for (Eigen::Index j = 0; j < k; ++j) {
    if (scale(j) > 0) jacobian.col(j) /= scale(j);
  }
  const Eigen::VectorXd r0 = (offset - y).cwiseQuotient(y);

  if (const auto d = find_dependence(jacobian, options.identifiability_tolerance)) {
    auto [message, names] = describe_dependence(formula, measurements, *d, "by the probe shapes");
    throw IdentifiabilityError("fit: " + message, std::move(names), coefs[d->dependent]);
  }

  // Initial point: the exact least-squares solution (non-negative least squares under the
  // bounds). Ceres then only has to account for the robust loss. Starting from the
  // unconstrained solution clipped to the bounds would not do: there, the projected Gauss-
  // Newton step can be zero and Ceres stops at a point that is not the constrained minimum.
  Eigen::VectorXd x0 = options.non_negative ? detail::non_negative_least_squares(jacobian, -r0)
                                            : jacobian.colPivHouseholderQr().solve(-r0);
  if (exact_is_enough && bounds.empty() && options.robust_loss == RobustLoss::kNone && x0.allFinite()) {
    // Nothing for Ceres to add: the (non-negative) least-squares solution is the optimum.
    Solution s;
    s.summary.termination_type = ceres::CONVERGENCE;
    for (Eigen::Index j = 0; j < k; ++j) {
      s.coefficients.push_back(options.non_negative ? std::max(x0(j) * y_max / scale(j), 0.0)
                                                    : x0(j) * y_max / scale(j));
    }
    return s;
  }
  if (start != nullptr) {
    for (Eigen::Index j = 0; j < k; ++j) {
      x0(j) = (*start)[static_cast<std::size_t>(j)] * scale(j) / y_max;
    }
  }
  if (!x0.allFinite()) x0 = Eigen::VectorXd::Ones(k);
  if (options.non_negative) x0 = x0.cwiseMax(0.0);
  std::vector<double> x(x0.data(), x0.data() + k);

  ceres::Problem problem;
  for (Eigen::Index i = 0; i < n; ++i) {
    problem.AddResidualBlock(new LinearRelativeResidual(jacobian.row(i), r0(i)),
                             make_loss(options), x.data());
  }
  // Hinge of bound b: weight * max(0, t0 - row . x), the prediction at its dims being
  // exceeds * (1 - t0 + row . x) with t0 = (target - offset) / exceeds.
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    const InfeasibleBound& bound = bounds[b];
    const std::vector<double> term = formula.basis(bound.dims);
    const double bound_offset = formula.offset(bound.dims);
    Eigen::RowVectorXd row(k);
    for (Eigen::Index j = 0; j < k; ++j) {
      row(j) = term[static_cast<std::size_t>(j)] * y_max / scale(j) / bound.exceeds_bytes;
    }
    if (!row.allFinite() || !std::isfinite(bound_offset)) {
      throw std::invalid_argument("fit: the formula is not finite at infeasible bound " +
                                  std::to_string(b) + " (" + describe_dims(formula, bound.dims) +
                                  ")");
    }
    const double t0 = (hinge_target(bound) - bound_offset) / bound.exceeds_bytes;
    problem.AddResidualBlock(new LinearHingeResidual(row, t0, weight), nullptr, x.data());
  }
  if (options.non_negative) {
    for (int j = 0; j < static_cast<int>(k); ++j) problem.SetParameterLowerBound(x.data(), j, 0.0);
  }
  Solution s;
  ceres::Solve(solver_options(options), &problem, &s.summary);
  s.coefficients.resize(static_cast<std::size_t>(k));
  for (Eigen::Index j = 0; j < k; ++j) {
    double c = x[static_cast<std::size_t>(j)] * y_max / scale(j);
    if (options.non_negative) c = std::max(c, 0.0);  // the bound holds exactly, even for -0
    s.coefficients[static_cast<std::size_t>(j)] = c;
  }
  return s;
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
  for (const Measurement& m : measurements) {
    using Cost = ceres::DynamicNumericDiffCostFunction<PredictRelativeResidual, ceres::CENTRAL>;
    auto* cost = new Cost(new PredictRelativeResidual(formula, m.dims, m.bytes, scales));
    cost->AddParameterBlock(static_cast<int>(k));
    cost->SetNumResiduals(1);
    problem.AddResidualBlock(cost, make_loss(options), x.data());
  }
  for (const InfeasibleBound& bound : bounds) {
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

// Solves; while a bound is violated at the solution, solves again from it with 10x the hinge
// weight (at most kBoundRounds more times).
Solution solve(const CostFormula& formula, const std::vector<Measurement>& measurements,
               const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
               const std::vector<double>* start) {
  double weight = options.infeasible_bound_weight;
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

// The objective at `coefficients` with the hinge weight of the options: 1/2 sum rho(r_i^2) over
// the measurements plus 1/2 sum hinge_b^2 over the bounds. Compares solutions from two starts.
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

// Central-difference Jacobian of the relative residuals [points, coefficients] at
// `coefficients`, each column scaled by max(|coefficient|, 1) so columns are comparable.
Eigen::MatrixXd numeric_jacobian(const CostFormula& formula,
                                 const std::vector<Measurement>& measurements,
                                 const std::vector<double>& coefficients) {
  const Eigen::Index n = static_cast<Eigen::Index>(measurements.size());
  const Eigen::Index k = static_cast<Eigen::Index>(coefficients.size());
  Eigen::MatrixXd jacobian(n, k);
  for (Eigen::Index j = 0; j < k; ++j) {
    const std::size_t jj = static_cast<std::size_t>(j);
    const double scale = std::max(std::abs(coefficients[jj]), 1.0);
    const double h = 1e-6 * scale;
    std::vector<double> plus = coefficients;
    std::vector<double> minus = coefficients;
    plus[jj] += h;
    minus[jj] -= h;
    for (Eigen::Index i = 0; i < n; ++i) {
      const Measurement& m = measurements[static_cast<std::size_t>(i)];
      const double d =
          (formula.predict(plus, m.dims) - formula.predict(minus, m.dims)) / (2 * h) / m.bytes;
      jacobian(i, j) = std::isfinite(d) ? d * scale : 0.0;
    }
  }
  return jacobian;
}

std::string termination(const ceres::Solver::Summary& summary) {
  return std::string(ceres::TerminationTypeToString(summary.termination_type)) +
         (summary.message.empty() ? "" : ": " + summary.message);
}

}  // namespace

IdentifiabilityError::IdentifiabilityError(const std::string& message,
                                           std::vector<std::string> coefficients,
                                           std::string dependent)
    : std::invalid_argument(message),
      coefficients_(std::move(coefficients)),
      dependent_(std::move(dependent)) {}

namespace detail {

void validate_fit_inputs(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options) {
  options.validate();
  validate_inputs(formula, measurements, bounds, options);
}


// True when setting coefficient `k` to 0 changes the prediction at no measurement.
bool zeroing_changes_nothing(const CostFormula& formula, const std::vector<Measurement>& measurements,
                             const std::vector<double>& coefficients, std::size_t k) {
  std::vector<double> zeroed = coefficients;
  zeroed[k] = 0.0;
  for (const Measurement& m : measurements) {
    const double before = formula.predict(coefficients, m.dims);
    if (std::abs(formula.predict(zeroed, m.dims) - before) > 1e-9 * std::abs(before)) return false;
  }
  return true;
}

// One argument of a top-level max(): its coefficients and the variable powers of its terms.
struct MaxArgument {
  std::set<int> coefficients;
  std::set<std::vector<int>> shapes;
};

// The arguments of each max() among the formula's top-level terms.
std::vector<std::vector<MaxArgument>> max_arguments(const CostFormula& formula) {
  std::vector<std::vector<MaxArgument>> out;
  for (const formula_ast::Term& term : formula.expression().terms) {
    for (const auto& [factor, power] : term.factors) {
      if (factor->kind != formula_ast::Factor::Kind::max) continue;
      std::vector<MaxArgument> arguments;
      for (const formula_ast::Sum& operand : factor->operands) {
        MaxArgument argument;
        for (const formula_ast::Term& t : operand) {
          for (std::size_t c = 0; c < t.coefficient_powers.size(); ++c) {
            if (t.coefficient_powers[c] != 0) argument.coefficients.insert(static_cast<int>(c));
          }
          argument.shapes.insert(t.variable_powers);
        }
        arguments.push_back(std::move(argument));
      }
      out.push_back(std::move(arguments));
    }
  }
  return out;
}

// True when every coefficient in `zeroed` belongs to a max() argument all of whose coefficients
// are zeroed and which has a sibling argument of the same shape (the same monomials in the
// variables) with a coefficient left: a duplicate piece that never wins, which its sibling
// covers. A floor or any piece of its own shape that no probe reached is not covered.
bool covered_by_siblings(const CostFormula& formula, const std::set<int>& zeroed) {
  std::set<int> covered;
  for (const std::vector<MaxArgument>& arguments : max_arguments(formula)) {
    for (const MaxArgument& argument : arguments) {
      const bool all_zeroed = std::includes(zeroed.begin(), zeroed.end(), argument.coefficients.begin(),
                                            argument.coefficients.end());
      if (!all_zeroed || argument.coefficients.empty()) continue;
      for (const MaxArgument& sibling : arguments) {
        const bool live = std::any_of(sibling.coefficients.begin(), sibling.coefficients.end(),
                                      [&](int c) { return zeroed.count(c) == 0; });
        if (&sibling != &argument && live && sibling.shapes == argument.shapes) {
          covered.insert(argument.coefficients.begin(), argument.coefficients.end());
          break;
        }
      }
    }
  }
  return std::includes(covered.begin(), covered.end(), zeroed.begin(), zeroed.end());
}

// Non-linear fits, after solving: every coefficient must change the prediction at some
// measurement at the fitted point, independently of the others. A max() argument that adds
// nothing at any measurement (it never wins, or ties a sibling of the same shape everywhere),
// whose zeroing changes no prediction there and which a sibling of the same shape covers (e.g.
// the second of two quadratic pieces when one explains every probe), is set to 0, coefficient by
// coefficient, and named in the summary; any other dependence makes the fit unusable.
void check_identified_at_fit(const CostFormula& formula, const std::vector<Measurement>& measurements,
                             const FitOptions& options, FitResult& result) {
  FitSummary& s = result.summary;
  const double tolerance = std::max(options.identifiability_tolerance, 1e-6);
  const auto& names = formula.coefficient_names();
  const std::vector<double> fitted = result.coefficients;
  std::set<int> zeroed;
  std::vector<std::size_t> active(names.size());
  for (std::size_t k = 0; k < active.size(); ++k) active[k] = k;
  std::string first_reason;
  for (;;) {
    const Eigen::MatrixXd full = numeric_jacobian(formula, measurements, result.coefficients);
    Eigen::MatrixXd jacobian(full.rows(), static_cast<Eigen::Index>(active.size()));
    for (std::size_t c = 0; c < active.size(); ++c) {
      jacobian.col(static_cast<Eigen::Index>(c)) = full.col(static_cast<Eigen::Index>(active[c]));
    }
    auto d = find_dependence(jacobian, tolerance);
    if (!d) break;
    d->dependent = active[d->dependent];
    for (std::size_t& partner : d->partners) partner = active[partner];
    const std::string reason = describe_dependence(formula, measurements, *d, "at the fitted point").first;
    if (first_reason.empty()) first_reason = reason;
    if (!zeroing_changes_nothing(formula, measurements, result.coefficients, d->dependent)) {
      s.reasons.push_back(zeroed.empty() ? reason : first_reason);
      result.coefficients = fitted;
      return;
    }
    result.coefficients[d->dependent] = 0.0;
    zeroed.insert(static_cast<int>(d->dependent));
    active.erase(std::find(active.begin(), active.end(), d->dependent));
  }
  if (zeroed.empty()) return;
  if (!covered_by_siblings(formula, zeroed)) {
    s.reasons.push_back(first_reason);
    result.coefficients = fitted;
    return;
  }
  for (int c : zeroed) s.dormant_coefficients.push_back(names[static_cast<std::size_t>(c)]);
  s.dormant_note = "coefficient(s) " + and_list(s.dormant_coefficients) +
                   " have no effect at any probe (a max() argument that never wins there, covered by "
                   "one of the same shape): set to 0";
}

namespace {

// The refits of `rest` (the points without one shape): from the full fit's solution, and, for a
// non-linear formula with the automatic start, also from the automatic start of `rest` (it may
// find another assignment of the max() pieces). Both when they explain `rest` equally well (the
// data then cannot choose between them), else the better one.
std::vector<std::vector<double>> held_out_refits(const CostFormula& formula,
                                                 const std::vector<Measurement>& rest,
                                                 const std::vector<InfeasibleBound>& bounds,
                                                 const FitOptions& options, const FitResult& full) {
  if (formula.is_linear() && bounds.empty() && options.robust_loss == RobustLoss::kNone) {
    return {solve_linear(formula, rest, bounds, options, 0.0, nullptr, true).coefficients};
  }
  const Solution from_full = solve(formula, rest, bounds, options, &full.coefficients);
  if (formula.is_linear() || !options.automatic_start || !options.initial_values.empty()) {
    return {from_full.coefficients};
  }
  const std::vector<double> ones(formula.coefficient_names().size(), 1.0);
  const AutomaticStart start = automatic_start(formula, rest, options, ones);
  const Solution from_start = solve(formula, rest, bounds, options, &start.coefficients);
  const double a = objective(formula, rest, bounds, options, from_full.coefficients);
  const double b = objective(formula, rest, bounds, options, from_start.coefficients);
  if (std::abs(a - b) <= 1e-9 * std::max(a, b) + 1e-16) {
    return {from_full.coefficients, from_start.coefficients};
  }
  return {a < b ? from_full.coefficients : from_start.coefficients};
}

// Whether the dims of `group` lie within the other points' range in every variable.
bool surrounded(const std::vector<Measurement>& measurements, const std::vector<std::size_t>& group) {
  const std::vector<double>& dims = measurements[group.front()].dims;
  for (std::size_t v = 0; v < dims.size(); ++v) {
    bool below = false, above = false;
    for (std::size_t j = 0; j < measurements.size(); ++j) {
      if (std::find(group.begin(), group.end(), j) != group.end()) continue;
      below = below || measurements[j].dims[v] <= dims[v];
      above = above || measurements[j].dims[v] >= dims[v];
    }
    if (!below || !above) return false;
  }
  return true;
}

// What the prediction at a left-out shape rests on in a refit of the other points: the
// coefficients that act on it there, the other shapes on which any of them acts, and whether
// those shapes determine it (its gradient in the coefficients lies in the span of theirs).
struct HeldOutSupport {
  bool determined = true;
  std::vector<std::string> acting;  // coefficients with an effect on the left-out prediction
  std::size_t shapes = 0;           // distinct other shapes on which one of them acts
};

HeldOutSupport held_out_support(const CostFormula& formula, const std::vector<Measurement>& rest,
                                const Measurement& left_out, const std::vector<double>& coefficients) {
  Eigen::MatrixXd others = numeric_jacobian(formula, rest, coefficients);
  Eigen::RowVectorXd gradient = numeric_jacobian(formula, {left_out}, coefficients).row(0);
  for (Eigen::Index j = 0; j < gradient.size(); ++j) {  // the same scale for both, per coefficient
    const double norm = std::sqrt(others.col(j).squaredNorm() + gradient(j) * gradient(j));
    if (norm > 0) others.col(j) /= norm, gradient(j) /= norm;
  }
  HeldOutSupport support;
  const double length = gradient.norm();
  if (!(length > 0)) return support;  // nothing fitted acts on it: no coefficient to determine
  std::vector<Eigen::Index> acting;
  for (Eigen::Index j = 0; j < gradient.size(); ++j) {
    if (std::abs(gradient(j)) > 1e-9 * length) {
      acting.push_back(j);
      support.acting.push_back(formula.coefficient_names()[static_cast<std::size_t>(j)]);
    }
  }
  std::vector<const std::vector<double>*> shapes;
  for (Eigen::Index i = 0; i < others.rows(); ++i) {
    const auto& dims = rest[static_cast<std::size_t>(i)].dims;
    const bool touched = std::any_of(acting.begin(), acting.end(), [&](Eigen::Index j) {
      return std::abs(others(i, j)) > 1e-9;
    });
    const bool seen = std::any_of(shapes.begin(), shapes.end(), [&](const auto* d) { return *d == dims; });
    if (touched && !seen) shapes.push_back(&dims);
  }
  support.shapes = shapes.size();
  Eigen::JacobiSVD<Eigen::MatrixXd> svd(others, Eigen::ComputeThinV);
  svd.setThreshold(1e-8);
  const Eigen::MatrixXd span = svd.matrixV().leftCols(svd.rank());
  const Eigen::VectorXd g = gradient.transpose();
  support.determined = (g - span * (span.transpose() * g)).norm() <= 1e-6 * length;
  return support;
}

// One sentence on a shape the others do not determine.
std::string undetermined_reason(const CostFormula& formula, const std::vector<Measurement>& measurements,
                                std::size_t point, const HeldOutSupport& support) {
  const std::string what =
      "without point " + std::to_string(point) + " (" + describe_dims(formula, measurements[point].dims) + ") ";
  if (support.shapes < support.acting.size()) {
    return what + "the fit rests on " + std::to_string(support.shapes) + " other shape" +
           (support.shapes == 1 ? "" : "s") + " where " + and_list(support.acting) + " act and needs " +
           std::to_string(support.acting.size());
  }
  return what + "the " + std::to_string(support.shapes) + " other shapes where " + and_list(support.acting) +
         " act do not determine the prediction there";
}

// The held-out error of one left-out shape: the worst of its refits' errors at each of its
// points, or NaN for every point when some refit leaves its prediction undetermined (`why`).
std::vector<double> held_out_errors(const CostFormula& formula, const std::vector<Measurement>& measurements,
                                    const std::vector<std::size_t>& group, const std::vector<Measurement>& rest,
                                    const std::vector<std::vector<double>>& refits, std::string& why) {
  const Measurement& first = measurements[group.front()];
  for (const std::vector<double>& refit : refits) {
    const HeldOutSupport support = held_out_support(formula, rest, first, refit);
    if (!support.determined) {
      why = undetermined_reason(formula, measurements, group.front(), support);
      return std::vector<double>(group.size(), std::nan(""));
    }
  }
  std::vector<double> errors;
  for (std::size_t i : group) {
    const Measurement& m = measurements[i];
    double worst = 0;
    for (const std::vector<double>& refit : refits) {  // equally good refits: the worst
      const double rel = (formula.predict(refit, m.dims) - m.bytes) / m.bytes;
      if (&refit == &refits.front() || !(std::abs(rel) <= std::abs(worst))) worst = rel;
    }
    errors.push_back(worst);
  }
  return errors;
}

// The largest |error| over `points` that have a figure (NaN when none has).
double max_abs_with_figure(const std::vector<double>& errors, const std::vector<std::size_t>& points) {
  double out = std::nan("");
  for (std::size_t i : points) {
    const double e = std::abs(errors[i]);
    if (!std::isnan(e) && (std::isnan(out) || e > out)) out = e;
  }
  return out;
}

// The points of each distinct dims, in order of first appearance.
std::vector<std::vector<std::size_t>> shape_groups(const std::vector<Measurement>& measurements) {
  std::vector<std::vector<std::size_t>> shapes;
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    auto same = std::find_if(shapes.begin(), shapes.end(), [&](const auto& group) {
      return measurements[group.front()].dims == measurements[i].dims;
    });
    if (same == shapes.end()) shapes.push_back({i}); else same->push_back(i);
  }
  return shapes;
}

// Leave-one-shape-out: every group of points with the same dims is left out in turn, the others
// refitted (non-linear fits start from the full solution), and the group predicted. A shape
// whose prediction the others do not determine gets no figure (NaN; held_out_note says what
// it rests on); one outside the others' range is extrapolation, reported apart.
void leave_one_shape_out(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                         FitResult& result) {
  FitSummary& s = result.summary;
  const std::size_t n = measurements.size();
  const std::size_t k = formula.coefficient_names().size();
  if (!options.leave_one_out) {
    s.leave_one_out_note = "not computed (FitOptions::leave_one_out is off)";
    return;
  }
  const std::vector<std::vector<std::size_t>> shapes = shape_groups(measurements);
  std::size_t largest = 0;
  for (const auto& group : shapes) largest = std::max(largest, group.size());
  if (n - largest < k) {
    s.leave_one_out_note = "not computed: " + std::to_string(n) + " points for " +
                           std::to_string(k) + " coefficients (" + std::to_string(shapes.size()) +
                           " distinct dims); it needs as many points as coefficients without "
                           "any one shape";
    return;
  }
  std::vector<double> loo(n, std::nan(""));
  std::vector<std::size_t> surrounded_points, edge_points;
  std::vector<std::string> undetermined;
  for (const auto& group : shapes) {
    std::vector<Measurement> rest;
    for (std::size_t j = 0; j < n; ++j) {
      if (std::find(group.begin(), group.end(), j) == group.end()) rest.push_back(measurements[j]);
    }
    std::string why;
    std::vector<double> errors(group.size(), std::nan(""));
    try {
      const std::vector<std::vector<double>> found = held_out_refits(formula, rest, bounds, options, result);
      s.leave_one_out_coefficients.insert(s.leave_one_out_coefficients.end(), found.begin(), found.end());
      errors = held_out_errors(formula, measurements, group, rest, found, why);
    } catch (const IdentifiabilityError& e) {
      why = "without point " + std::to_string(group.front()) + " (" +
            describe_dims(formula, measurements[group.front()].dims) + ") the coefficients " +
            and_list(e.coefficients()) + " cannot be separated";
    }
    for (std::size_t g = 0; g < group.size(); ++g) loo[group[g]] = errors[g];
    if (!why.empty()) {
      undetermined.push_back(why);
      s.held_out_undetermined.insert(s.held_out_undetermined.end(), group.begin(), group.end());
      continue;
    }
    auto& into = surrounded(measurements, group) ? surrounded_points : edge_points;
    into.insert(into.end(), group.begin(), group.end());
  }
  std::sort(s.held_out_undetermined.begin(), s.held_out_undetermined.end());
  std::sort(edge_points.begin(), edge_points.end());
  s.leave_one_out_rel_errors = std::move(loo);
  std::vector<std::size_t> all(n);
  for (std::size_t i = 0; i < n; ++i) all[i] = i;
  s.leave_one_out_max_rel_error = max_abs_with_figure(s.leave_one_out_rel_errors, all);
  s.surrounded_held_out_max_rel_error = max_abs_with_figure(s.leave_one_out_rel_errors, surrounded_points);
  s.extrapolated_held_out_max_rel_error = max_abs_with_figure(s.leave_one_out_rel_errors, edge_points);
  s.held_out_extrapolated = std::move(edge_points);
  s.surrounded_held_out_count = surrounded_points.size();
  if (!undetermined.empty()) {
    s.held_out_note = "no held-out figure at " + std::to_string(undetermined.size()) + " of " +
                      std::to_string(shapes.size()) + " shapes: " + undetermined.front();
    if (undetermined.size() > 1) s.held_out_note += " (and alike at the others)";
  }
}

bool held_out_above_limit(const FitSummary& s, const FitOptions& options) {
  return !std::isnan(s.surrounded_held_out_max_rel_error) &&
         !(s.surrounded_held_out_max_rel_error <= options.usable_max_rel_error);
}

// The point whose held-out error is the surrounded max.
std::size_t worst_held_out_point(const FitSummary& s) {
  for (std::size_t i = 0; i < s.leave_one_out_rel_errors.size(); ++i) {
    if (std::abs(s.leave_one_out_rel_errors[i]) == s.surrounded_held_out_max_rel_error) return i;
  }
  return 0;
}

}  // namespace

namespace {

// The solution from the start the options ask for: none (linear), the given one, or, by
// default for a non-linear formula, the better of the automatic start and 1 for every
// coefficient (by the objective); `start_note` says which.
Solution solve_from_start(const CostFormula& formula, const std::vector<Measurement>& measurements,
                          const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                          std::string& start_note) {
  const auto& coefs = formula.coefficient_names();
  std::vector<double> start(coefs.size(), 1.0);
  for (std::size_t j = 0; j < coefs.size(); ++j) {
    const auto it = options.initial_values.find(coefs[j]);
    if (it != options.initial_values.end()) start[j] = it->second;
  }
  if (formula.is_linear()) return solve(formula, measurements, bounds, options, nullptr);
  if (!options.initial_values.empty() || !options.automatic_start) {
    start_note = options.initial_values.empty() ? "1 for every coefficient"
                                                : "FitOptions::initial_values (1 where not given)";
    return solve(formula, measurements, bounds, options, &start);
  }
  const detail::AutomaticStart automatic = detail::automatic_start(formula, measurements, options, start);
  Solution from_automatic = solve(formula, measurements, bounds, options, &automatic.coefficients);
  Solution from_plain = solve(formula, measurements, bounds, options, &start);
  if (objective(formula, measurements, bounds, options, from_plain.coefficients) <
      objective(formula, measurements, bounds, options, from_automatic.coefficients)) {
    start_note = "1 for every coefficient (it reached a lower cost than the " + automatic.description + " start)";
    return from_plain;
  }
  start_note = automatic.description;
  return from_automatic;
}

// The solver's figures and the relative error at every point; returns the worst point and
// the first whose prediction is not finite (if any).
std::pair<std::size_t, std::optional<std::size_t>> fill_statistics(
    const CostFormula& formula, const std::vector<Measurement>& measurements,
    const std::vector<InfeasibleBound>& bounds, const FitOptions& options, const Solution& solution,
    FitResult& result) {
  FitSummary& s = result.summary;
  s.linear = formula.is_linear();
  s.coefficient_count = formula.coefficient_names().size();
  s.robust_loss = options.robust_loss;
  s.converged = solution.summary.termination_type == ceres::CONVERGENCE ||
                solution.summary.termination_type == ceres::USER_SUCCESS;
  s.iterations = solution.summary.num_successful_steps + solution.summary.num_unsuccessful_steps;
  s.infeasible_bound_weight = bounds.empty() ? 0.0 : solution.weight;
  s.solver_report = solution.summary.BriefReport();
  if (!solution.summary.message.empty()) s.solver_report += " (" + solution.summary.message + ")";
  s.rel_errors.reserve(measurements.size());
  double sum_abs = 0;
  std::size_t worst = 0;
  std::optional<std::size_t> not_finite;
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    const Measurement& m = measurements[i];
    const double rel = (formula.predict(result.coefficients, m.dims) - m.bytes) / m.bytes;
    if (!std::isfinite(rel) && !not_finite) not_finite = i;
    s.rel_errors.push_back(rel);
    if (std::abs(rel) > s.max_rel_error || std::isnan(rel)) {
      s.max_rel_error = std::isnan(rel) ? rel : std::abs(rel);
      worst = i;
    }
    sum_abs += std::abs(rel);
  }
  s.mean_rel_error = sum_abs / static_cast<double>(measurements.size());
  s.residual_structure = detail::residual_structure(formula, measurements, s.rel_errors);
  return {worst, not_finite};
}

// Not converged, a prediction that is not finite, too large an error at the points or at
// held-out shapes.
void add_accuracy_reasons(const CostFormula& formula, const std::vector<Measurement>& measurements,
                          const FitOptions& options, const Solution& solution, std::size_t worst,
                          std::optional<std::size_t> not_finite, FitSummary& s) {
  if (!s.converged) {
    s.reasons.push_back("the solver did not converge (" + termination(solution.summary) + ")");
  }
  if (not_finite) {
    s.reasons.push_back("the prediction is not finite at point " + std::to_string(*not_finite) +
                        " (" + describe_dims(formula, measurements[*not_finite].dims) + ")");
  } else if (s.max_rel_error > options.usable_max_rel_error) {
    s.reasons.push_back("max relative error " + percent(s.max_rel_error) + " at point " +
                        std::to_string(worst) + " (" +
                        describe_dims(formula, measurements[worst].dims) +
                        ") is above the limit " + percent(options.usable_max_rel_error) +
                        " (FitOptions::usable_max_rel_error)");
  } else if (held_out_above_limit(s, options)) {
    const std::size_t at = worst_held_out_point(s);
    s.reasons.push_back("held-out (leave-one-shape-out) max relative error " +
                        percent(s.surrounded_held_out_max_rel_error) + " at point " + std::to_string(at) +
                        " (" + describe_dims(formula, measurements[at].dims) +
                        ") is above the limit " + percent(options.usable_max_rel_error) +
                        " (FitOptions::usable_max_rel_error): the fit does not predict shapes it "
                        "was not fitted to; probe more shapes or change the formula");
  }
}

// Every probe that ran out of memory must be predicted at or above the capacity it ran under.
void add_bound_reasons(const CostFormula& formula, const std::vector<InfeasibleBound>& bounds, FitResult& result) {
  FitSummary& s = result.summary;
  s.infeasible_bound_count = bounds.size();
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    const double predicted = formula.predict(result.coefficients, bounds[b].dims);
    const bool satisfied = predicted >= bounds[b].exceeds_bytes;
    s.infeasible_bound_predicted_bytes.push_back(predicted);
    s.infeasible_bound_satisfied.push_back(satisfied);
    if (!satisfied) {
      s.reasons.push_back("a probe ran out of memory at " + describe_dims(formula, bounds[b].dims) +
                          " (infeasible bound " + std::to_string(b) + ") under " +
                          short_double(bounds[b].exceeds_bytes) + " bytes, but the fit predicts " +
                          short_double(predicted) + " bytes there");
    }
  }
}

// The prediction must not decrease as the batch size grows (by one, or doubled) at any point.
void add_decreasing_reason(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options, FitResult& result) {
  if (options.batch_size_variable.empty()) return;
  const std::size_t b = formula.variable_index(options.batch_size_variable);
  std::size_t decreasing = 0;
  std::string first;
  for (const Measurement& m : measurements) {
    const double at = formula.predict(result.coefficients, m.dims);
    for (const double grown : {m.dims[b] + 1, 2 * m.dims[b]}) {
      if (!(grown > m.dims[b])) continue;
      std::vector<double> dims = m.dims;
      dims[b] = grown;
      const double after = formula.predict(result.coefficients, dims);
      if (after < at - 1e-9 * std::abs(at)) {
        if (decreasing == 0) {
          first = short_double(at) + " bytes at " + describe_dims(formula, m.dims) + " but " +
                  short_double(after) + " bytes at " + options.batch_size_variable + " = " +
                  short_double(grown);
        }
        ++decreasing;
        break;
      }
    }
  }
  if (decreasing > 0) {
    result.summary.reasons.push_back("the prediction decreases as " + options.batch_size_variable +
                                     " grows at " + std::to_string(decreasing) + " of " +
                                     std::to_string(measurements.size()) + " measured dims: " + first);
  }
}

}  // namespace

FitResult fit_points(const CostFormula& formula, const std::vector<Measurement>& measurements,
                     const std::vector<InfeasibleBound>& bounds, const FitOptions& options) {
  std::string start_note;
  const Solution solution = solve_from_start(formula, measurements, bounds, options, start_note);
  FitResult result;
  result.coefficients = solution.coefficients;
  result.summary.start = start_note;
  const auto [worst, not_finite] = fill_statistics(formula, measurements, bounds, options, solution, result);
  leave_one_shape_out(formula, measurements, bounds, options, result);
  add_accuracy_reasons(formula, measurements, options, solution, worst, not_finite, result.summary);
  add_bound_reasons(formula, bounds, result);
  if (!formula.is_linear()) check_identified_at_fit(formula, measurements, options, result);
  add_decreasing_reason(formula, measurements, options, result);
  result.summary.usable = result.summary.reasons.empty();
  return result;
}

}  // namespace detail
}  // namespace xpm
