// fit_start.cpp — the automatic start of non-linear fits (see fit_start.hpp).
#include "fit_start.hpp"

#include "number_format.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Dense>

#include "formula_ast.hpp"
#include "max_affine_fit.hpp"
#include "nnls.hpp"

namespace xpm::detail {
namespace {

namespace fa = formula_ast;

// Ordered by precedence: a coefficient with two uses takes the larger role.
enum class Role { linear = 0, fixed = 1, exponent = 2 };

void mark(std::vector<Role>& roles, int c, Role role) {
  Role& r = roles[static_cast<std::size_t>(c)];
  if (static_cast<int>(role) > static_cast<int>(r)) r = role;
}

// Every coefficient in `sum`, at any depth.
void sum_coefficients(const fa::Sum& sum, std::set<int>& out) {
  for (const fa::Term& t : sum) {
    for (std::size_t c = 0; c < t.coefficient_powers.size(); ++c) {
      if (t.coefficient_powers[c] != 0) out.insert(static_cast<int>(c));
    }
    for (const auto& [factor, power] : t.factors) {
      out.insert(factor->coefficients.begin(), factor->coefficients.end());
      for (const fa::Sum& operand : factor->operands) sum_coefficients(operand, out);
    }
  }
}

std::set<int> factor_coefficients(const fa::Factor& f) {
  std::set<int> out(f.coefficients.begin(), f.coefficients.end());
  for (const fa::Sum& operand : f.operands) sum_coefficients(operand, out);
  return out;
}

// Sorts the coefficients of `sum` into roles (fit_start.hpp). `nonlinear`: the sum is multiplied
// by another coefficient or raised to a power, so nothing in it enters linearly.
void classify(const fa::Sum& sum, bool nonlinear, std::vector<Role>& roles) {
  for (const fa::Term& t : sum) {
    int slots = 0;  // coefficients and coefficient-holding max() factors multiplied together
    for (int p : t.coefficient_powers) slots += p != 0 ? 1 : 0;
    for (const auto& [factor, power] : t.factors) {
      if (factor->kind == fa::Factor::Kind::max && !factor_coefficients(*factor).empty()) ++slots;
    }
    const bool inner = nonlinear || slots > 1;
    for (std::size_t c = 0; c < t.coefficient_powers.size(); ++c) {
      const int p = t.coefficient_powers[c];
      if (p != 0) mark(roles, static_cast<int>(c), inner || p != 1 ? Role::fixed : Role::linear);
    }
    for (const auto& [factor, power] : t.factors) {
      switch (factor->kind) {
        case fa::Factor::Kind::max:
          for (const fa::Sum& operand : factor->operands) {
            classify(operand, inner || power != 1, roles);
          }
          break;
        case fa::Factor::Kind::power: {
          std::set<int> base, exponent;
          sum_coefficients(factor->operands[0], base);
          sum_coefficients(factor->operands[1], exponent);
          for (int c : exponent) mark(roles, c, Role::exponent);
          for (int c : base) mark(roles, c, Role::fixed);
          break;
        }
        case fa::Factor::Kind::group:
          for (int c : factor_coefficients(*factor)) mark(roles, c, Role::fixed);
          break;
      }
    }
  }
}

// Choices of a max() argument per resolvable max() factor, by the factor's canonical text.
using MaxChoices = std::map<std::string, std::size_t>;

// Evaluates a sum like formula_ast::value, except that each max(...) holding a linear
// coefficient is resolved: into the sum of its arguments (reference == nullptr) or into the
// argument that wins at `reference` coefficients (same dims). With the exponents and fixed
// coefficients held, the result is affine in the linear coefficients.
class Resolver {
 public:
  Resolver(const std::vector<Role>& roles, const std::vector<double>* reference)
      : roles_(roles), reference_(reference) {}
  /// Resolves every max() by `choices` (an argument index per factor text) instead.
  Resolver(const std::vector<Role>& roles, const MaxChoices& choices)
      : roles_(roles), reference_(nullptr), choices_(&choices) {}

  double value(const fa::Sum& sum, const std::vector<double>& coefficients,
               const std::vector<double>& dims) const {
    return fa::sum_value(sum, coefficients, dims,
                         [&](const fa::Factor& factor) { return factor_value(factor, coefficients, dims); });
  }

  bool resolves(const fa::Factor& f) const {
    if (f.kind != fa::Factor::Kind::max) return false;
    for (int c : factor_coefficients(f)) {
      if (roles_[static_cast<std::size_t>(c)] == Role::linear) return true;
    }
    return false;
  }

