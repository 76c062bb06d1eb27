// formula_ast.hpp — private to xpm::planner: tokenizer, parser, AST, expansion into a canonical
// sum of terms, canonical printing and evaluation behind xpm::CostFormula (formula_lexer.cpp,
// formula_parser.cpp, formula_expander.cpp, formula_evaluator.cpp). Grammar and canonical form:
// docs/formula.md.
//
//   auto root = formula_ast::parse("a*bs*(l-1)");                       // AST, spans into the text
//   auto e = formula_ast::expand(root, "a*bs*(l-1)", {"a"}, {"bs", "l"}, false);
//   formula_ast::print(e->terms, {"a"}, {"bs", "l"});                   // "a*bs*l - a*bs"
//   formula_ast::value(e->terms, {2.0}, {4, 128});                      // 2*4*128 - 2*4
//
// Everything here throws xpm::FormulaError for a bad formula (without the formula text; the
// caller adds it), never anything else (besides std::bad_alloc).
#pragma once

#include <cstddef>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "xpm/planner/formula.hpp"

namespace xpm::formula_ast {

// Limits that keep hostile input from exhausting the stack or memory.
inline constexpr int kMaxNesting = 200;         // parentheses, unary signs, powers, max(), nested
inline constexpr int kMaxDegree = 32;           // total variable degree of one expanded term, and
                                                // the largest |power| of a coefficient or factor
inline constexpr std::size_t kMaxTerms = 4096;  // terms of one expanded sum
inline constexpr std::size_t kMaxFactorText = std::size_t{1} << 20;  // canonical text of a factor

struct Token {
  enum class Kind { number, name, plus, minus, star, slash, power, lparen, rparen, comma, end };
  Kind kind = Kind::end;
  std::size_t position = 0;  // 0-based offset of the token's first character
  std::string text;          // as written ("**" and "^" are both Kind::power)
  double value = 0.0;        // Kind::number only
};

/// Throws FormulaError(message, position, symbol): the error of every stage of reading a formula.
[[noreturn]] void fail(const std::string& message, std::size_t position, std::string symbol);

/// Splits `text` into tokens, the last one Kind::end at text.size(). Throws FormulaError for a
/// bad number ("1e", "1.2.3", "2bs", "1e999") or a character outside the grammar.
std::vector<Token> tokenize(const std::string& text);

/// One AST node. Sums and products are n-ary so long formulas do not nest deeply.
struct Node {
  enum class Kind {
    number,   // value
    name,     // text
    negate,   // -children[0]
    sum,      // children[0] ops[1] children[1] ...; ops[i] is '+' or '-' (ops[0] unused)
    product,  // children[0] ops[1] children[1] ...; ops[i] is '*' or '/' (ops[0] unused)
    power,    // children[0] ^ children[1]
    call,     // text(children...): max(e1, e2, ...), two arguments or more
  };
  Kind kind = Kind::number;
  std::size_t position = 0;  // the token (number, name, unary '-', function) or first operator
  std::size_t begin = 0;     // source span [begin, end) of the whole node
  std::size_t end = 0;
  std::string text;  // number literal, name, function name, or operator as written
  double value = 0.0;
  std::vector<Node> children;
  std::vector<char> ops;                  // sum and product: one per child
  std::vector<std::size_t> op_positions;  // sum and product: one per child
};

/// Parses `text` (see docs/formula.md for the grammar). Throws FormulaError for an empty
/// formula, a syntax error or too deep nesting; names are not checked here.
Node parse(const std::string& text);

// ---------------------------------------------------------------------------------------------
// Canonical expression: a sum of terms, each factor * prod(coefficient^p) * prod(variable^p) *
// prod(opaque factor^p). Opaque factors are max(...), a power that does not expand into a
// polynomial (l^p, l^1.5) and a sum in a divisor ((a + b) in bs/(a + b)).

struct Factor;
using FactorPtr = std::shared_ptr<const Factor>;

struct Term {
  double factor = 1.0;                            // numeric factor, nonzero
  std::vector<int> coefficient_powers;            // one per coefficient, declared order
  std::vector<int> variable_powers;               // one per variable, declared order (>= 0)
  std::vector<std::pair<FactorPtr, int>> factors; // sorted by Factor::text, powers nonzero
};
using Sum = std::vector<Term>;  // canonical order; empty is 0

struct Factor {
  enum class Kind {
    max,    // max(operands...), operands sorted by their canonical text, two or more
    power,  // operands[0] ^ operands[1]
    group,  // (operands[0]), a sum of coefficients in a divisor
  };
  Kind kind = Kind::max;
  std::string text;                // canonical text: "max(a*bs, c)", "l^p", "(a + b)"
  std::vector<Sum> operands;
  std::set<int> coefficients;      // declared indices of the coefficients inside
  std::set<int> variables;         // declared indices of the variables inside
};

struct Expression {
  Sum terms;
  /// True when every term is linear in at most one coefficient and there is no opaque factor:
  /// then the formula is sum_k coefficient_k * basis_k(dims) + offset(dims).
  bool linear = true;
};

/// Expands `root` into a canonical sum: like terms combined, zero terms dropped, max()
/// arguments canonicalized, flattened, deduplicated and sorted. Throws FormulaError for an
/// undeclared name, a bad exponent, division by a variable or by zero, a value out of range, and
/// (unless `allow_nonlinear`) a term with two coefficients or a coefficient used non-linearly.
/// `text` is the source, used to quote spans in errors.
std::shared_ptr<const Expression> expand(const Node& root, const std::string& text,
                                         const std::vector<std::string>& coefficient_names,
                                         const std::vector<std::string>& variable_names,
                                         bool allow_nonlinear);

/// Prints a canonical sum; "0" when it has no term.
std::string print(const Sum& terms, const std::vector<std::string>& coefficient_names,
                  const std::vector<std::string>& variable_names);

/// The value of a sum at `coefficients` (declared order) and `dims` (declared order). Sizes are
/// the caller's to check.
double value(const Sum& terms, const std::vector<double>& coefficients,
             const std::vector<double>& dims);

/// base^exponent by repeated multiplication (exact for the small integer powers of terms);
/// 1 / base^-exponent for a negative exponent.
inline double integer_power(double base, int exponent) {
  if (exponent < 0) return 1.0 / integer_power(base, -exponent);
  double out = 1.0;
  for (int k = 0; k < exponent; ++k) out *= base;
  return out;
}

/// The value of a sum with every opaque factor valued by `factor_value(factor)`: value() values
/// them as written; the fit's start resolves some max() factors to one argument.
template <class FactorValue>
double sum_value(const Sum& terms, const std::vector<double>& coefficients, const std::vector<double>& dims,
                 FactorValue&& factor_value) {
  double out = 0.0;
  for (const Term& t : terms) {
    double v = t.factor;
    for (std::size_t c = 0; c < t.coefficient_powers.size(); ++c) {
      if (t.coefficient_powers[c] != 0) v *= integer_power(coefficients[c], t.coefficient_powers[c]);
    }
    for (std::size_t d = 0; d < t.variable_powers.size(); ++d) {
      if (t.variable_powers[d] != 0) v *= integer_power(dims[d], t.variable_powers[d]);
    }
    for (const auto& [factor, power] : t.factors) v *= integer_power(factor_value(*factor), power);
    out += v;
  }
  return out;
}

/// Shortest text that reads back as exactly `value` (finite, >= 0): integers below 1e15 in
/// plain digits ("2", "1000000"), others the shortest of fixed or scientific ("0.5", "1e20",
/// "1.5e-7").
std::string format_number(double value);

}  // namespace xpm::formula_ast
