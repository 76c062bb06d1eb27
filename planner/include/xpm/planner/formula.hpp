// xpm/planner/formula.hpp — cost formulas for peak memory, e.g. `a*bs*l^2 + b*bs*l + c`.
//
// A CostFormula is an expression in declared *variables* (dims such as `bs`, `l`) and declared
// *coefficients* (fitted later, in bytes per unit of the term). It is parsed into a small AST of
// our own, expanded and printed in one canonical form, so equivalent spellings give one
// canonical string and one identity hash:
//
//   CostFormula f("a*bs*l**2 + b*bs*(l-1) + c", {"a", "b", "c"}, {"bs", "l"});
//   // or CostFormula::with_variables("a*bs*l**2 + b*bs*(l-1) + c", {"bs", "l"}): a, b, c found
//   f.canonical();                      // "a*bs*l^2 + b*bs*l - b*bs + c"
//   f.is_linear();                      // true: sum_k coefficient_k * basis_k(dims) + offset
//   f.basis({4, 128});                  // {4*128^2, 4*128-4, 1}  (per coefficient, declared order)
//   f.evaluate({2.0, 3.0, 1e6}, {4, 128});  // evaluated by muparserx on the canonical string
//   f.identity_hash();                  // 16 hex digits, stable across runs and platforms
//
//   CostFormulaOptions nonlinear;
//   nonlinear.allow_nonlinear = true;
//   CostFormula g("max(c, a*bs*l^p)", {"a", "c", "p"}, {"bs", "l"}, nonlinear);
//   g.is_linear();                      // false: fit it with the non-linear (Ceres) fit
//   g.predict({3.0, 1e6, 1.7}, {4, 128});
//
// Grammar: numbers, declared names, + - * / (division by a numeric constant), ^ and ** (non-
// negative integer exponents), parentheses, unary minus, max(e1, e2, ...). With
// CostFormulaOptions::allow_nonlinear, terms non-linear in a coefficient too (a*b*bs, a^2,
// bs/a, l^p, l^1.5). docs/formula.md has the grammar, the canonical form and examples.
// Errors throw FormulaError with the 0-based position in the source text, the offending
// symbol, and a caret line under the formula: undeclared symbol, term with two coefficients,
// coefficient not linear (a^2, a*a, a/..., a in an exponent) without allow_nonlinear, empty
// formula, syntax errors.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace xpm {

namespace formula_ast {
struct Expression;  // private: the canonical expression (planner/src/formula_ast.hpp)
}

/// A parse or validation error in a cost formula. `position()` is the 0-based character
/// offset into the formula text (or std::string::npos when not tied to a position);
/// `symbol()` is the offending token ("" when none). what() is brief() and, when the formula
/// text is known and the error has a position, a caret line under the formula:
///
///   formula error at column 8 (symbol 'x'): undeclared symbol (...)
///     a*bs + x
///            ^
///
/// Command lines that print errors on one line print brief().
class FormulaError : public std::invalid_argument {
 public:
  /// `formula_text` "" leaves out the caret line (CostFormula always passes its text).
  FormulaError(const std::string& message, std::size_t position, std::string symbol,
               std::string formula_text = "");
  std::size_t position() const { return position_; }
  const std::string& symbol() const { return symbol_; }
  /// The message alone: "undeclared symbol (neither a declared coefficient nor ...)".
  const std::string& message() const { return message_; }
  /// The first line of what(): "formula error at column 8 (symbol 'x'): undeclared symbol ...".
  const std::string& brief() const { return brief_; }
  /// The formula the error is about; "" when not known.
  const std::string& formula_text() const { return formula_text_; }

 private:
  std::size_t position_;
  std::string symbol_;
  std::string message_;
  std::string brief_;
  std::string formula_text_;
};