 private:
  double factor_value(const fa::Factor& f, const std::vector<double>& coefficients,
                      const std::vector<double>& dims) const {
    switch (f.kind) {
      case fa::Factor::Kind::max: {
        if (!resolves(f)) {
          double out = -HUGE_VAL;
          for (const fa::Sum& operand : f.operands) {
            out = std::max(out, fa::value(operand, coefficients, dims));
          }
          return out;
        }
        if (choices_ != nullptr) {
          return value(f.operands[choices_->at(f.text)], coefficients, dims);
        }
        if (reference_ == nullptr) {
          double out = 0.0;
          for (const fa::Sum& operand : f.operands) out += value(operand, coefficients, dims);
          return out;
        }
        std::size_t winner = 0;
        double best = -HUGE_VAL;
        for (std::size_t i = 0; i < f.operands.size(); ++i) {
          const double v = fa::value(f.operands[i], *reference_, dims);
          if (v > best) {
            best = v;
            winner = i;
          }
        }
        return value(f.operands[winner], coefficients, dims);
      }
      case fa::Factor::Kind::power:
        return std::pow(fa::value(f.operands[0], coefficients, dims),
                        fa::value(f.operands[1], coefficients, dims));
      case fa::Factor::Kind::group:
        return fa::value(f.operands[0], coefficients, dims);
    }
    return std::nan("");
  }

  const std::vector<Role>& roles_;
  const std::vector<double>* reference_;
  const MaxChoices* choices_ = nullptr;
};

bool has_resolved_max(const fa::Sum& sum, const Resolver& resolver) {
  for (const fa::Term& t : sum) {
    for (const auto& [factor, power] : t.factors) {
      if (resolver.resolves(*factor)) return true;
      for (const fa::Sum& operand : factor->operands) {
        if (has_resolved_max(operand, resolver)) return true;
      }
    }
  }
  return false;
}

// The resolvable max() factors of `sum` at any depth, by canonical text, with their argument
// counts. False when one sits where the formula does not grow with it (a negative factor or a
// power other than 1 on its term): then the formula is not the maximum of its resolved variants.
bool collect_max_factors(const fa::Sum& sum, const Resolver& resolver,
                         std::map<std::string, std::size_t>& out) {
  for (const fa::Term& t : sum) {
    for (const auto& [factor, power] : t.factors) {
      if (!resolver.resolves(*factor)) continue;
      if (!(t.factor > 0) || power != 1) return false;
      out[factor->text] = factor->operands.size();
      for (const fa::Sum& operand : factor->operands) {
        if (!collect_max_factors(operand, resolver, out)) return false;
      }
    }
  }
  return true;
}

// Every combination of one argument per max() factor (an odometer over `factors`).
std::vector<MaxChoices> max_variants(const std::map<std::string, std::size_t>& factors) {
  std::vector<MaxChoices> out(1);
  for (const auto& [text, count] : factors) {
    std::vector<MaxChoices> next;
    for (const MaxChoices& partial : out) {
      for (std::size_t a = 0; a < count; ++a) {
        next.push_back(partial);
        next.back()[text] = a;
      }
    }
    out = std::move(next);
  }
  return out;
}

struct Candidate {
  std::vector<double> coefficients;
  double cost = HUGE_VAL;
};

// A candidate of the global max() fit, with how it was searched.
struct GlobalCandidate {
  Candidate candidate;
  std::int64_t nodes = 0;   // restricted least-squares problems solved
  bool exhaustive = false;  // branch and bound finished: the global optimum
  bool stopped = false;     // branch and bound stopped at its budget of restricted problems
  std::size_t points = 0;
};

// More variants than this (combinations of max() arguments): max() is resolved by the local
// method only.
constexpr std::size_t kMaxVariants = 64;

class StartSearch {
 public:
  StartSearch(const CostFormula& formula, const std::vector<Measurement>& measurements,
              const FitOptions& options)
      : formula_(formula),
        terms_(formula.expression().terms),
        measurements_(measurements),
        options_(options),
        roles_(formula.coefficient_names().size(), Role::linear) {
    classify(terms_, false, roles_);
    for (std::size_t k = 0; k < roles_.size(); ++k) {
      if (roles_[k] == Role::linear) linear_.push_back(k);
      if (roles_[k] == Role::exponent) exponents_.push_back(k);
    }
    resolves_max_ = has_resolved_max(terms_, Resolver(roles_, nullptr));
    if (resolves_max_) {
      std::map<std::string, std::size_t> factors;
      if (collect_max_factors(terms_, Resolver(roles_, nullptr), factors)) {
        variants_ = max_variants(factors);
        if (variants_.size() > kMaxVariants) variants_.clear();
      }
    }
  }

