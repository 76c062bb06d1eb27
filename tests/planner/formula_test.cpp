// Tests for xpm::CostFormula: canonical form, errors, evaluation (planner/src/formula*.cpp).
#include "xpm/planner/formula.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using xpm::CostFormula;
using xpm::FormulaError;

namespace {

const std::vector<std::string> kCoefficients = {"a", "b", "c"};
const std::vector<std::string> kVariables = {"bs", "l"};

std::string canonical(const std::string& text) {
  return CostFormula(text, kCoefficients, kVariables).canonical();
}

// The FormulaError that parsing `text` throws; fails the test if it throws nothing.
FormulaError formula_error(const std::string& text,
                           const std::vector<std::string>& coefficients = kCoefficients,
                           const std::vector<std::string>& variables = kVariables) {
  try {
    CostFormula formula(text, coefficients, variables);
  } catch (const FormulaError& e) {
    return e;
  }
  throw std::logic_error("expected a FormulaError for '" + text + "'");
}

std::string invalid_argument_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const FormulaError& e) {
    throw std::logic_error(std::string("expected std::invalid_argument, got FormulaError: ") +
                           e.what());
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  throw std::logic_error("expected std::invalid_argument");
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("the header example canonicalizes and has the documented basis") {
  const CostFormula f("a*bs*l**2 + b*bs*(l-1) + c", kCoefficients, kVariables);
  CHECK(f.canonical() == "a*bs*l^2 + b*bs*l - b*bs + c");
  CHECK(f.text() == "a*bs*l**2 + b*bs*(l-1) + c");
  CHECK(f.basis({4, 128}) == std::vector<double>{4.0 * 128 * 128, 4.0 * 128 - 4, 1.0});
  CHECK(f.offset({4, 128}) == 0.0);
  CHECK(f.evaluate({2.0, 3.0, 1e6}, {4, 128}) ==
        doctest::Approx(2.0 * 4 * 128 * 128 + 3.0 * (4 * 128 - 4) + 1e6));
}

TEST_CASE("equivalent spellings give one canonical string") {
  SUBCASE("** and ^ are the same power") {
    CHECK(canonical("a*bs*l**2") == "a*bs*l^2");
    CHECK(canonical("a*bs*l^2") == "a*bs*l^2");
  }
  SUBCASE("spacing does not matter") {
    CHECK(canonical("a * bs * l ** 2") == "a*bs*l^2");
    CHECK(canonical(" a*bs*l^2\t+\nc ") == "a*bs*l^2 + c");
    CHECK(canonical("a*bs*l^2+c") == "a*bs*l^2 + c");
  }
  SUBCASE("term order does not matter") {
    CHECK(canonical("c + b*bs + a*bs*l^2") == "a*bs*l^2 + b*bs + c");
    CHECK(canonical("b*bs + c + a*bs*l^2") == "a*bs*l^2 + b*bs + c");
    CHECK(canonical("a*bs + a*bs*l^2") == "a*bs*l^2 + a*bs");
    CHECK(canonical("a*l^2 + a*bs^2 + a*bs*l") == "a*bs^2 + a*bs*l + a*l^2");
  }
  SUBCASE("factor order does not matter") {
    CHECK(canonical("2*a*bs") == "2*a*bs");
    CHECK(canonical("a*bs*2") == "2*a*bs");
    CHECK(canonical("bs*(2*a)") == "2*a*bs");
    CHECK(canonical("l*l*bs*a") == "a*bs*l^2");
    CHECK(canonical("l^2*bs*a") == "a*bs*l^2");
  }
  SUBCASE("products of sums are expanded") {
    CHECK(canonical("a*bs*(l-1)") == "a*bs*l - a*bs");
    CHECK(canonical("(l-1)*bs*a") == "a*bs*l - a*bs");
    CHECK(canonical("a*(bs+l)^2") == "a*bs^2 + 2*a*bs*l + a*l^2");
    CHECK(canonical("(a + b)*bs") == "a*bs + b*bs");
  }
  SUBCASE("like terms combine and zero terms vanish") {
    CHECK(canonical("a*bs + bs*a") == "2*a*bs");
    CHECK(canonical("a*bs - a*bs + c") == "c");
    CHECK(canonical("bs - bs") == "0");
    CHECK(canonical("0*a*bs + c") == "c");
    CHECK(canonical("a*bs/2") == "0.5*a*bs");
    CHECK(canonical("a/4*bs + a*bs/4") == "0.5*a*bs");
  }
  SUBCASE("terms without a coefficient are offset terms, printed last") {
    CHECK(canonical("bs*l + a*bs + 3") == "a*bs + bs*l + 3");
    CHECK(canonical("2 + 3") == "5");
    CHECK(canonical("l - 4*bs^2") == "-4*bs^2 + l");
  }
  SUBCASE("unary minus binds looser than a power") {
    CHECK(canonical("-bs^2*a") == "-a*bs^2");
    CHECK(canonical("(-bs)^2*a") == "a*bs^2");
    CHECK(canonical("-2^2*c") == "-4*c");
    CHECK(canonical("a*-bs") == "-a*bs");
    CHECK(canonical("--a + +b") == "a + b");
  }
  SUBCASE("powers are right-associative and constant powers fold") {
    CHECK(canonical("2^3^2*c") == "512*c");
    CHECK(canonical("a*bs^2^2") == "a*bs^4");
    CHECK(canonical("a*bs^0 + b*l^1") == "a + b*l");
    CHECK(canonical("a*bs^(3-1)") == "a*bs^2");
  }
  SUBCASE("numbers print in their shortest round-trip form") {
    CHECK(canonical("1e6*c") == "1000000*c");
    CHECK(canonical("c*1.5e-7") == "1.5e-7*c");
    CHECK(canonical("1E20*c") == "1e20*c");
    CHECK(canonical("c/3") == "0.3333333333333333*c");
    CHECK(canonical(".25*c + 0.75*c") == "c");
  }
  SUBCASE("name order, not declaration order, decides the canonical string") {
    const CostFormula f("b*l + a*l*bs", {"b", "a"}, {"l", "bs"});
    CHECK(f.canonical() == "a*bs*l + b*l");
    CHECK(f.monomials().size() == 2);
    CHECK(f.monomials()[0].coefficient == 1);  // "a" is coefficient 1 in declared order
    CHECK(f.monomials()[0].powers == std::vector<int>{1, 1});
  }
}

TEST_CASE("the canonical string re-parses to itself") {
  for (const char* text : {"a*bs*l**2 + b*bs*(l-1) + c", "a*bs*(l-1)", "-bs^2*a + 3*c - 2",
                           "a*(bs+l)^3/7", "c*1.5e-7 - 1e20*b*l", "c/3 + a*bs*l/3", "bs - bs",
                           "0.1*a + 0.2*a + l*bs*l", "-(a*bs) - (b*l) - 1"}) {
    CAPTURE(text);
    const CostFormula once(text, kCoefficients, kVariables);
    const CostFormula twice(once.canonical(), kCoefficients, kVariables);
    CHECK(twice.canonical() == once.canonical());
    REQUIRE(twice.monomials().size() == once.monomials().size());
    for (std::size_t i = 0; i < once.monomials().size(); ++i) {
      CHECK(twice.monomials()[i].factor == once.monomials()[i].factor);
      CHECK(twice.monomials()[i].coefficient == once.monomials()[i].coefficient);
      CHECK(twice.monomials()[i].powers == once.monomials()[i].powers);
    }
  }
}

TEST_CASE("rejects a term with two coefficients") {
  const FormulaError e = formula_error("a*b*bs");
  CHECK(e.position() == 2);
  CHECK(e.symbol() == "b");
  CHECK(contains(e.what(), "two coefficients"));

  const FormulaError expanded = formula_error("(a + bs)*(l + c)");
  CHECK(expanded.position() == 14);
  CHECK(expanded.symbol() == "c");
}

TEST_CASE("rejects an undeclared symbol") {
  const FormulaError e = formula_error("a*bs + x*l");
  CHECK(e.position() == 7);
  CHECK(e.symbol() == "x");
  CHECK(contains(e.what(), "undeclared symbol"));

  const FormulaError suffixed = formula_error("a*bs2");
  CHECK(suffixed.position() == 2);
  CHECK(suffixed.symbol() == "bs2");
}

TEST_CASE("a variable mistyped as a coefficient is named as such, with the variable it resembles") {
  const CostFormula formula = CostFormula::with_variables("a*bs + c", {"bs", "l"});  // with_variables works
  CHECK(formula.coefficient_names() == std::vector<std::string>{"a", "c"});
  try {
    CostFormula::with_variables("a*bs*L^2 + b*bs*l + c", {"bs", "l"});
    FAIL("no error for a*bs*L^2");
  } catch (const FormulaError& e) {
    CHECK(e.symbol() == "L");
    CHECK(e.message() == "coefficient is not linear (raised to a power); a term must be linear in its coefficient "
                         "('L' is read as a coefficient, not a variable; the variables are bs, l; names are "
                         "case-sensitive: did you mean 'l'?)");
  }
  const FormulaError two = formula_error("a*b*bs");  // two coefficients: the variables named, no guess
  CHECK(contains(two.message(), "('b' is read as a coefficient, not a variable; the variables are bs, l)"));
}

TEST_CASE("rejects a coefficient used non-linearly") {
  SUBCASE("raised to a power") {
    const FormulaError e = formula_error("bs*a^2");
    CHECK(e.position() == 3);
    CHECK(e.symbol() == "a");
    CHECK(contains(e.what(), "not linear"));
  }
  SUBCASE("multiplied by itself") {
    const FormulaError e = formula_error("a*bs*a");
    CHECK(e.position() == 5);
    CHECK(e.symbol() == "a");
  }
  SUBCASE("in a divisor") {
    const FormulaError e = formula_error("bs/a");
    CHECK(e.position() == 3);
    CHECK(e.symbol() == "a");
  }
  SUBCASE("in an exponent") {
    const FormulaError e = formula_error("bs^a");
    CHECK(e.position() == 3);
    CHECK(e.symbol() == "a");
  }
  SUBCASE("but dividing a coefficient by a constant is linear") {
    CHECK(canonical("a/2*bs") == "0.5*a*bs");
    CHECK(canonical("a^1*bs + b^0") == "a*bs + 1");
  }
}

TEST_CASE("rejects an empty formula") {
  for (const char* text : {"", " ", " \t\n "}) {
    CAPTURE(text);
    const FormulaError e = formula_error(text);
    CHECK(e.position() == 0);
    CHECK(contains(e.what(), "empty formula"));
  }
}

TEST_CASE("rejects division by a non-constant") {
  const FormulaError e = formula_error("a*bs/l");
  CHECK(e.position() == 5);
  CHECK(e.symbol() == "l");
  CHECK(contains(e.what(), "division by a non-constant"));

  CHECK(canonical("a*bs/(l - l + 2)") == "0.5*a*bs");  // reduces to a constant

  const FormulaError zero = formula_error("a*bs/(l-l)");
  CHECK(zero.position() == 5);
  CHECK(zero.symbol() == "(l-l)");
  CHECK(contains(zero.what(), "division by zero"));
}

TEST_CASE("rejects syntax errors at their position") {
  struct Case {
    const char* text;
    std::size_t position;
    const char* symbol;
    const char* message;
  };
  for (const Case& c : {
           Case{"(a*bs", 0, "(", "never closed"},
           Case{"a*(bs + (l)", 2, "(", "never closed"},
           Case{"a*bs)", 4, ")", "no matching '('"},
           Case{"a*bs +", 5, "+", "end of the formula"},
           Case{"a*bs*", 4, "*", "end of the formula"},
           Case{"*a", 0, "*", "expected a number"},
           Case{"a*()", 3, ")", "expected a number"},
           Case{"a bs", 2, "bs", "expected an operator"},
           Case{"(a bs)", 3, "bs", "expected ')'"},
           Case{"1e*a", 0, "1e", "bad number"},
           Case{"1.2.3*a", 0, "1.2.3", "bad number"},
           Case{"2bs*a", 0, "2bs", "bad number"},
           Case{"1e999*a", 0, "1e999", "out of range"},
           Case{"a*bs $ l", 5, "$", "unexpected character"},
           Case{"a* *bs", 3, "*", "expected a number"},
           Case{"a*bs^1.5", 5, "1.5", "non-negative integer"},
           Case{"a*bs^-1", 5, "-1", "non-negative integer"},
           Case{"a*bs^l", 5, "l", "exponent must be a constant"},
       }) {
    CAPTURE(c.text);
    const FormulaError e = formula_error(c.text);
    CHECK(e.position() == c.position);
    CHECK(e.symbol() == c.symbol);
    CHECK_MESSAGE(contains(e.what(), c.message), e.what());
  }
}

TEST_CASE("rejects formulas that expand beyond the degree limit or nest too deeply") {
  CHECK(contains(formula_error("a*(bs+l)^40").what(), "degree"));
  CHECK(contains(formula_error("a*bs^2^2^2^2").what(), "degree"));
  CHECK(contains(formula_error(std::string(1000, '(') + "a" + std::string(1000, ')')).what(),
                 "nested too deeply"));
  CHECK(contains(formula_error("1e300*1e300*c").what(), "out of range"));
}

TEST_CASE("error message names the column and the symbol") {
  const FormulaError e = formula_error("a*bs + x*l");
  CHECK(std::string(e.what()).rfind("formula error at column 8 (symbol 'x'): undeclared symbol",
                                    0) == 0);
  CHECK(std::string(FormulaError("bad", std::string::npos, "").what()) == "formula error: bad");
  CHECK(std::string(FormulaError("bad", 0, "").what()) == "formula error at column 1: bad");
  const std::invalid_argument& base = e;  // a FormulaError is an invalid_argument
  CHECK(contains(base.what(), "column 8"));
}

TEST_CASE("rejects declared names that are not identifiers, repeated, or both kinds") {
  CHECK(contains(invalid_argument_message([] { CostFormula("a", {"a", "1x"}, {"bs"}); }), "1x"));
  CHECK(contains(invalid_argument_message([] { CostFormula("a", {"a"}, {"bs", "bs"}); }), "bs"));
  CHECK(contains(invalid_argument_message([] { CostFormula("a", {"a"}, {"a"}); }), "'a'"));
  CHECK(contains(invalid_argument_message([] {
                   CostFormula("a", {"a", ""}, {});
                 }),
                 "not an identifier"));
}

TEST_CASE("dims_from_map orders dims and rejects a probe whose variables don't match") {
  const CostFormula f("a*bs*l + b*l", {"a", "b"}, {"l", "bs"});
  CHECK(f.dims_from_map({{"bs", 4}, {"l", 128}}) == std::vector<double>{128, 4});

  const std::string missing = invalid_argument_message([&] {
    f.dims_from_map({{"bs", 4}}, "probe point 3");
  });
  CHECK(contains(missing, "probe point 3"));
  CHECK(contains(missing, "missing variable 'l'"));

  const std::string extra = invalid_argument_message([&] {
    f.dims_from_map({{"bs", 4}, {"l", 128}, {"seq", 7}}, "probe point 1");
  });
  CHECK(contains(extra, "probe point 1"));
  CHECK(contains(extra, "'seq'"));

  const std::string wrong = invalid_argument_message([&] {
    f.dims_from_map({{"bs", 4}, {"len", 128}});
  });
  CHECK(contains(wrong, "dims"));
  CHECK(contains(wrong, "'l'"));
}

TEST_CASE("variable_index finds a variable and names a missing one") {
  const CostFormula f("a*bs*l", {"a"}, {"bs", "l"});
  CHECK(f.variable_index("bs") == 0);
  CHECK(f.variable_index("l") == 1);
  CHECK(contains(invalid_argument_message([&] { f.variable_index("seq"); }), "'seq'"));
  CHECK(contains(invalid_argument_message([&] { f.variable_index("a"); }), "'a'"));
}

TEST_CASE("basis, offset and predict agree with evaluate by muparserx") {
  const std::vector<double> coefficients = {3.5, 1024.0, 2.5e8};
  const std::vector<std::vector<double>> points = {{1, 8}, {4, 128},    {64, 512},
                                                   {3, 0}, {0.5, 7.25}, {1000, 4096}};
  for (const char* text : {"a*bs*l**2 + b*bs*(l-1) + c", "a*(bs+l)^3/7 - b*l + 12*bs*l + 1e6",
                           "-bs^2*a + c*1.5e-7 - 2", "c", "bs*l + 3", "a/3*bs^4 + b*l^0 - c/7"}) {
    const CostFormula f(text, kCoefficients, kVariables);
    for (const std::vector<double>& dims : points) {
      CAPTURE(text);
      CAPTURE(dims[0]);
      CAPTURE(dims[1]);
      const std::vector<double> basis = f.basis(dims);
      REQUIRE(basis.size() == coefficients.size());
      double from_basis = f.offset(dims);
      for (std::size_t k = 0; k < basis.size(); ++k) from_basis += coefficients[k] * basis[k];
      const double predicted = f.predict(coefficients, dims);
      const double evaluated = f.evaluate(coefficients, dims);
      CHECK(predicted == doctest::Approx(from_basis).epsilon(1e-12));
      CHECK(predicted == doctest::Approx(evaluated).epsilon(1e-12));
    }
  }
}

TEST_CASE("names that muparserx reserves still evaluate as declared names") {
  const CostFormula f("pi*e^2 + sin*true + e", {"pi", "sin"}, {"e", "true"});
  CHECK(f.canonical() == "pi*e^2 + sin*true + e");
  CHECK(f.evaluate({2, 3}, {5, 7}) == doctest::Approx(2 * 25 + 3 * 7 + 5));
  CHECK(f.predict({2, 3}, {5, 7}) == doctest::Approx(2 * 25 + 3 * 7 + 5));
}

TEST_CASE("basis, predict and evaluate check their argument sizes") {
  const CostFormula f("a*bs*l + b", {"a", "b"}, {"bs", "l"});
  CHECK(contains(invalid_argument_message([&] { f.basis({1}); }), "got 1 dims"));
  CHECK(contains(invalid_argument_message([&] { f.offset({1, 2, 3}); }), "got 3 dims"));
  CHECK(contains(invalid_argument_message([&] { f.predict({1}, {1, 2}); }), "got 1 values"));
  CHECK(contains(invalid_argument_message([&] { f.evaluate({1, 2}, {1}); }), "got 1 dims"));
}

TEST_CASE("random token strings either parse or throw FormulaError, nothing else") {
  const std::vector<std::string> tokens = {"a", "bs", "l", "+", "*", "**",  "^",
                                           "(", ")",  "2", "-", "/", "1e3", " "};
  std::mt19937 rng(20240517u);
  std::uniform_int_distribution<std::size_t> pick(0, tokens.size() - 1);
  std::uniform_int_distribution<int> length(0, 16);
  int parsed = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string text;
    const char* separator = i % 2 == 0 ? "" : " ";  // odd strings: tokens kept apart
    for (int n = length(rng); n > 0; --n) text += tokens[pick(rng)] + separator;
    try {
      const CostFormula f(text, {"a"}, {"bs", "l"});
      ++parsed;
      // Whatever parses is idempotent and evaluates the same both ways.
      const CostFormula again(f.canonical(), {"a"}, {"bs", "l"});
      CHECK_MESSAGE(again.canonical() == f.canonical(), text);
      const double predicted = f.predict({1.5}, {3, 5});
      const double evaluated = f.evaluate({1.5}, {3, 5});
      if (std::isfinite(predicted)) {
        CHECK_MESSAGE(evaluated == doctest::Approx(predicted).epsilon(1e-9), text);
      }
    } catch (const FormulaError& e) {
      CHECK_MESSAGE(e.position() <= text.size(), text);
    }
  }
  CHECK(parsed > 100);  // the generator does produce valid formulas
}

