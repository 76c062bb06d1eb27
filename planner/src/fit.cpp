// fit.cpp — linear least squares of a CostFormula's coefficients with Ceres (see fit.hpp).
//
// The problem solved, with B_ik = formula.basis(dims_i)[k], o_i = formula.offset(dims_i),
// y_i = measured bytes and s_k = max_i |B_ik| (column scale):
//
//   minimize_x  1/2 sum_i r_i(x)^2,   r_i(x) = (o_i + sum_k B_ik / s_k * x_k - y_i) / y_i
//   subject to  x_k >= 0 (when FitOptions::non_negative)
//
// and coefficient_k = x_k / s_k. The residual is linear in x, so the cost function below
// returns a constant Jacobian J_ik = B_ik / (s_k * y_i) (shape: measurements x coefficients).
#include "xpm/planner/fit.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Dense>
#include <ceres/ceres.h>

namespace xpm {
namespace {

// r = r0 + J x, one residual per measurement, one parameter block of all scaled coefficients.
class LinearRelativeResidual final : public ceres::CostFunction {
 public:
  LinearRelativeResidual(Eigen::MatrixXd jacobian, Eigen::VectorXd r0)
      : jacobian_(std::move(jacobian)), r0_(std::move(r0)) {
    set_num_residuals(static_cast<int>(jacobian_.rows()));
    mutable_parameter_block_sizes()->push_back(static_cast<int>(jacobian_.cols()));
  }

  bool Evaluate(double const* const* parameters, double* residuals,
                double** jacobians) const override {
    const Eigen::Index n = jacobian_.rows();
    const Eigen::Index k = jacobian_.cols();
    Eigen::Map<const Eigen::VectorXd> x(parameters[0], k);
    Eigen::Map<Eigen::VectorXd>(residuals, n) = r0_ + jacobian_ * x;
    if (jacobians != nullptr && jacobians[0] != nullptr) {
      // Ceres wants row-major: jacobians[0][i * k + j] = d r_i / d x_j.
      Eigen::Map<Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
          jacobians[0], n, k) = jacobian_;
    }
    return true;
  }

 private:
  Eigen::MatrixXd jacobian_;  // [measurements, coefficients]
  Eigen::VectorXd r0_;        // [measurements], (o_i - y_i) / y_i
};

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

std::string format_double(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::string percent(double rel) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g %%", rel * 100.0);
  return buf;
}

void validate_inputs(const CostFormula& formula, const std::vector<Measurement>& measurements) {
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
}

}  // namespace

void FitOptions::validate() const {
  if (max_iterations < 1) {
    throw std::invalid_argument("FitOptions: max_iterations must be >= 1, got " +
                                std::to_string(max_iterations));
  }
  const std::pair<const char*, double> tolerances[] = {
      {"function_tolerance", function_tolerance},
      {"gradient_tolerance", gradient_tolerance},
      {"parameter_tolerance", parameter_tolerance}};
  for (const auto& [name, value] : tolerances) {
    if (!(std::isfinite(value) && value >= 0)) {
      throw std::invalid_argument(std::string("FitOptions: ") + name +
                                  " must be finite and >= 0, got " + format_double(value));
    }
  }
}

std::string FitSummary::brief_report() const {
  std::ostringstream os;
  os << (converged ? "Fit converged" : "Fit did NOT converge") << " after " << iterations
     << (iterations == 1 ? " iteration" : " iterations") << " on " << rel_errors.size()
     << (rel_errors.size() == 1 ? " point" : " points") << ": max relative error "
     << percent(max_rel_error) << ", mean " << percent(mean_rel_error) << ".";
  if (!converged && !solver_report.empty()) os << " Solver: " << solver_report;
  return os.str();
}

