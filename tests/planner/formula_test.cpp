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