namespace {

// A random well-formed formula over coefficient `a` and variables `bs`, `l`.
std::string random_formula(std::mt19937& rng, int depth) {
  std::uniform_int_distribution<int> choice(0, depth > 0 ? 7 : 1);
  const auto any = [&rng](std::initializer_list<const char*> options) {
    std::uniform_int_distribution<std::size_t> i(0, options.size() - 1);
    return std::string(options.begin()[i(rng)]);
  };
  switch (choice(rng)) {
    case 0:
      return any({"2", "0.5", "3", "1e3", "7"});
    case 1:
      return any({"bs", "l", "bs", "l", "a"});
    case 2:
      return "(" + random_formula(rng, depth - 1) + ")";
    case 3:
      return random_formula(rng, depth - 1) + any({" + ", " - ", "+", "-"}) +
             random_formula(rng, depth - 1);
    case 4:
      return random_formula(rng, depth - 1) + any({"*", " * "}) + random_formula(rng, depth - 1);
    case 5:
      return random_formula(rng, depth - 1) + "/" + any({"2", "4", "(1+2)"});
    case 6:
      return "-" + random_formula(rng, depth - 1);
    default:
      return random_formula(rng, depth - 1) + any({"^", "**"}) + any({"0", "1", "2", "3"});
  }
}

}  // namespace