FitResult fit_coefficients(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options) {
  options.validate();
  validate_inputs(formula, measurements);
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

  // Column scales s_k = max_i |B_ik|; an all-zero column cannot be identified.
  Eigen::VectorXd scale(k);
  for (Eigen::Index j = 0; j < k; ++j) {
    const std::string& name = coefs[static_cast<std::size_t>(j)];
    if (!basis.col(j).allFinite()) {
      throw std::invalid_argument("fit: the term of coefficient '" + name +
                                  "' is not finite at some measurement (overflow?)");
    }
    scale(j) = basis.col(j).cwiseAbs().maxCoeff();
    if (scale(j) == 0) {
      throw std::invalid_argument("fit: coefficient '" + name +
                                  "' multiplies a term that is zero at every measurement; the "
                                  "probe points cannot identify it");
    }
  }

  // Relative, scaled linear system: J x ~= -r0.
  Eigen::VectorXd y(n);
  for (Eigen::Index i = 0; i < n; ++i) y(i) = measurements[static_cast<std::size_t>(i)].bytes;
  Eigen::MatrixXd jacobian = y.cwiseInverse().asDiagonal() * basis * scale.cwiseInverse().asDiagonal();
  Eigen::VectorXd r0 = (offset - y).cwiseQuotient(y);

  // Initial point: the unconstrained least-squares solution, clipped to the bounds.
  Eigen::VectorXd x0 = jacobian.colPivHouseholderQr().solve(-r0);
  if (!x0.allFinite()) x0 = Eigen::VectorXd::Ones(k);
  if (options.non_negative) x0 = x0.cwiseMax(0.0);
  std::vector<double> x(x0.data(), x0.data() + k);

  ceres::Problem problem;
  problem.AddResidualBlock(new LinearRelativeResidual(jacobian, r0), nullptr, x.data());
  if (options.non_negative) {
    for (int j = 0; j < static_cast<int>(k); ++j) problem.SetParameterLowerBound(x.data(), j, 0.0);
  }

  ceres::Solver::Options solver_options;
  solver_options.minimizer_type = ceres::TRUST_REGION;
  solver_options.linear_solver_type = ceres::DENSE_QR;
  solver_options.max_num_iterations = options.max_iterations;
  solver_options.function_tolerance = options.function_tolerance;
  solver_options.gradient_tolerance = options.gradient_tolerance;
  solver_options.parameter_tolerance = options.parameter_tolerance;
  solver_options.logging_type = ceres::SILENT;
  solver_options.minimizer_progress_to_stdout = false;
  solver_options.num_threads = 1;
  std::string options_error;
  if (!solver_options.IsValid(&options_error)) {
    throw std::invalid_argument("fit: invalid Ceres options: " + options_error);
  }

  ceres::Solver::Summary ceres_summary;
  ceres::Solve(solver_options, &problem, &ceres_summary);

  FitResult result;
  result.coefficients.resize(static_cast<std::size_t>(k));
  for (Eigen::Index j = 0; j < k; ++j) {
    double c = x[static_cast<std::size_t>(j)] / scale(j);
    if (options.non_negative) c = std::max(c, 0.0);  // the bound holds exactly, even for -0
    result.coefficients[static_cast<std::size_t>(j)] = c;
  }

  FitSummary& s = result.summary;
  s.converged = ceres_summary.termination_type == ceres::CONVERGENCE ||
                ceres_summary.termination_type == ceres::USER_SUCCESS;
  s.iterations = ceres_summary.num_successful_steps + ceres_summary.num_unsuccessful_steps;
  s.solver_report = ceres_summary.BriefReport();
  s.rel_errors.reserve(measurements.size());
  double sum_abs = 0;
  for (const Measurement& m : measurements) {
    const double rel = (formula.predict(result.coefficients, m.dims) - m.bytes) / m.bytes;
    s.rel_errors.push_back(rel);
    s.max_rel_error = std::max(s.max_rel_error, std::abs(rel));
    sum_abs += std::abs(rel);
  }
  s.mean_rel_error = sum_abs / static_cast<double>(measurements.size());
  return result;
}

}  // namespace xpm
