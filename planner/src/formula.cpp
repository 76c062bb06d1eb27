// formula.cpp — xpm::CostFormula and xpm::FormulaError. Parsing and canonical printing live in
// formula_ast.cpp; evaluate() hands the canonical string to muparserx.
#include "xpm/planner/formula.hpp"

#include <muparserx/mpParser.h>

#include <set>
#include <stdexcept>
#include <utility>

#include "formula_ast.hpp"

namespace xpm {
namespace {

std::string describe(const std::string& message, std::size_t position, const std::string& symbol) {
  std::string out = "formula error";
  if (position != std::string::npos) out += " at column " + std::to_string(position + 1);
  if (!symbol.empty()) out += " (symbol '" + symbol + "')";
  out += ": " + message;
  return out;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out.empty() ? "none" : out;
}

bool is_identifier(const std::string& name) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!alpha && !(digit && i > 0)) return false;
  }
  return true;
}

void check_names(const std::vector<std::string>& coefficient_names,
                 const std::vector<std::string>& variable_names) {
  std::set<std::string> seen;
  const auto check = [&seen](const std::string& name, const char* kind) {
    if (!is_identifier(name)) {
      throw std::invalid_argument(std::string("xpm: ") + kind + " name '" + name +
                                  "' is not an identifier ([A-Za-z_][A-Za-z0-9_]*)");
    }
    if (!seen.insert(name).second) {
      throw std::invalid_argument(std::string("xpm: ") + kind + " name '" + name +
                                  "' is declared twice (names must be unique across "
                                  "coefficients and variables)");
    }
  };
  for (const std::string& name : coefficient_names) check(name, "coefficient");
  for (const std::string& name : variable_names) check(name, "variable");
}

double integer_power(double base, int exponent) {
  double out = 1.0;
  for (int k = 0; k < exponent; ++k) out *= base;
  return out;
}

double term_value(const Monomial& m, const std::vector<double>& dims) {
  double value = m.factor;
  for (std::size_t v = 0; v < dims.size(); ++v) value *= integer_power(dims[v], m.powers[v]);
  return value;
}

}  // namespace

FormulaError::FormulaError(const std::string& message, std::size_t position, std::string symbol)
    : std::invalid_argument(describe(message, position, symbol)),
      position_(position),
      symbol_(std::move(symbol)) {}

CostFormula::CostFormula(const std::string& text, std::vector<std::string> coefficient_names,
                         std::vector<std::string> variable_names)
    : text_(text),
      coefficient_names_(std::move(coefficient_names)),
      variable_names_(std::move(variable_names)) {
  check_names(coefficient_names_, variable_names_);
  const formula_ast::Node root = formula_ast::parse(text_);
  monomials_ = formula_ast::expand(root, text_, coefficient_names_, variable_names_);
  canonical_ = formula_ast::print(monomials_, coefficient_names_, variable_names_);
}

std::size_t CostFormula::variable_index(const std::string& name) const {
  for (std::size_t v = 0; v < variable_names_.size(); ++v) {
    if (variable_names_[v] == name) return v;
  }
  throw std::invalid_argument("xpm: '" + name + "' is not a variable of formula '" + canonical_ +
                              "' (variables: " + join(variable_names_) + ")");
}

namespace {

void check_dims(const std::vector<double>& dims, const std::vector<std::string>& variable_names,
                const std::string& canonical) {
  if (dims.size() != variable_names.size()) {
    throw std::invalid_argument(
        "xpm: formula '" + canonical + "' has " + std::to_string(variable_names.size()) +
        " variables (" + join(variable_names) + "), got " + std::to_string(dims.size()) + " dims");
  }
}

void check_coefficients(const std::vector<double>& coefficients,
                        const std::vector<std::string>& coefficient_names,
                        const std::string& canonical) {
  if (coefficients.size() != coefficient_names.size()) {
    throw std::invalid_argument("xpm: formula '" + canonical + "' has " +
                                std::to_string(coefficient_names.size()) + " coefficients (" +
                                join(coefficient_names) + "), got " +
                                std::to_string(coefficients.size()) + " values");
  }
}

}  // namespace