/// Options of CostFormula (plain struct).
struct CostFormulaOptions {
  /// Accept terms non-linear in a coefficient (a*b*bs, a^2, bs/a, l^p, l^1.5), fitted by the
  /// non-linear fit. Off: such terms are a FormulaError, as a linear fit needs.
  bool allow_nonlinear = false;
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
  /// Parses `text`. Names must be identifiers ([A-Za-z_][A-Za-z0-9_]*), unique, not `max`, and
  /// a name may not be both a coefficient and a variable (std::invalid_argument otherwise).
  /// Throws FormulaError for the formula errors listed in the file comment.
  CostFormula(const std::string& text, std::vector<std::string> coefficient_names,
              std::vector<std::string> variable_names, CostFormulaOptions options = {});
  /// The same with the coefficients found in `text` (coefficient_names_in: every name that is
  /// not a variable, in order of first use): with_variables("a*bs*l + b*bs + c", {"bs", "l"})
  /// declares a, b, c. Throws like the constructor.
  static CostFormula with_variables(const std::string& text, std::vector<std::string> variable_names,
                                    CostFormulaOptions options = {});

  const std::string& text() const { return text_; }            // as given
  const std::string& canonical() const { return canonical_; }  // see docs/formula.md
  const std::vector<std::string>& coefficient_names() const { return coefficient_names_; }
  const std::vector<std::string>& variable_names() const { return variable_names_; }
  const CostFormulaOptions& options() const { return options_; }

  /// True when the formula is a sum of terms each linear in at most one coefficient, without
  /// max(): then formula = sum_k coefficients[k] * basis(dims)[k] + offset(dims) and the
  /// linear fit applies. False for max(...) and for non-linear terms (allow_nonlinear).
  bool is_linear() const { return linear_; }

  /// Stable identity of the formula: 16 lowercase hex digits, the 64-bit FNV-1a hash of the
  /// canonical string, the sorted coefficient and variable names, and is_linear(). Equal for
  /// equivalent inputs (spelling, term order, declaration order of the names, allow_nonlinear
  /// for a formula that is linear anyway), different otherwise. Same on every run and platform.
  std::string identity_hash() const;

  /// Expanded monomials in canonical order. Throws std::logic_error when !is_linear().
  const std::vector<Monomial>& monomials() const;

  /// Index of a variable in variable_names(); throws std::invalid_argument naming it if absent.
  std::size_t variable_index(const std::string& name) const;

  /// Per-coefficient basis at `dims` (variable_names() order): the formula equals
  /// sum_k coefficients[k] * basis(dims)[k] + offset(dims). Size = coefficient count.
  /// Throws std::invalid_argument if dims.size() != variable count, std::logic_error when
  /// !is_linear().
  std::vector<double> basis(const std::vector<double>& dims) const;
  /// Sum of the terms without a coefficient at `dims`. Throws like basis().
  double offset(const std::vector<double>& dims) const;
  /// Fast evaluation from the expanded form (used on hot paths such as packers); any formula.
  double predict(const std::vector<double>& coefficients, const std::vector<double>& dims) const;
  /// Evaluation of the canonical string by muparserx (the authoritative value, which predict()
  /// is tested against); any formula.
  double evaluate(const std::vector<double>& coefficients, const std::vector<double>& dims) const;

  /// Orders a name->value map by variable_names(). Throws std::invalid_argument naming the
  /// variable that is missing from `dims` or the name in `dims` that is not a declared variable;
  /// `where` is put in the message (e.g. "probe point 3").
  std::vector<double> dims_from_map(const std::map<std::string, double>& dims,
                                    const std::string& where = "dims") const;

  /// The canonical expression tree. Its type is private to xpm::planner
  /// (planner/src/formula_ast.hpp): for the planner's own algorithms (e.g. the automatic start
  /// of non-linear fits), not an API for embedders.
  const formula_ast::Expression& expression() const { return *expression_; }

 private:
  std::string text_;
  std::string canonical_;
  std::vector<std::string> coefficient_names_;
  std::vector<std::string> variable_names_;
  CostFormulaOptions options_;
  bool linear_ = true;
  std::vector<Monomial> monomials_;                          // linear formulas only
  std::shared_ptr<const formula_ast::Expression> expression_;  // every formula
};

/// The names in `text` that are neither variables nor functions (a name followed by '('), in
/// order of first use: the default coefficient list of a formula ("a*bs*l^2 + b*bs*l + c" with
/// variables {bs, l} -> {a, b, c}; "1e5" is a number, not a name). Throws FormulaError for a
/// character or number the formula language does not take.
std::vector<std::string> coefficient_names_in(const std::string& text,
                                              const std::vector<std::string>& variable_names);

}  // namespace xpm