TEST_CASE("random well-formed formulas are idempotent and evaluate alike both ways") {
  std::mt19937 rng(7u);
  int parsed = 0;
  for (int i = 0; i < 1500; ++i) {
    const std::string text = random_formula(rng, 4);
    CAPTURE(text);
    try {
      const CostFormula f(text, {"a"}, {"bs", "l"});
      ++parsed;
      const CostFormula again(f.canonical(), {"a"}, {"bs", "l"});
      CHECK(again.canonical() == f.canonical());
      for (const std::vector<double>& dims : {std::vector<double>{3, 5}, {0.5, 17}}) {
        const double predicted = f.predict({1.5}, dims);
        CHECK(f.evaluate({1.5}, dims) == doctest::Approx(predicted).epsilon(1e-9));
      }
    } catch (const FormulaError& e) {
      // Only the non-linear uses of `a` (or too high a degree) are expected here.
      const std::string what = e.what();
      CHECK_MESSAGE((contains(what, "not linear") || contains(what, "degree")), what);
    }
  }
  CHECK(parsed > 750);
}

// ---------------------------------------------------------------------------------------------
// max(...), non-linear terms, identity hash, caret lines.

namespace {

xpm::CostFormulaOptions nonlinear() {
  xpm::CostFormulaOptions options;
  options.allow_nonlinear = true;
  return options;
}

const std::vector<std::string> kNonlinearCoefficients = {"a", "b", "c", "p"};

std::string nonlinear_canonical(const std::string& text) {
  return CostFormula(text, kNonlinearCoefficients, kVariables, nonlinear()).canonical();
}

}  // namespace

