// formula_ast.hpp — private to xpm::planner: tokenizer, parser, AST and polynomial expansion
// behind xpm::CostFormula. Grammar and canonical form: docs/formula.md.
//
//   auto root = formula_ast::parse("a*bs*(l-1)");                  // AST, spans into the text
//   auto terms = formula_ast::expand(root, {"a"}, {"bs", "l"});     // a*bs*l, -a*bs (sorted)
//   formula_ast::print(terms, {"a"}, {"bs", "l"});                  // "a*bs*l - a*bs"
//
// Everything here throws xpm::FormulaError for a bad formula, never anything else (besides
// std::bad_alloc).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "xpm/planner/formula.hpp"

namespace xpm::formula_ast {

// Limits that keep hostile input from exhausting the stack or memory.
inline constexpr int kMaxNesting = 200;         // parentheses, unary signs and powers, nested
inline constexpr int kMaxDegree = 32;           // total variable degree of one expanded term
inline constexpr std::size_t kMaxTerms = 4096;  // terms of the expanded polynomial

struct Token {
  enum class Kind { number, name, plus, minus, star, slash, power, lparen, rparen, end };
  Kind kind = Kind::end;
  std::size_t position = 0;  // 0-based offset of the token's first character
  std::string text;          // as written ("**" and "^" are both Kind::power)
  double value = 0.0;        // Kind::number only
};

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
  };
  Kind kind = Kind::number;
  std::size_t position = 0;  // the token (number, name, unary '-') or the first operator
  std::size_t begin = 0;     // source span [begin, end) of the whole node
  std::size_t end = 0;
  std::string text;  // number literal, name, or operator as written
  double value = 0.0;
  std::vector<Node> children;
  std::vector<char> ops;                  // sum and product: one per child
  std::vector<std::size_t> op_positions;  // sum and product: one per child
};

/// Parses `text` (see docs/formula.md for the grammar). Throws FormulaError for an empty
/// formula, a syntax error or too deep nesting; names are not checked here.
Node parse(const std::string& text);

/// Expands `root` into a sum of monomials with like terms combined and zero terms dropped, in
/// canonical order. Throws FormulaError for an undeclared name, a term with two coefficients,
/// a coefficient used non-linearly, division by a non-constant or by zero, a bad exponent, or a
/// value out of range. `text` is the source, used to quote spans in errors.
std::vector<Monomial> expand(const Node& root, const std::string& text,
                             const std::vector<std::string>& coefficient_names,
                             const std::vector<std::string>& variable_names);

/// Prints monomials (as returned by expand) in canonical form; "0" when there are none.
std::string print(const std::vector<Monomial>& monomials,
                  const std::vector<std::string>& coefficient_names,
                  const std::vector<std::string>& variable_names);

/// Shortest text that reads back as exactly `value` (finite, >= 0): integers below 1e15 in
/// plain digits ("2", "1000000"), others the shortest of fixed or scientific ("0.5", "1e20",
/// "1.5e-7").
std::string format_number(double value);

}  // namespace xpm::formula_ast
