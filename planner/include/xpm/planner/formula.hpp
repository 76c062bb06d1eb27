// xpm/planner/formula.hpp — cost formulas for peak memory, e.g. `a*bs*l^2 + b*bs*l + c`.
//
// A CostFormula is a polynomial in declared *variables* (dims such as `bs`, `l`) whose every
// term is linear in at most one declared *coefficient* (fitted later, in bytes per unit of the
// term). It is parsed into a small AST of our own, expanded into a sum of monomials and printed
// in one canonical form, so equivalent spellings give one canonical string:
//
//   CostFormula f("a*bs*l**2 + b*bs*(l-1) + c", {"a", "b", "c"}, {"bs", "l"});
//   f.canonical();                      // "a*bs*l^2 + b*bs*l - b*bs + c"
//   f.basis({4, 128});                  // {4*128^2, 4*128-4, 1}  (per coefficient, declared order)
//   f.evaluate({2.0, 3.0, 1e6}, {4, 128});  // evaluated by muparserx on the canonical string
//
// Grammar (issue 2): numbers, declared names, + - * / (division by a numeric constant only),
// ^ and ** (non-negative integer exponents), parentheses, unary minus.
// Errors throw FormulaError with the 0-based position in the source text and the offending
// symbol: undeclared symbol, term with two coefficients, coefficient not linear (a^2, a*a,
// a/..., a in an exponent), empty formula, syntax errors.
#pragma once

#include <cstddef>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace xpm {

/// A parse or validation error in a cost formula. `position()` is the 0-based character
/// offset into the formula text (or std::string::npos when not tied to a position);
/// `symbol()` is the offending token ("" when none). what() reads like
/// "formula error at column 5 (symbol 'x'): undeclared symbol".
class FormulaError : public std::invalid_argument {
 public:
  FormulaError(const std::string& message, std::size_t position, std::string symbol);
  std::size_t position() const { return position_; }
  const std::string& symbol() const { return symbol_; }

 private:
  std::size_t position_;
  std::string symbol_;
};

/// One expanded monomial: factor * coefficient? * prod(variable_i ^ powers[i]).
struct Monomial {
  double factor = 1.0;          // numeric factor
  int coefficient = -1;         // index into coefficient_names(), -1 for a constant-offset term
  std::vector<int> powers;      // one exponent per variable, variable_names() order
};

/// A parsed, canonicalized cost formula. Immutable and cheap to copy; thread-safe to read.
class CostFormula {
 public:
  /// Parses `text`. Names must be identifiers ([A-Za-z_][A-Za-z0-9_]*), unique, and a name
  /// may not be both a coefficient and a variable (std::invalid_argument otherwise).
  /// Throws FormulaError for the formula errors listed in the file comment.
  CostFormula(const std::string& text, std::vector<std::string> coefficient_names,
              std::vector<std::string> variable_names);

  const std::string& text() const { return text_; }            // as given
  const std::string& canonical() const { return canonical_; }  // see docs/formula.md
  const std::vector<std::string>& coefficient_names() const { return coefficient_names_; }
  const std::vector<std::string>& variable_names() const { return variable_names_; }
  const std::vector<Monomial>& monomials() const { return monomials_; }  // canonical order

  /// Index of a variable in variable_names(); throws std::invalid_argument naming it if absent.
  std::size_t variable_index(const std::string& name) const;

  /// Per-coefficient basis at `dims` (variable_names() order): the formula equals
  /// sum_k coefficients[k] * basis(dims)[k] + offset(dims). Size = coefficient count.
  /// Throws std::invalid_argument if dims.size() != variable count.
  std::vector<double> basis(const std::vector<double>& dims) const;
  /// Sum of the terms without a coefficient at `dims`.
  double offset(const std::vector<double>& dims) const;
  /// Fast evaluation from the expanded monomials (used on hot paths such as packers).
  double predict(const std::vector<double>& coefficients, const std::vector<double>& dims) const;
  /// Evaluation of the canonical string by muparserx (the reference evaluation).
  double evaluate(const std::vector<double>& coefficients, const std::vector<double>& dims) const;

  /// Orders a name->value map by variable_names(). Throws std::invalid_argument naming the
  /// variable that is missing from `dims` or the name in `dims` that is not a declared variable;
  /// `where` is put in the message (e.g. "probe point 3").
  std::vector<double> dims_from_map(const std::map<std::string, double>& dims,
                                    const std::string& where = "dims") const;

 private:
  std::string text_;
  std::string canonical_;
  std::vector<std::string> coefficient_names_;
  std::vector<std::string> variable_names_;
  std::vector<Monomial> monomials_;
};

}  // namespace xpm