TEST_CASE("max sorts its canonical arguments so argument order does not matter") {
  CHECK(canonical("max(b*bs, a*bs*l^2)") == "max(a*bs*l^2, b*bs)");
  CHECK(canonical("max(a*bs*l**2, b * bs)") == "max(a*bs*l^2, b*bs)");
  CHECK(canonical("max(bs, l)*c") == canonical("c*max(l, bs)"));
  CHECK(canonical("max(bs*(l-1)*a, c)") == "max(a*bs*l - a*bs, c)");
  CHECK(canonical("c + max(a*bs, b*l)") == "max(a*bs, b*l) + c");
}

TEST_CASE("max flattens nested max and drops duplicate arguments") {
  CHECK(canonical("max(c, max(b*l, a*bs))") == "max(a*bs, b*l, c)");
  CHECK(canonical("max(max(a*bs, c), max(c, b*l))") == "max(a*bs, b*l, c)");
  CHECK(canonical("max(c, c, a*bs)") == "max(a*bs, c)");
  CHECK(canonical("max(a*bs, bs*a)") == "a*bs");
  CHECK(canonical("max(a*bs, 2*a*bs/2)") == "a*bs");
}

TEST_CASE("max folds constant arguments into the largest one") {
  CHECK(canonical("max(2, 3)*c") == "3*c");
  CHECK(canonical("max(1, a*bs, 2)") == "max(2, a*bs)");
  CHECK(canonical("max(max(1, a*bs), 5)") == "max(5, a*bs)");
  CHECK(canonical("a*bs^max(1, 2)") == "a*bs^2");
}