  /// max() resolved globally: the formula is the maximum of at most kMaxVariants variants, each
  /// affine in the linear coefficients.
  bool global_max() const { return !variants_.empty(); }

  const std::vector<std::size_t>& linear() const { return linear_; }
  const std::vector<std::size_t>& exponents() const { return exponents_; }
  const std::vector<Role>& roles() const { return roles_; }
  bool resolves_max() const { return resolves_max_; }

  // The linear coefficients of `base` by the global least-squares fit over the winning variant
  // at every point (max_affine_fit.hpp); requires global_max().
  // `near`: the coefficients of a fit of nearly the same points, whose winning variants seed the
  // search (nullptr: none).
  GlobalCandidate global_least_squares(const std::vector<double>& base, const std::vector<double>* near) const {
    const std::size_t k = linear_.size();
    std::vector<double> zero = base;
    for (std::size_t c : linear_) zero[c] = 0.0;
    MaxAffineProblem problem;
    problem.coefficients = k;
    problem.non_negative = options_.non_negative;
    std::vector<bool> has_effect(k, false);
    for (const Measurement& m : measurements_) {
      std::vector<Eigen::RowVectorXd> rows;
      for (const MaxChoices& choices : variants_) {
        const Resolver resolver(roles_, choices);
        const double offset = resolver.value(terms_, zero, m.dims);
        Eigen::RowVectorXd row(static_cast<Eigen::Index>(k + 1));
        for (std::size_t j = 0; j < k; ++j) {
          std::vector<double> unit = zero;
          unit[linear_[j]] = 1.0;
          row(static_cast<Eigen::Index>(j)) = (resolver.value(terms_, unit, m.dims) - offset) / m.bytes;
          has_effect[j] = has_effect[j] || row(static_cast<Eigen::Index>(j)) != 0;
        }
        row(static_cast<Eigen::Index>(k)) = (offset - m.bytes) / m.bytes;
        if (!row.allFinite()) return {};
        if (std::none_of(rows.begin(), rows.end(), [&](const Eigen::RowVectorXd& r) { return r == row; })) {
          rows.push_back(std::move(row));
        }
      }
      MaxAffinePoint point;
      point.residuals.resize(static_cast<Eigen::Index>(rows.size()), static_cast<Eigen::Index>(k + 1));
      for (std::size_t v = 0; v < rows.size(); ++v) point.residuals.row(static_cast<Eigen::Index>(v)) = rows[v];
      problem.points.push_back(std::move(point));
    }
    MaxAffineSearchOptions search;
    if (near != nullptr && near->size() == base.size()) {
      Eigen::VectorXd seed(static_cast<Eigen::Index>(k));
      for (std::size_t j = 0; j < k; ++j) seed(static_cast<Eigen::Index>(j)) = (*near)[linear_[j]];
      search.seeds.push_back(std::move(seed));
    }
    const MaxAffineSolution solution = solve_max_affine(problem, search);
    GlobalCandidate out;
    out.candidate.coefficients = base;
    for (std::size_t j = 0; j < k; ++j) {
      if (has_effect[j]) out.candidate.coefficients[linear_[j]] = solution.x(static_cast<Eigen::Index>(j));
    }
    out.candidate.cost = cost(out.candidate.coefficients);
    out.nodes = solution.nodes;
    out.exhaustive = solution.exhaustive;
    out.stopped = solution.stopped;
    out.points = measurements_.size();
    return out;
  }

  // Sum of squared relative residuals of the true formula; +inf when not finite.
  double cost(const std::vector<double>& coefficients) const {
    double sum = 0.0;
    for (const Measurement& m : measurements_) {
      const double r = (formula_.predict(coefficients, m.dims) - m.bytes) / m.bytes;
      sum += r * r;
    }
    return std::isfinite(sum) ? sum : HUGE_VAL;
  }

  // The best candidate with the exponents and fixed coefficients of `base`: least squares over
  // the linear coefficients, max() resolved by sum then by winner until the cost stops falling.
  Candidate complete(const std::vector<double>& base) const {
    Candidate best = least_squares(base, nullptr);
    if (!resolves_max_) return best;
    for (int round = 0; round < 20 && std::isfinite(best.cost); ++round) {
      const Candidate next = least_squares(best.coefficients, &best.coefficients);
      if (!(next.cost < best.cost * (1 - 1e-12))) break;
      best = next;
    }
    return best;
  }

