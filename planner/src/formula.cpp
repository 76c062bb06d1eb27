// formula.cpp — xpm::CostFormula and xpm::FormulaError. Parsing and canonical printing live
// behind formula_ast.hpp (lexer, parser, expander, evaluator); evaluate() hands the canonical
// string to muparserx.
#include <algorithm>
#include "xpm/planner/formula.hpp"
#include "xpm/planner/stable_hash.hpp"

#include <muparserx/mpParser.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
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

// The formula on one line (whitespace shown as blanks) and a caret under byte `position`,
// both indented by two blanks. Long formulas are cut to a window around the position. The
// caret counts UTF-8 characters, not bytes, so it sits under the right character.
std::string caret_lines(const std::string& text, std::size_t position) {
  constexpr std::size_t kWindow = 100;
  const auto is_continuation = [&text](std::size_t i) {
    return i < text.size() && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80;
  };
  position = std::min(position, text.size());
  std::size_t begin = 0;
  std::size_t end = text.size();
  if (text.size() > kWindow) {
    begin = position > kWindow / 2 ? position - kWindow / 2 : 0;
    end = std::min(text.size(), begin + kWindow);
    while (begin > 0 && is_continuation(begin)) --begin;
    while (end < text.size() && is_continuation(end)) ++end;
  }
  std::string line = begin > 0 ? "..." : "";
  std::size_t caret = line.size();
  for (std::size_t i = begin; i < end; ++i) {
    const char c = text[i];
    const bool blank = c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
    line += blank ? ' ' : c;
    if (i < position && !is_continuation(i)) ++caret;
  }
  if (end < text.size()) line += "...";
  return "\n  " + line + "\n  " + std::string(caret, ' ') + "^";
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
    if (name == "max") {
      throw std::invalid_argument(std::string("xpm: ") + kind +
                                  " name 'max' is reserved for the max(...) function");
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

using formula_ast::integer_power;

std::vector<std::string> sorted(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  return names;
}

double term_value(const Monomial& m, const std::vector<double>& dims) {
  double value = m.factor;
  for (std::size_t v = 0; v < dims.size(); ++v) value *= integer_power(dims[v], m.powers[v]);
  return value;
}

// For an error about a coefficient: that the name is read as a coefficient, the variables, and
// the variable it differs from only in case ("L" for "l"); "" for any other symbol.
std::string coefficient_hint(const std::string& symbol, const std::vector<std::string>& coefficient_names,
                             const std::vector<std::string>& variable_names) {
  if (std::find(coefficient_names.begin(), coefficient_names.end(), symbol) == coefficient_names.end()) return "";
  const auto lower = [](std::string text) {
    for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return text;
  };
  std::string hint = " ('" + symbol + "' is read as a coefficient, not a variable; the variables are " +
                     join(variable_names);
  for (const std::string& variable : variable_names) {
    if (lower(variable) == lower(symbol)) hint += "; names are case-sensitive: did you mean '" + variable + "'?";
  }
  return hint + ")";
}

}  // namespace

FormulaError::FormulaError(const std::string& message, std::size_t position, std::string symbol,
                           std::string formula_text)
    : std::invalid_argument(describe(message, position, symbol) +
                            (formula_text.empty() || position == std::string::npos
                                 ? std::string()
                                 : caret_lines(formula_text, position))),
      position_(position),
      symbol_(std::move(symbol)),
      message_(message),
      brief_(describe(message, position, symbol_)),
      formula_text_(std::move(formula_text)) {}

CostFormula CostFormula::with_variables(const std::string& text, std::vector<std::string> variable_names,
                                        CostFormulaOptions options) {
  std::vector<std::string> coefficient_names = coefficient_names_in(text, variable_names);
  return CostFormula(text, std::move(coefficient_names), std::move(variable_names), options);
}

CostFormula::CostFormula(const std::string& text, std::vector<std::string> coefficient_names,
                         std::vector<std::string> variable_names, CostFormulaOptions options)
    : text_(text),
      coefficient_names_(std::move(coefficient_names)),
      variable_names_(std::move(variable_names)),
      options_(options) {
  check_names(coefficient_names_, variable_names_);
  try {
    const formula_ast::Node root = formula_ast::parse(text_);
    expression_ = formula_ast::expand(root, text_, coefficient_names_, variable_names_,
                                      options_.allow_nonlinear);
  } catch (const FormulaError& e) {
    const std::string hint = coefficient_hint(e.symbol(), coefficient_names_, variable_names_);
    if (!e.formula_text().empty() && hint.empty()) throw;
    throw FormulaError(e.message() + hint, e.position(), e.symbol(), text_);
  }
  canonical_ = formula_ast::print(expression_->terms, coefficient_names_, variable_names_);
  linear_ = expression_->linear;
  if (linear_) {
    monomials_.reserve(expression_->terms.size());
    for (const formula_ast::Term& t : expression_->terms) {
      Monomial m;
      m.factor = t.factor;
      for (std::size_t k = 0; k < t.coefficient_powers.size(); ++k) {
        if (t.coefficient_powers[k] != 0) m.coefficient = static_cast<int>(k);
      }
      m.powers = t.variable_powers;
      monomials_.push_back(std::move(m));
    }
  }
}

std::string CostFormula::identity_hash() const {
  std::string key = "xpm-cost-formula-v1\ncanonical=" + canonical_ + "\ncoefficients=";
  for (const std::string& name : sorted(coefficient_names_)) key += name + ",";
  key += "\nvariables=";
  for (const std::string& name : sorted(variable_names_)) key += name + ",";
  key += linear_ ? "\nmode=linear" : "\nmode=nonlinear";
  return stable_hash_hex(key);
}

namespace {

[[noreturn]] void throw_not_linear(const std::string& canonical, const char* what) {
  throw std::logic_error("xpm: " + std::string(what) + " needs a formula linear in its " +
                         "coefficients, and '" + canonical + "' is not (it has max(...) or a " +
                         "term non-linear in a coefficient); fit it with the non-linear fit, " +
                         "evaluate it with predict()");
}

}  // namespace

const std::vector<Monomial>& CostFormula::monomials() const {
  if (!linear_) throw_not_linear(canonical_, "monomials()");
  return monomials_;
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
  if (!linear_) throw_not_linear(canonical_, "basis()");
  check_dims(dims, variable_names_, canonical_);
  std::vector<double> out(coefficient_names_.size(), 0.0);
  for (const Monomial& m : monomials_) {
    if (m.coefficient >= 0) out[static_cast<std::size_t>(m.coefficient)] += term_value(m, dims);
  }
  return out;
}

double CostFormula::offset(const std::vector<double>& dims) const {
  if (!linear_) throw_not_linear(canonical_, "offset()");
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
  if (!linear_) return formula_ast::value(expression_->terms, coefficients, dims);
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
  // so names that muparserx reserves (e, pi, sin, true, ...) still evaluate as ours. `max` is
  // muparserx's own max(...) (package pckCOMMON), which takes any number of arguments.
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
    if (!found) expression += token.text;  // max
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

std::vector<std::string> coefficient_names_in(const std::string& text,
                                              const std::vector<std::string>& variable_names) {
  std::vector<formula_ast::Token> tokens;
  try {
    tokens = formula_ast::tokenize(text);
  } catch (const FormulaError& e) {
    throw FormulaError(e.message(), e.position(), e.symbol(), text);  // with the caret line
  }
  std::vector<std::string> names;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const formula_ast::Token& token = tokens[i];
    if (token.kind != formula_ast::Token::Kind::name) continue;
    const bool function = i + 1 < tokens.size() && tokens[i + 1].kind == formula_ast::Token::Kind::lparen;
    const bool variable =
        std::find(variable_names.begin(), variable_names.end(), token.text) != variable_names.end();
    if (!function && !variable && std::find(names.begin(), names.end(), token.text) == names.end()) {
      names.push_back(token.text);
    }
  }
  return names;
}

}  // namespace xpm