TEST_CASE("a formula with max is not linear, so basis, offset and monomials refuse it") {
  const CostFormula f("max(a*bs*l^2 + b*bs*l, c)", kCoefficients, kVariables);
  CHECK_FALSE(f.is_linear());
  CHECK_THROWS_WITH_AS(f.basis({1, 2}), doctest::Contains("not"), std::logic_error);
  CHECK_THROWS_AS(f.offset({1, 2}), std::logic_error);
  CHECK_THROWS_AS(f.monomials(), std::logic_error);
  CHECK(CostFormula("a*bs*l^2 + c", kCoefficients, kVariables).is_linear());
}

TEST_CASE("max evaluates to its largest argument, alike by predict and by muparserx") {
  const CostFormula f("max(a*bs*l^2 + b*bs*l, c) + 100", kCoefficients, kVariables);
  const std::vector<double> coefficients = {2.0, 30.0, 1e6};
  for (const std::vector<double>& dims : {std::vector<double>{1, 8}, {64, 512}, {4, 128}}) {
    const double bs = dims[0], l = dims[1];
    const double expected = std::max(2.0 * bs * l * l + 30.0 * bs * l, 1e6) + 100;
    CHECK(f.predict(coefficients, dims) == doctest::Approx(expected).epsilon(1e-12));
    CHECK(f.evaluate(coefficients, dims) == doctest::Approx(expected).epsilon(1e-12));
  }
  const CostFormula three("max(a*bs, b*l, -c)*2", kCoefficients, kVariables);
  CHECK(three.predict({1, 2, 3}, {5, 7}) == 28.0);
  CHECK(three.evaluate({1, 2, 3}, {5, 7}) == doctest::Approx(28.0));
  CHECK(three.predict({-1, -2, 3}, {5, 7}) == -6.0);
}

TEST_CASE("rejects a malformed max call at its position") {
  struct Case {
    const char* text;
    std::size_t position;
    const char* symbol;
    const char* message;
  };
  for (const Case& c : {
           Case{"max(a*bs)", 0, "max", "two arguments or more"},
           Case{"max a", 0, "max", "'max' is a function"},
           Case{"max", 0, "max", "'max' is a function"},
           Case{"max()", 4, ")", "expected a number"},
           Case{"max(a, bs", 3, "(", "never closed"},
           Case{"max(a,", 3, "(", "never closed"},
           Case{"max(a, )", 7, ")", "expected a number"},
           Case{"max(a bs)", 6, "bs", "expected ',' or ')'"},
           Case{"a, bs", 1, ",", "outside max"},
           Case{"(a, bs)", 2, ",", "outside max"},
           Case{"min(a, b)", 0, "min", "unknown function 'min'"},
           Case{"a(bs)", 0, "a", "unknown function"},
           Case{"max(a*bs, x)", 10, "x", "undeclared symbol"},
       }) {
    CAPTURE(c.text);
    const FormulaError e = formula_error(c.text);
    CHECK(e.position() == c.position);
    CHECK(e.symbol() == c.symbol);
    CHECK_MESSAGE(contains(e.what(), c.message), e.what());
  }
  CHECK(contains(invalid_argument_message([] { CostFormula("max", {"max"}, {"bs"}); }),
                 "reserved"));
}