 private:
  // Least squares over the linear coefficients of the relative residuals of the resolved
  // formula; a linear coefficient without effect at any point keeps its value in `base`.
  Candidate least_squares(const std::vector<double>& base,
                          const std::vector<double>* reference) const {
    const Resolver resolver(roles_, reference);
    const Eigen::Index n = static_cast<Eigen::Index>(measurements_.size());
    const Eigen::Index k = static_cast<Eigen::Index>(linear_.size());
    std::vector<double> zero = base;
    for (std::size_t c : linear_) zero[c] = 0.0;
    Eigen::MatrixXd a(n, k);
    Eigen::VectorXd b(n);
    for (Eigen::Index i = 0; i < n; ++i) {
      const Measurement& m = measurements_[static_cast<std::size_t>(i)];
      const double offset = resolver.value(terms_, zero, m.dims);
      b(i) = (m.bytes - offset) / m.bytes;
      for (Eigen::Index j = 0; j < k; ++j) {
        std::vector<double> unit = zero;
        unit[linear_[static_cast<std::size_t>(j)]] = 1.0;
        a(i, j) = (resolver.value(terms_, unit, m.dims) - offset) / m.bytes;
      }
    }
    Candidate out{base, HUGE_VAL};
    if (!a.allFinite() || !b.allFinite()) return out;
    std::vector<Eigen::Index> used;
    std::vector<double> scales;
    for (Eigen::Index j = 0; j < k; ++j) {
      const double scale = a.col(j).cwiseAbs().maxCoeff();
      if (scale > 0) {
        used.push_back(j);
        scales.push_back(scale);
      }
    }
    Eigen::MatrixXd scaled(n, static_cast<Eigen::Index>(used.size()));
    for (std::size_t u = 0; u < used.size(); ++u) {
      scaled.col(static_cast<Eigen::Index>(u)) = a.col(used[u]) / scales[u];
    }
    if (!used.empty()) {
      const Eigen::VectorXd x = options_.non_negative
                                    ? non_negative_least_squares(scaled, b)
                                    : Eigen::VectorXd(scaled.colPivHouseholderQr().solve(b));
      if (!x.allFinite()) return out;
      for (std::size_t u = 0; u < used.size(); ++u) {
        double c = x(static_cast<Eigen::Index>(u)) / scales[u];
        if (options_.non_negative) c = std::max(c, 0.0);
        out.coefficients[linear_[static_cast<std::size_t>(used[u])]] = c;
      }
    }
    out.cost = cost(out.coefficients);
    return out;
  }

