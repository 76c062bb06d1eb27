// formula_evaluator.cpp — cost formulas: the value of a canonical sum at given coefficients
// and dims.
#include "formula_ast.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace xpm::formula_ast {
namespace {

double factor_value(const Factor& f, const std::vector<double>& coefficients,
                    const std::vector<double>& dims) {
  switch (f.kind) {
    case Factor::Kind::max: {
      double out = -HUGE_VAL;
      for (const Sum& operand : f.operands) {
        const double v = value(operand, coefficients, dims);
        if (std::isnan(v)) return v;
        out = std::max(out, v);
      }
      return out;
    }
    case Factor::Kind::power:
      return std::pow(value(f.operands[0], coefficients, dims),
                      value(f.operands[1], coefficients, dims));
    case Factor::Kind::group:
      return value(f.operands[0], coefficients, dims);
  }
  return std::nan("");
}

}  // namespace

double value(const Sum& terms, const std::vector<double>& coefficients,
             const std::vector<double>& dims) {
  double out = 0.0;
  for (const Term& t : terms) {
    double v = t.factor;
    for (std::size_t c = 0; c < t.coefficient_powers.size(); ++c) {
      if (t.coefficient_powers[c] != 0) v *= integer_power(coefficients[c], t.coefficient_powers[c]);
    }
    for (std::size_t d = 0; d < t.variable_powers.size(); ++d) {
      if (t.variable_powers[d] != 0) v *= integer_power(dims[d], t.variable_powers[d]);
    }
    for (const auto& [factor, power] : t.factors) {
      v *= integer_power(factor_value(*factor, coefficients, dims), power);
    }
    out += v;
  }
  return out;
}

double integer_power(double base, int exponent) {
  if (exponent < 0) return 1.0 / integer_power(base, -exponent);
  double out = 1.0;
  for (int k = 0; k < exponent; ++k) out *= base;
  return out;
}

}  // namespace xpm::formula_ast