TEST_CASE("max keeps the linear rules inside its arguments unless non-linear terms are allowed") {
  CHECK(contains(formula_error("max(a^2, c)").what(), "not linear"));
  CHECK(contains(formula_error("a*max(b*bs, c)").what(), "two coefficients ('a' and 'b')"));
  CHECK(contains(formula_error("max(a*bs, c)^2").what(), "raised to a power"));
  CHECK(contains(formula_error("bs/max(a, 2)").what(), "used in a divisor"));
  CHECK(canonical("bs*max(a, c)") == "bs*max(a, c)");
  CHECK(nonlinear_canonical("a*max(b*bs, c)") == "a*max(b*bs, c)");
  CHECK(nonlinear_canonical("max(a*bs, c)^2") == "max(a*bs, c)^2");
}

TEST_CASE("rejects terms non-linear in a coefficient without allow_nonlinear") {
  for (const char* text : {"a*bs*l^p", "a^2*bs", "a*b*bs", "bs/a", "a*l^1.5", "bs/(a+b)"}) {
    CAPTURE(text);
    const FormulaError e = formula_error(text, kNonlinearCoefficients, kVariables);
    const std::string what = e.what();
    CHECK_MESSAGE((contains(what, "not linear") || contains(what, "two coefficients") ||
                   contains(what, "non-negative integer")),
                  what);
  }
  const FormulaError e = formula_error("a*bs*l^p", kNonlinearCoefficients, kVariables);
  CHECK(e.symbol() == "p");
  CHECK(contains(e.what(), "used in an exponent"));
}

TEST_CASE("accepts terms non-linear in a coefficient with allow_nonlinear") {
  struct Case {
    const char* text;
    const char* canonical;
  };
  for (const Case& c : {
           Case{"a*bs*l^p + c", "a*bs*l^p + c"},
           Case{"l^p*bs*a", "a*bs*l^p"},
           Case{"a^2*bs", "a^2*bs"},
           Case{"a*a*bs", "a^2*bs"},
           Case{"b*bs*a", "a*b*bs"},
           Case{"bs/a", "bs/a"},
           Case{"2*bs/a^2", "2*bs/a^2"},
           Case{"1/(2*a)", "0.5/a"},
           Case{"a^-1", "1/a"},
           Case{"a*l^1.5", "a*l^1.5"},
           Case{"bs/(a+b)", "bs/(a + b)"},
           Case{"(a+b)^-2", "1/(a + b)/(a + b)"},
           Case{"a*l^(p+1)", "a*l^(p + 1)"},
           Case{"a*(bs*l)^p", "a*(bs*l)^p"},
           Case{"a*l^p*l^p", "a*(l^p)^2"},
           Case{"c*2^p", "c*2^p"},
           Case{"a*bs*l^p - a*bs*l^p + c", "c"},
           Case{"a*bs*l^2", "a*bs*l^2"},
       }) {
    CAPTURE(c.text);
    const CostFormula f(c.text, kNonlinearCoefficients, kVariables, nonlinear());
    CHECK(f.canonical() == c.canonical);
  }
  CHECK_FALSE(CostFormula("a*bs*l^p", kNonlinearCoefficients, kVariables, nonlinear())
                  .is_linear());
  // Variables stay out of divisors and exponents even so.
  CHECK(contains(formula_error("a*bs/l", kNonlinearCoefficients, kVariables).what(),
                 "division by a non-constant"));
  for (const char* text : {"a*bs/l", "a*bs^l", "a*l^-1", "bs/(a + l)"}) {
    CAPTURE(text);
    CHECK_THROWS_AS(CostFormula(text, kNonlinearCoefficients, kVariables, nonlinear()),
                    FormulaError);
  }
}

TEST_CASE("non-linear formulas re-parse to themselves and evaluate alike both ways") {
  const std::vector<double> coefficients = {3.0, 1.5, 1e6, 1.7};
  for (const char* text :
       {"a*bs*l^p + c", "max(c, a*bs*l^p)", "a*b*bs + c/b", "bs/(a + b) + (a+b)^-2",
        "a*l^(p+1) - 2*bs*l^p", "a*(bs*l)^p*l^p", "c*2^p + a*l^1.5", "-a*l^p + 4*c",
        "max(a*bs, b*l)^2/c", "a^-0.5*bs", "(l^p)^2*a + b/(a*c)"}) {
    CAPTURE(text);
    const CostFormula once(text, kNonlinearCoefficients, kVariables, nonlinear());
    const CostFormula twice(once.canonical(), kNonlinearCoefficients, kVariables, nonlinear());
    CHECK(twice.canonical() == once.canonical());
    CHECK(twice.identity_hash() == once.identity_hash());
    for (const std::vector<double>& dims : {std::vector<double>{4, 128}, {1, 3}, {7, 0.5}}) {
      const double predicted = once.predict(coefficients, dims);
      CHECK(std::isfinite(predicted));
      CHECK(once.evaluate(coefficients, dims) == doctest::Approx(predicted).epsilon(1e-12));
    }
  }
  const CostFormula f("a*bs*l^p + c", kNonlinearCoefficients, kVariables, nonlinear());
  CHECK(f.predict({3.0, 0.0, 1e6, 1.7}, {4, 128}) ==
        doctest::Approx(3.0 * 4 * std::pow(128.0, 1.7) + 1e6).epsilon(1e-14));
}