  const CostFormula& formula_;
  const fa::Sum& terms_;
  const std::vector<Measurement>& measurements_;
  const FitOptions& options_;
  std::vector<Role> roles_;
  std::vector<std::size_t> linear_;
  std::vector<std::size_t> exponents_;
  bool resolves_max_ = false;
  std::vector<MaxChoices> variants_;  // empty: max() not resolved globally
};

using detail::short_double;

using detail::and_list;

}  // namespace

std::optional<std::vector<Eigen::MatrixXd>> max_affine_variants(const CostFormula& formula,
                                                                const std::vector<std::vector<double>>& dims) {
  const fa::Sum& terms = formula.expression().terms;
  const std::size_t k = formula.coefficient_names().size();
  std::vector<Role> roles(k, Role::linear);
  classify(terms, false, roles);
  if (std::any_of(roles.begin(), roles.end(), [](Role r) { return r != Role::linear; })) return std::nullopt;
  std::map<std::string, std::size_t> factors;
  if (!has_resolved_max(terms, Resolver(roles, nullptr)) ||
      !collect_max_factors(terms, Resolver(roles, nullptr), factors)) {
    return std::nullopt;
  }
  const std::vector<MaxChoices> variants = max_variants(factors);
  if (variants.size() > kMaxVariants) return std::nullopt;
  std::vector<Eigen::MatrixXd> out;
  out.reserve(dims.size());
  const std::vector<double> zero(k, 0.0);
  for (const std::vector<double>& at : dims) {
    std::vector<Eigen::RowVectorXd> rows;
    for (const MaxChoices& choices : variants) {
      const Resolver resolver(roles, choices);
      Eigen::RowVectorXd row(static_cast<Eigen::Index>(k + 1));
      const double offset = resolver.value(terms, zero, at);
      for (std::size_t j = 0; j < k; ++j) {
        std::vector<double> unit = zero;
        unit[j] = 1.0;
        row(static_cast<Eigen::Index>(j)) = resolver.value(terms, unit, at) - offset;
      }
      row(static_cast<Eigen::Index>(k)) = offset;
      if (!row.allFinite()) return std::nullopt;
      if (std::none_of(rows.begin(), rows.end(), [&](const Eigen::RowVectorXd& r) { return r == row; })) {
        rows.push_back(std::move(row));
      }
    }
    Eigen::MatrixXd matrix(static_cast<Eigen::Index>(rows.size()), static_cast<Eigen::Index>(k + 1));
    for (std::size_t v = 0; v < rows.size(); ++v) matrix.row(static_cast<Eigen::Index>(v)) = rows[v];
    out.push_back(std::move(matrix));
  }
  return out;
}

AutomaticStart automatic_start(const CostFormula& formula,
                               const std::vector<Measurement>& measurements,
                               const FitOptions& options, const std::vector<double>& fallback,
                               const std::vector<double>* near) {
  const StartSearch search(formula, measurements, options);
  Candidate best = search.complete(fallback);

  // Coordinate search over the exponents: a coarse grid, then finer steps around the best.
  const std::vector<std::size_t>& exponents = search.exponents();
  const double lowest = options.non_negative ? 0.0 : -2.0;
  const auto try_value = [&](std::size_t e, double value) {
    if (value < lowest - 1e-12) return false;
    std::vector<double> base = best.coefficients;
    base[e] = value;
    Candidate c = search.complete(base);
    if (c.cost < best.cost) {
      best = std::move(c);
      return true;
    }
    return false;
  };
  if (!exponents.empty()) {
    for (int sweep = 0; sweep < 3; ++sweep) {
      bool improved = false;
      for (std::size_t e : exponents) {
        for (double value = lowest; value <= 4.0 + 1e-12; value += 0.25) {
          improved = try_value(e, value) || improved;
        }
      }
      if (!improved) break;
    }
    for (double step : {0.05, 0.01, 0.002}) {
      for (int sweep = 0; sweep < 3; ++sweep) {
        bool improved = false;
        for (std::size_t e : exponents) {
          const double center = best.coefficients[e];
          for (int j = -5; j <= 5; ++j) {
            if (j != 0) improved = try_value(e, center + j * step) || improved;
          }
        }
        if (!improved) break;
      }
    }
  }

  // max(): the global optimum over the winning argument at every point, at the best exponents.
  std::string max_note = " with max() resolved per point";
  if (search.global_max()) {
    const GlobalCandidate global = search.global_least_squares(best.coefficients, near);
    if (global.candidate.cost <= best.cost) best = global.candidate;
    max_note = global.exhaustive
                   ? " with max() resolved globally (branch and bound over the winning argument "
                     "at each of " + std::to_string(global.points) + " points, " +
                         std::to_string(global.nodes) + " restricted problems)"
                   : std::string(" with max() resolved by assignment iteration from several starts") +
                         (global.stopped ? " and a branch and bound stopped at its budget" : "") + " (" +
                         std::to_string(global.points) + " points, " +
                         std::to_string(global.nodes) + " restricted problems; not proven global)";
  }

  AutomaticStart out;
  const double fallback_cost = search.cost(fallback);
  if (!(best.cost < fallback_cost)) {
    out.coefficients = fallback;
    out.cost = fallback_cost;
    out.description = "automatic start found nothing better than 1 for every coefficient";
    return out;
  }
  out.coefficients = best.coefficients;
  out.cost = best.cost;
  const auto& names = formula.coefficient_names();
  std::vector<std::string> parts;
  std::vector<std::string> exponent_values, linear_names, fixed_names;
  for (std::size_t e : exponents) {
    exponent_values.push_back(names[e] + " = " + short_double(best.coefficients[e]));
  }
  for (std::size_t k : search.linear()) linear_names.push_back(names[k]);
  for (std::size_t k = 0; k < names.size(); ++k) {
    if (search.roles()[k] == Role::fixed) fixed_names.push_back(names[k]);
  }
  if (!exponent_values.empty()) parts.push_back(and_list(exponent_values) + " by grid search");
  if (!linear_names.empty()) {
    parts.push_back(and_list(linear_names) + " by " +
                    (options.non_negative ? "non-negative " : "") + "least squares" +
                    (search.resolves_max() ? max_note : ""));
  }
  if (!fixed_names.empty()) parts.push_back(and_list(fixed_names) + " at 1");
  std::string text = "automatic (";
  for (std::size_t i = 0; i < parts.size(); ++i) text += (i ? "; " : "") + parts[i];
  out.description = text + ")";
  return out;
}

}  // namespace xpm::detail
