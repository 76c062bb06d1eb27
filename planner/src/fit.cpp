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

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Dense>
#include <ceres/ceres.h>

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

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

// "a", "a and b", "a, b and c".
std::string and_list(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " and " : ", ";
    out += names[i];
  }
  return out;
}

std::string format_double(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::string short_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string percent(double rel) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g %%", rel * 100.0);
  return buf;
}

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
                     const FitOptions& options) {
  const auto& coefs = formula.coefficient_names();
  const auto& vars = formula.variable_names();
  if (coefs.empty()) {
    throw std::invalid_argument("fit: formula '" + formula.text() +
                                "' has no coefficient to fit");
  }
  if (measurements.size() < coefs.size()) {
    throw std::invalid_argument("fit: " + std::to_string(measurements.size()) +
                                " measurements for " + std::to_string(coefs.size()) +
                                " coefficients (" + join(coefs) + "); need at least " +
                                std::to_string(coefs.size()));
  }
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    const Measurement& m = measurements[i];
    if (m.dims.size() != vars.size()) {
      throw std::invalid_argument("fit: measurement " + std::to_string(i) + " has " +
                                  std::to_string(m.dims.size()) + " dims, expected " +
                                  std::to_string(vars.size()) + " (" + join(vars) + ")");
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
  if (!options.batch_size_variable.empty() &&
      std::find(vars.begin(), vars.end(), options.batch_size_variable) == vars.end()) {
    throw std::invalid_argument("fit: FitOptions::batch_size_variable '" +
                                options.batch_size_variable +
                                "' is not a variable of formula '" + formula.canonical() +
                                "' (variables: " + join(vars) + ")");
  }
  for (const auto& [name, value] : options.initial_values) {
    if (std::find(coefs.begin(), coefs.end(), name) == coefs.end()) {
      throw std::invalid_argument("fit: FitOptions::initial_values has '" + name +
                                  "', which is not a coefficient of formula '" +
                                  formula.canonical() + "' (coefficients: " + join(coefs) + ")");
    }
    if (options.non_negative && value < 0) {
      throw std::invalid_argument("fit: FitOptions::initial_values['" + name + "'] = " +
                                  format_double(value) +
                                  " is negative but non_negative is set");
    }
  }
}

ceres::LossFunction* make_loss(const FitOptions& options) {
  if (options.robust_loss == "huber") return new ceres::HuberLoss(options.robust_loss_scale);
  if (options.robust_loss == "cauchy") return new ceres::CauchyLoss(options.robust_loss_scale);
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

// min |A x - b| subject to x >= 0: Lawson and Hanson's active-set algorithm ("Solving Least
// Squares Problems", 1974, chapter 23). A has full column rank (checked before).
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

struct Solution {
  std::vector<double> coefficients;
  ceres::Solver::Summary summary;
};

// Linear least squares; throws IdentifiabilityError before solving when the columns of the
// scaled design matrix are dependent.
Solution solve_linear(const CostFormula& formula, const std::vector<Measurement>& measurements,
                      const FitOptions& options) {
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
  Eigen::VectorXd x0 = options.non_negative ? non_negative_least_squares(jacobian, -r0)
                                            : jacobian.colPivHouseholderQr().solve(-r0);
  if (!x0.allFinite()) x0 = Eigen::VectorXd::Ones(k);
  if (options.non_negative) x0 = x0.cwiseMax(0.0);
  std::vector<double> x(x0.data(), x0.data() + k);

  ceres::Problem problem;
  for (Eigen::Index i = 0; i < n; ++i) {
    problem.AddResidualBlock(new LinearRelativeResidual(jacobian.row(i), r0(i)),
                             make_loss(options), x.data());
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

// Non-linear least squares from `start` (coefficients, declared order).
Solution solve_nonlinear(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const FitOptions& options, const std::vector<double>& start) {
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

Solution solve(const CostFormula& formula, const std::vector<Measurement>& measurements,
               const FitOptions& options, const std::vector<double>& start) {
  if (formula.is_linear()) return solve_linear(formula, measurements, options);
  Solution first = solve_nonlinear(formula, measurements, options, start);
  // The start fixed the scales; when the solution is far from them (a 1e6-byte constant
  // started at 1), solve again from the solution with the solution as scales, so the final
  // steps and tolerances work on O(1) parameters.
  bool rescale = false;
  for (std::size_t j = 0; j < start.size(); ++j) {
    const double ratio = std::abs(first.coefficients[j]) / (start[j] != 0 ? std::abs(start[j]) : 1.0);
    rescale = rescale || (first.coefficients[j] != 0 && (ratio > 10 || ratio < 0.1));
  }
  if (!rescale) return first;
  Solution second = solve_nonlinear(formula, measurements, options, first.coefficients);
  if (!(second.summary.final_cost <= first.summary.final_cost)) return first;
  second.summary.num_successful_steps += first.summary.num_successful_steps;
  second.summary.num_unsuccessful_steps += first.summary.num_unsuccessful_steps;
  return second;
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

void FitOptions::validate() const {
  if (max_iterations < 1) {
    throw std::invalid_argument("FitOptions: max_iterations must be >= 1, got " +
                                std::to_string(max_iterations));
  }
  const std::pair<const char*, double> tolerances[] = {
      {"function_tolerance", function_tolerance},
      {"gradient_tolerance", gradient_tolerance},
      {"parameter_tolerance", parameter_tolerance},
      {"identifiability_tolerance", identifiability_tolerance}};
  for (const auto& [name, value] : tolerances) {
    if (!(std::isfinite(value) && value >= 0)) {
      throw std::invalid_argument(std::string("FitOptions: ") + name +
                                  " must be finite and >= 0, got " + format_double(value));
    }
  }
  if (robust_loss != "none" && robust_loss != "huber" && robust_loss != "cauchy") {
    throw std::invalid_argument("FitOptions: robust_loss must be \"none\", \"huber\" or "
                                "\"cauchy\", got \"" + robust_loss + "\"");
  }
  if (!(std::isfinite(robust_loss_scale) && robust_loss_scale > 0)) {
    throw std::invalid_argument("FitOptions: robust_loss_scale must be finite and > 0, got " +
                                format_double(robust_loss_scale));
  }
  if (!(usable_max_rel_error >= 0)) {  // +inf allowed: no limit
    throw std::invalid_argument("FitOptions: usable_max_rel_error must be >= 0, got " +
                                format_double(usable_max_rel_error));
  }
  for (const auto& [name, value] : initial_values) {
    if (!std::isfinite(value)) {
      throw std::invalid_argument("FitOptions: initial_values['" + name +
                                  "'] must be finite, got " + format_double(value));
    }
  }
}

std::string FitSummary::brief_report() const {
  std::ostringstream os;
  os << (converged ? "Fit converged" : "Fit did NOT converge") << " after " << iterations
     << (iterations == 1 ? " iteration" : " iterations") << " on " << rel_errors.size()
     << (rel_errors.size() == 1 ? " point" : " points") << " ("
     << (linear ? "linear" : "non-linear") << " least squares, " << coefficient_count
     << (coefficient_count == 1 ? " coefficient" : " coefficients") << ", robust loss "
     << robust_loss << "): max relative error " << percent(max_rel_error) << ", mean "
     << percent(mean_rel_error) << ", ";
  if (leave_one_out_note.empty() && !leave_one_out_rel_errors.empty()) {
    os << "leave-one-out max relative error " << percent(leave_one_out_max_rel_error) << ".";
  } else {
    os << "leave-one-out " << (leave_one_out_note.empty() ? "not computed" : leave_one_out_note)
       << ".";
  }
  if (usable) {
    os << " Usable.";
  } else {
    os << " Not usable: ";
    for (std::size_t i = 0; i < reasons.size(); ++i) os << (i ? "; " : "") << reasons[i];
    if (reasons.empty()) os << "no fit";
    os << ".";
  }
  if (!converged && !solver_report.empty()) os << " Solver: " << solver_report;
  return os.str();
}

std::string FitSummary::full_report() const {
  std::ostringstream os;
  os << brief_report() << "\n";
  for (std::size_t i = 0; i < rel_errors.size(); ++i) {
    os << "  point " << i << ": relative error " << percent(rel_errors[i]);
    if (i < leave_one_out_rel_errors.size()) {
      os << ", leave-one-out " << percent(leave_one_out_rel_errors[i]);
    }
    os << "\n";
  }
  return os.str();
}

FitResult fit_coefficients(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options) {
  options.validate();
  validate_inputs(formula, measurements, options);
  const auto& coefs = formula.coefficient_names();
  const std::size_t k = coefs.size();
  const std::size_t n = measurements.size();

  std::vector<double> start(k, 1.0);
  for (std::size_t j = 0; j < k; ++j) {
    const auto it = options.initial_values.find(coefs[j]);
    if (it != options.initial_values.end()) start[j] = it->second;
  }

  const Solution solution = solve(formula, measurements, options, start);
  FitResult result;
  result.coefficients = solution.coefficients;

  FitSummary& s = result.summary;
  s.linear = formula.is_linear();
  s.coefficient_count = k;
  s.robust_loss = options.robust_loss;
  s.converged = solution.summary.termination_type == ceres::CONVERGENCE ||
                solution.summary.termination_type == ceres::USER_SUCCESS;
  s.iterations = solution.summary.num_successful_steps + solution.summary.num_unsuccessful_steps;
  s.solver_report = solution.summary.BriefReport();
  if (!solution.summary.message.empty()) s.solver_report += " (" + solution.summary.message + ")";
  s.rel_errors.reserve(n);
  double sum_abs = 0;
  std::size_t worst = 0;
  std::optional<std::size_t> not_finite;
  for (std::size_t i = 0; i < n; ++i) {
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
  s.mean_rel_error = sum_abs / static_cast<double>(n);

  // Leave-one-out: refit without point i (non-linear fits start from the full solution), then
  // predict point i.
  if (!options.leave_one_out) {
    s.leave_one_out_note = "not computed (FitOptions::leave_one_out is off)";
  } else if (n <= k) {
    s.leave_one_out_note = "not computed: " + std::to_string(n) + " points for " +
                           std::to_string(k) +
                           " coefficients; it needs more points than coefficients";
  } else {
    double loo_max = 0;
    std::vector<double> loo;
    loo.reserve(n);
    for (std::size_t i = 0; i < n && s.leave_one_out_note.empty(); ++i) {
      std::vector<Measurement> rest;
      rest.reserve(n - 1);
      for (std::size_t j = 0; j < n; ++j) {
        if (j != i) rest.push_back(measurements[j]);
      }
      try {
        const Solution without = solve(formula, rest, options, result.coefficients);
        const Measurement& m = measurements[i];
        const double rel = (formula.predict(without.coefficients, m.dims) - m.bytes) / m.bytes;
        loo.push_back(rel);
        loo_max = std::isnan(rel) || std::isnan(loo_max) ? std::nan("")
                                                         : std::max(loo_max, std::abs(rel));
      } catch (const IdentifiabilityError& e) {
        s.leave_one_out_note = "not computed: without point " + std::to_string(i) +
                               " the coefficients " + and_list(e.coefficients()) +
                               " cannot be separated";
      }
    }
    if (s.leave_one_out_note.empty()) {
      s.leave_one_out_rel_errors = std::move(loo);
      s.leave_one_out_max_rel_error = loo_max;
    }
  }

  // Usable?
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
  }
  if (!formula.is_linear()) {
    const Eigen::MatrixXd jacobian = numeric_jacobian(formula, measurements, result.coefficients);
    const double tolerance = std::max(options.identifiability_tolerance, 1e-6);
    if (const auto d = find_dependence(jacobian, tolerance)) {
      s.reasons.push_back(
          describe_dependence(formula, measurements, *d, "at the fitted point").first);
    }
  }
  if (!options.batch_size_variable.empty()) {
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
      s.reasons.push_back("the prediction decreases as " + options.batch_size_variable +
                          " grows at " + std::to_string(decreasing) + " of " +
                          std::to_string(n) + " measured dims: " + first);
    }
  }
  s.usable = s.reasons.empty();
  return result;
}

}  // namespace xpm
