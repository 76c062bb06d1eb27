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
  return sum_value(terms, coefficients, dims,
                   [&](const Factor& factor) { return factor_value(factor, coefficients, dims); });
}

}  // namespace xpm::formula_ast