std::vector<double> CostFormula::basis(const std::vector<double>& dims) const {
  check_dims(dims, variable_names_, canonical_);
  std::vector<double> out(coefficient_names_.size(), 0.0);
  for (const Monomial& m : monomials_) {
    if (m.coefficient >= 0) out[static_cast<std::size_t>(m.coefficient)] += term_value(m, dims);
  }
  return out;
}

double CostFormula::offset(const std::vector<double>& dims) const {
  check_dims(dims, variable_names_, canonical_);
  double out = 0.0;
  for (const Monomial& m : monomials_) {
    if (m.coefficient < 0) out += term_value(m, dims);
  }
  return out;
}

double CostFormula::predict(const std::vector<double>& coefficients,
                            const std::vector<double>& dims) const {
  check_coefficients(coefficients, coefficient_names_, canonical_);
  check_dims(dims, variable_names_, canonical_);
  double out = 0.0;
  for (const Monomial& m : monomials_) {
    const double scale =
        m.coefficient >= 0 ? coefficients[static_cast<std::size_t>(m.coefficient)] : 1.0;
    out += scale * term_value(m, dims);
  }
  return out;
}

double CostFormula::evaluate(const std::vector<double>& coefficients,
                             const std::vector<double>& dims) const {
  check_coefficients(coefficients, coefficient_names_, canonical_);
  check_dims(dims, variable_names_, canonical_);

  // The canonical string with each declared name replaced by a private alias (_c0.., _v0..),
  // so names that muparserx reserves (e, pi, sin, true, ...) still evaluate as ours.
  std::string expression;
  std::size_t copied = 0;
  for (const formula_ast::Token& token : formula_ast::tokenize(canonical_)) {
    if (token.kind != formula_ast::Token::Kind::name) continue;
    expression += canonical_.substr(copied, token.position - copied);
    copied = token.position + token.text.size();
    bool found = false;
    for (std::size_t k = 0; k < coefficient_names_.size() && !found; ++k) {
      if (coefficient_names_[k] == token.text) {
        expression += "_c" + std::to_string(k);
        found = true;
      }
    }
    for (std::size_t v = 0; v < variable_names_.size() && !found; ++v) {
      if (variable_names_[v] == token.text) {
        expression += "_v" + std::to_string(v);
        found = true;
      }
    }
  }
  expression += canonical_.substr(copied);

  try {
    mup::ParserX parser(mup::pckCOMMON | mup::pckNON_COMPLEX);
    std::vector<mup::Value> values;
    values.reserve(coefficients.size() + dims.size());  // Variables point into it.
    for (std::size_t k = 0; k < coefficients.size(); ++k) {
      values.emplace_back(coefficients[k]);
      parser.DefineVar("_c" + std::to_string(k), mup::Variable(&values.back()));
    }
    for (std::size_t v = 0; v < dims.size(); ++v) {
      values.emplace_back(dims[v]);
      parser.DefineVar("_v" + std::to_string(v), mup::Variable(&values.back()));
    }
    parser.SetExpr(expression);
    return parser.Eval().GetFloat();
  } catch (const mup::ParserError& e) {
    throw std::runtime_error("xpm: muparserx could not evaluate formula '" + canonical_ +
                             "': " + e.GetMsg());
  }
}

std::vector<double> CostFormula::dims_from_map(const std::map<std::string, double>& dims,
                                               const std::string& where) const {
  std::vector<double> out;
  out.reserve(variable_names_.size());
  for (const std::string& name : variable_names_) {
    const auto it = dims.find(name);
    if (it == dims.end()) {
      throw std::invalid_argument("xpm: " + where + " is missing variable '" + name +
                                  "' of formula '" + canonical_ +
                                  "' (variables: " + join(variable_names_) + ")");
    }
    out.push_back(it->second);
  }
  for (const auto& entry : dims) {
    if (out.size() == dims.size()) break;  // all names matched: no extras
    bool declared = false;
    for (const std::string& name : variable_names_) declared = declared || name == entry.first;
    if (!declared) {
      throw std::invalid_argument("xpm: " + where + " has '" + entry.first +
                                  "', which is not a variable of formula '" + canonical_ +
                                  "' (variables: " + join(variable_names_) + ")");
    }
  }
  return out;
}

}  // namespace xpm