TEST_CASE("a linear formula parsed with allow_nonlinear is the same formula") {
  const CostFormula linear("a*bs*(l-1) + c", kCoefficients, kVariables);
  const CostFormula relaxed("a*bs*(l-1) + c", kCoefficients, kVariables, nonlinear());
  CHECK(relaxed.is_linear());
  CHECK(relaxed.canonical() == linear.canonical());
  CHECK(relaxed.identity_hash() == linear.identity_hash());
  CHECK(relaxed.basis({4, 128}) == linear.basis({4, 128}));
}

TEST_CASE("identity hash is equal for equivalent inputs") {
  const std::string hash =
      CostFormula("a*bs*l**2 + b*bs*(l-1) + c", kCoefficients, kVariables).identity_hash();
  CHECK(hash.size() == 16);
  CHECK(hash.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(CostFormula("c + b*bs*l - b*bs + a * bs * l ^ 2", kCoefficients, kVariables)
            .identity_hash() == hash);
  CHECK(CostFormula("a*bs*l^2 + b*bs*(l-1) + c", {"c", "b", "a"}, {"l", "bs"}).identity_hash() ==
        hash);
  CHECK(CostFormula("max(b*l, a*bs)", kCoefficients, kVariables).identity_hash() ==
        CostFormula("max(a*bs, max(b*l, bs*a))", kCoefficients, kVariables).identity_hash());
}

TEST_CASE("identity hash differs when the formula or its names differ") {
  const std::string hash = CostFormula("a*bs*l^2 + c", {"a", "c"}, kVariables).identity_hash();
  CHECK(CostFormula("a*bs*l^2 + 2*c", {"a", "c"}, kVariables).identity_hash() != hash);
  CHECK(CostFormula("a*bs*l + c", {"a", "c"}, kVariables).identity_hash() != hash);
  CHECK(CostFormula("a*bs*l^2 + c", {"a", "c", "b"}, kVariables).identity_hash() != hash);
  CHECK(CostFormula("a*bs*l^2 + c", {"a", "c"}, {"bs", "l", "t"}).identity_hash() != hash);
  CHECK(CostFormula("a*bs*l^2 + c", {"a"}, {"bs", "l", "c"}).identity_hash() != hash);
  CHECK(CostFormula("max(a*bs*l^2, c)", {"a", "c"}, kVariables).identity_hash() != hash);
}

TEST_CASE("identity hash is the documented FNV-1a digest, the same on every run") {
  // Pinned: a change here invalidates every memory-model cache; do it only on purpose. The
  // digest is FNV-1a 64 of "xpm-cost-formula-v1\ncanonical=a*bs*l^2 + b*bs*l + c\n
  // coefficients=a,b,c,\nvariables=bs,l,\nmode=linear" (docs/formula.md).
  CHECK(CostFormula("a*bs*l^2 + b*bs*l + c", kCoefficients, kVariables).identity_hash() ==
        "28be4b5e6a283eb5");
}

TEST_CASE("error message has a caret line under the offending column") {
  const FormulaError e = formula_error("a*bs + x*l");
  CHECK(std::string(e.what()) ==
        "formula error at column 8 (symbol 'x'): undeclared symbol (neither a declared "
        "coefficient nor a declared variable)\n"
        "  a*bs + x*l\n"
        "         ^");
  CHECK(e.brief() ==
        "formula error at column 8 (symbol 'x'): undeclared symbol (neither a declared "
        "coefficient nor a declared variable)");
  CHECK(e.message() == "undeclared symbol (neither a declared coefficient nor a declared variable)");
  CHECK(e.formula_text() == "a*bs + x*l");
  CHECK(e.brief().find('\n') == std::string::npos);
}

TEST_CASE("caret line shows blanks for tabs and newlines and points past the end") {
  const FormulaError tab = formula_error("a*bs\t+\nx");
  CHECK(contains(tab.what(), "\n  a*bs + x\n         ^"));
  const FormulaError end = formula_error("a*bs +");
  CHECK(contains(end.what(), "\n  a*bs +\n       ^"));
  CHECK(std::string(formula_error("").what()) == "formula error at column 1: empty formula");
  CHECK(std::string(formula_error(" \t").what()) ==
        "formula error at column 1: empty formula\n    \n  ^");
}

TEST_CASE("caret line of a long formula is a window around the column") {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "a*bs + ";
  text += "x";
  const FormulaError e = formula_error(text);
  const std::string what = e.what();
  const std::size_t first = what.find('\n');
  const std::size_t second = what.find('\n', first + 1);
  REQUIRE(second != std::string::npos);
  const std::string line = what.substr(first + 1, second - first - 1);
  const std::string caret = what.substr(second + 1);
  CHECK(line.size() < 120);
  CHECK(line.rfind("  ...", 0) == 0);
  CHECK(line[caret.size() - 1] == 'x');
  CHECK(caret.back() == '^');
}

TEST_CASE("caret counts characters, not bytes, before the column") {
  const FormulaError e = formula_error("a*bs + \xc3\xa9");  // an e with an acute accent
  CHECK(e.position() == 7);
  CHECK(contains(e.what(), "\n         ^"));
}

TEST_CASE("random token strings with max, commas and non-linear terms only parse or fail cleanly") {
  const std::vector<std::string> tokens = {"a",   "p",  "bs", "l", "+", "*", "**", "^", "(",
                                           ")",   "2",  "-",  "/", ",", " ", "max", "max(",
                                           "1.5", ".5", "1e3"};
  std::mt19937 rng(20250301u);
  std::uniform_int_distribution<std::size_t> pick(0, tokens.size() - 1);
  std::uniform_int_distribution<int> length(0, 12);
  int parsed = 0;
  int parsed_nonlinear = 0;
  for (int i = 0; i < 6000; ++i) {
    std::string text;
    const char* separator = i % 3 == 0 ? " " : "";
    for (int n = length(rng); n > 0; --n) text += tokens[pick(rng)] + separator;
    xpm::CostFormulaOptions options;
    options.allow_nonlinear = i % 2 == 1;
    try {
      const CostFormula f(text, {"a", "p"}, {"bs", "l"}, options);
      ++parsed;
      parsed_nonlinear += f.is_linear() ? 0 : 1;
      const CostFormula again(f.canonical(), {"a", "p"}, {"bs", "l"}, options);
      CHECK_MESSAGE(again.canonical() == f.canonical(), text);
      const double predicted = f.predict({1.5, 0.75}, {3, 5});
      const double evaluated = f.evaluate({1.5, 0.75}, {3, 5});
      if (std::isfinite(predicted) && std::isfinite(evaluated)) {
        CHECK_MESSAGE(evaluated == doctest::Approx(predicted).epsilon(1e-9), text);
      }
    } catch (const FormulaError& e) {
      CHECK_MESSAGE(e.position() <= text.size(), text);
      CHECK_MESSAGE(e.brief().find('\n') == std::string::npos, text);
    }
  }
  CHECK(parsed > 200);
  CHECK(parsed_nonlinear > 0);
}

namespace {

// A random well-formed formula over coefficients `a`, `p` and variables `bs`, `l`, with max()
// and powers whose exponent may be a coefficient.
std::string random_nonlinear_formula(std::mt19937& rng, int depth) {
  std::uniform_int_distribution<int> choice(0, depth > 0 ? 8 : 1);
  const auto any = [&rng](std::initializer_list<const char*> options) {
    std::uniform_int_distribution<std::size_t> i(0, options.size() - 1);
    return std::string(options.begin()[i(rng)]);
  };
  switch (choice(rng)) {
    case 0:
      return any({"2", "0.5", "3", "1e3"});
    case 1:
      return any({"bs", "l", "a", "p"});
    case 2:
      return "max(" + random_nonlinear_formula(rng, depth - 1) + ", " +
             random_nonlinear_formula(rng, depth - 1) +
             (choice(rng) % 2 == 0 ? ", " + random_nonlinear_formula(rng, depth - 1) : "") + ")";
    case 3:
      return random_nonlinear_formula(rng, depth - 1) + any({" + ", " - "}) +
             random_nonlinear_formula(rng, depth - 1);
    case 4:
      return random_nonlinear_formula(rng, depth - 1) + "*" +
             random_nonlinear_formula(rng, depth - 1);
    case 5:
      return "(" + random_nonlinear_formula(rng, depth - 1) + ")/" + any({"2", "a", "(a + p)"});
    case 6:
      return "-" + random_nonlinear_formula(rng, depth - 1);
    case 7:
      return any({"l", "bs", "(bs*l)", "2"}) + "^" + any({"p", "(p + 1)", "1.5", "2"});
    default:
      return "(" + random_nonlinear_formula(rng, depth - 1) + ")^" + any({"0", "1", "2"});
  }
}

}  // namespace

TEST_CASE("random well-formed non-linear formulas with max are idempotent and evaluate alike") {
  std::mt19937 rng(11u);
  int parsed = 0;
  for (int i = 0; i < 1500; ++i) {
    const std::string text = random_nonlinear_formula(rng, 4);
    CAPTURE(text);
    try {
      const CostFormula f(text, {"a", "p"}, {"bs", "l"}, nonlinear());
      ++parsed;
      const CostFormula again(f.canonical(), {"a", "p"}, {"bs", "l"}, nonlinear());
      CHECK(again.canonical() == f.canonical());
      CHECK(again.identity_hash() == f.identity_hash());
      for (const std::vector<double>& dims : {std::vector<double>{3, 5}, {0.5, 17}}) {
        const double predicted = f.predict({1.5, 0.75}, dims);
        const double evaluated = f.evaluate({1.5, 0.75}, dims);
        if (std::isfinite(predicted)) {
          CHECK(evaluated == doctest::Approx(predicted).epsilon(1e-9));
        }
      }
    } catch (const FormulaError& e) {
      const std::string what = e.what();
      CHECK_MESSAGE((contains(what, "degree") || contains(what, "above")), what);
    }
  }
  CHECK(parsed > 1400);
}

TEST_CASE("coefficient_names_in lists the names that are neither variables nor functions") {
  CHECK(xpm::coefficient_names_in("a*bs*l^2 + b*bs*l + c", {"bs", "l"}) ==
        std::vector<std::string>{"a", "b", "c"});
  CHECK(xpm::coefficient_names_in("max(f + 1e5*d*bs, a*bs*l) + f", {"bs", "l"}) ==
        std::vector<std::string>{"f", "d", "a"});
  CHECK_THROWS_AS(xpm::coefficient_names_in("a*bs $ c", {"bs"}), xpm::FormulaError);
}
