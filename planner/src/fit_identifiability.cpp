// fit_identifiability.cpp — identifiability: whether the measurements determine every
// coefficient, before solving (linear formulas) or at the fitted point (non-linear ones), and
// the messages that name the coefficients that cannot be separated (see fit_identifiability.hpp).
#include "fit_identifiability.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "formula_ast.hpp"
#include "number_format.hpp"

namespace xpm {

IdentifiabilityError::IdentifiabilityError(const std::string& message,
                                           std::vector<std::string> coefficients,
                                           std::string dependent)
    : std::invalid_argument(message),
      coefficients_(std::move(coefficients)),
      dependent_(std::move(dependent)) {}

namespace detail {
namespace {

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

// Whether coefficient `index`'s term is zero at shapes no measurement picked (each variable
// at a few values no formula singles out): the formula's terms for it cancel.
bool zero_for_any_dims(const CostFormula& formula, std::size_t index) {
  const std::size_t variables = formula.variable_names().size();
  std::vector<Measurement> generic;
  for (double base : {1.37, 2.91, 7.53}) {
    Measurement m{std::vector<double>(variables), 1.0};
    for (std::size_t v = 0; v < variables; ++v) m.dims[v] = base + 1.11 * static_cast<double>(v);
    generic.push_back(std::move(m));
  }
  const std::vector<double> ones(formula.coefficient_names().size(), 1.0);
  return numeric_jacobian(formula, generic, ones).col(static_cast<Eigen::Index>(index)).cwiseAbs().maxCoeff() <
         1e-9;
}

}  // namespace

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
    if (formula.is_linear() && zero_for_any_dims(formula, d.dependent)) {
      message = "coefficient '" + dependent + "' multiplies a term that is zero for any dims (its terms in '" +
                formula.text() + "' cancel); drop it from the formula";
    } else if (formula.is_linear()) {
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

}  // namespace detail
}  // namespace xpm
