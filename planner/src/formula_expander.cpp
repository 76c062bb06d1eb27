// formula_expander.cpp — cost formulas: expansion of the AST into a canonical sum of terms
// (like terms combined, max() arguments canonicalized) and its canonical printing. Canonical
// form: docs/formula.md.
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

// ---------------------------------------------------------------------------------------------
// Expansion into a canonical sum of terms:
//   factor * prod(coefficient^p) * prod(variable^p) * prod(opaque factor^p).
// Opaque factors (max(...), l^p, (a + b) in a divisor) are identified by their canonical text.

namespace {

struct Key {
  std::vector<int> coefficients;                     // power per coefficient
  std::vector<int> variables;                        // power per variable
  std::vector<std::pair<std::string, int>> factors;  // factor text -> power, sorted, nonzero
  bool operator<(const Key& other) const {
    if (coefficients != other.coefficients) return coefficients < other.coefficients;
    if (variables != other.variables) return variables < other.variables;
    return factors < other.factors;
  }
};
using Poly = std::map<Key, double>;  // key -> nonzero factor

int variable_degree(const std::vector<int>& powers) {
  return std::accumulate(powers.begin(), powers.end(), 0);
}

// Indices of `names` sorted by name (byte order).
std::vector<std::size_t> name_order(const std::vector<std::string>& names) {
  std::vector<std::size_t> order(names.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return names[a] < names[b]; });
  return order;
}

// The canonical order of terms (docs/formula.md, "Canonical form").
class TermOrder {
 public:
  TermOrder(const std::vector<std::string>& coefficient_names,
            const std::vector<std::string>& variable_names)
      : coefficient_names_(coefficient_names),
        coefficient_order_(name_order(coefficient_names)),
        variable_order_(name_order(variable_names)) {}

  bool operator()(const Term& a, const Term& b) const {
    const std::vector<std::string> ga = group(a);
    const std::vector<std::string> gb = group(b);
    if (ga.empty() != gb.empty()) return !ga.empty();  // offset terms last
    if (ga != gb) return ga < gb;
    const int da = variable_degree(a.variable_powers);
    const int db = variable_degree(b.variable_powers);
    if (da != db) return da > db;
    for (std::size_t v : variable_order_) {
      if (a.variable_powers[v] != b.variable_powers[v]) {
        return a.variable_powers[v] > b.variable_powers[v];
      }
    }
    for (std::size_t c : coefficient_order_) {
      if (a.coefficient_powers[c] != b.coefficient_powers[c]) {
        return a.coefficient_powers[c] > b.coefficient_powers[c];
      }
    }
    return std::lexicographical_compare(
        a.factors.begin(), a.factors.end(), b.factors.begin(), b.factors.end(),
        [](const std::pair<FactorPtr, int>& x, const std::pair<FactorPtr, int>& y) {
          if (x.first->text != y.first->text) return x.first->text < y.first->text;
          return x.second < y.second;
        });
  }

 private:
  // Names of the coefficients in the term (direct or inside a factor), sorted.
  std::vector<std::string> group(const Term& t) const {
    std::set<std::string> names;
    for (std::size_t c = 0; c < t.coefficient_powers.size(); ++c) {
      if (t.coefficient_powers[c] != 0) names.insert(coefficient_names_[c]);
    }
    for (const auto& [factor, power] : t.factors) {
      for (int c : factor->coefficients) {
        names.insert(coefficient_names_[static_cast<std::size_t>(c)]);
      }
    }
    return {names.begin(), names.end()};
  }

  const std::vector<std::string>& coefficient_names_;
  std::vector<std::size_t> coefficient_order_;
  std::vector<std::size_t> variable_order_;
};

// "max(bs, l)", "(l^p)^2", "(a + b)" with |power| applied.
std::string factor_with_power(const Factor& f, int power) {
  if (power == 1) return f.text;
  const std::string base = f.kind == Factor::Kind::power ? "(" + f.text + ")" : f.text;
  return base + "^" + std::to_string(power);
}

// The term without its sign.
std::string print_magnitude(const Term& t, const std::vector<std::string>& coefficient_names,
                            const std::vector<std::string>& variable_names,
                            const std::vector<std::size_t>& coefficient_order,
                            const std::vector<std::size_t>& variable_order) {
  std::vector<std::string> numerator;
  std::vector<std::string> denominator;
  const auto named = [](const std::string& name, int power) {
    return power == 1 ? name : name + "^" + std::to_string(power);
  };
  for (std::size_t c : coefficient_order) {
    const int p = t.coefficient_powers[c];
    if (p > 0) numerator.push_back(named(coefficient_names[c], p));
    if (p < 0) denominator.push_back(named(coefficient_names[c], -p));
  }
  for (std::size_t v : variable_order) {
    const int p = t.variable_powers[v];
    if (p > 0) numerator.push_back(named(variable_names[v], p));
  }
  for (const auto& [factor, power] : t.factors) {
    if (power > 0) numerator.push_back(factor_with_power(*factor, power));
  }
  for (const auto& [factor, power] : t.factors) {
    if (power >= 0) continue;
    if (factor->kind == Factor::Kind::group) {
      // "(a + b)^2" would re-read as a polynomial; repeat the group instead.
      for (int k = 0; k < -power; ++k) denominator.push_back(factor->text);
    } else {
      denominator.push_back(factor_with_power(*factor, -power));
    }
  }
  const double magnitude = std::fabs(t.factor);
  std::string out;
  if (magnitude != 1.0 || numerator.empty()) out = format_number(magnitude);
  for (const std::string& part : numerator) {
    if (!out.empty()) out += '*';
    out += part;
  }
  for (const std::string& part : denominator) out += "/" + part;
  return out;
}

bool is_zero_key(const Key& key) {
  for (int p : key.coefficients) {
    if (p != 0) return false;
  }
  for (int p : key.variables) {
    if (p != 0) return false;
  }
  return key.factors.empty();
}

class Expander {
 public:
  Expander(const std::string& text, const std::vector<std::string>& coefficient_names,
           const std::vector<std::string>& variable_names, bool allow_nonlinear)
      : text_(text),
        coefficient_names_(coefficient_names),
        variable_names_(variable_names),
        allow_nonlinear_(allow_nonlinear) {
    for (std::size_t k = 0; k < coefficient_names.size(); ++k) {
      names_[coefficient_names[k]] = {true, static_cast<int>(k)};
    }
    for (std::size_t k = 0; k < variable_names.size(); ++k) {
      names_[variable_names[k]] = {false, static_cast<int>(k)};
    }
  }

  Poly expand(const Node& node) {
    switch (node.kind) {
      case Node::Kind::number:
        return constant(node.value);
      case Node::Kind::name:
        return name(node);
      case Node::Kind::negate: {
        Poly p = expand(node.children[0]);
        for (auto& term : p) term.second = -term.second;
        return p;
      }
      case Node::Kind::sum:
        return sum(node);
      case Node::Kind::product:
        return product(node);
      case Node::Kind::power:
        return power(node);
      case Node::Kind::call:
        return call(node);
    }
    fail("internal error: unknown formula node", node.position, node.text);
  }

  // The polynomial as a canonical sum (terms sorted, factor pointers resolved).
  Sum to_sum(const Poly& p) const {
    Sum out;
    out.reserve(p.size());
    for (const auto& [key, factor] : p) {
      Term t;
      t.factor = factor;
      t.coefficient_powers = key.coefficients;
      t.variable_powers = key.variables;
      for (const auto& [text, power] : key.factors) t.factors.emplace_back(factors_.at(text), power);
      out.push_back(std::move(t));
    }
    std::sort(out.begin(), out.end(), TermOrder(coefficient_names_, variable_names_));
    return out;
  }

 private:
  struct NameInfo {
    bool is_coefficient;
    int index;
  };

  Key zero_key() const {
    Key key;
    key.coefficients.assign(coefficient_names_.size(), 0);
    key.variables.assign(variable_names_.size(), 0);
    return key;
  }

  Poly constant(double value) const {
    Poly p;
    if (value != 0.0) p.emplace(zero_key(), value);
    return p;
  }

  static bool is_constant(const Poly& p) {
    if (p.empty()) return true;
    return p.size() == 1 && is_zero_key(p.begin()->first);
  }

  static double constant_value(const Poly& p) { return p.empty() ? 0.0 : p.begin()->second; }

  static Poly from_sum(const Sum& s) {
    Poly p;
    for (const Term& t : s) {
      Key key;
      key.coefficients = t.coefficient_powers;
      key.variables = t.variable_powers;
      for (const auto& [factor, power] : t.factors) key.factors.emplace_back(factor->text, power);
      p.emplace(std::move(key), t.factor);
    }
    return p;
  }

  const Factor& factor(const std::string& text) const { return *factors_.at(text); }

  // Coefficients in a term, directly or inside one of its factors (declared indices).
  std::set<int> coefficients_of(const Key& key) const {
    std::set<int> out;
    for (std::size_t c = 0; c < key.coefficients.size(); ++c) {
      if (key.coefficients[c] != 0) out.insert(static_cast<int>(c));
    }
    for (const auto& [text, power] : key.factors) {
      const std::set<int>& inside = factor(text).coefficients;
      out.insert(inside.begin(), inside.end());
    }
    return out;
  }

  std::set<int> variables_of(const Key& key) const {
    std::set<int> out;
    for (std::size_t v = 0; v < key.variables.size(); ++v) {
      if (key.variables[v] != 0) out.insert(static_cast<int>(v));
    }
    for (const auto& [text, power] : key.factors) {
      const std::set<int>& inside = factor(text).variables;
      out.insert(inside.begin(), inside.end());
    }
    return out;
  }

  std::set<int> coefficients_of(const Poly& p) const {
    std::set<int> out;
    for (const auto& term : p) {
      const std::set<int> c = coefficients_of(term.first);
      out.insert(c.begin(), c.end());
    }
    return out;
  }

  std::set<int> variables_of(const Poly& p) const {
    std::set<int> out;
    for (const auto& term : p) {
      const std::set<int> v = variables_of(term.first);
      out.insert(v.begin(), v.end());
    }
    return out;
  }

  // Sum of |power| of the coefficients and factors of a term (its non-variable degree).
  static int other_degree(const Key& key) {
    int out = 0;
    for (int p : key.coefficients) out += std::abs(p);
    for (const auto& entry : key.factors) out += std::abs(entry.second);
    return out;
  }

  static void check_finite(const Poly& p, std::size_t position, const std::string& symbol) {
    for (const auto& term : p) {
      if (!std::isfinite(term.second)) fail("value out of range of a double", position, symbol);
    }
  }

  static void check_size(const Poly& p, std::size_t position, const std::string& symbol) {
    if (p.size() > kMaxTerms) {
      fail("formula expands to more than " + std::to_string(kMaxTerms) + " terms", position,
           symbol);
    }
  }

  static void drop_zeros(Poly& p) {
    for (auto it = p.begin(); it != p.end();) {
      it = it->second == 0.0 ? p.erase(it) : std::next(it);
    }
  }

  std::string span(const Node& node) const {
    return text_.substr(node.begin, node.end - node.begin);
  }

  Poly name(const Node& node) const {
    const auto it = names_.find(node.text);
    if (it == names_.end()) {
      fail("undeclared symbol (neither a declared coefficient nor a declared variable)",
           node.position, node.text);
    }
    Key key = zero_key();
    const std::size_t index = static_cast<std::size_t>(it->second.index);
    if (it->second.is_coefficient) {
      key.coefficients[index] = 1;
    } else {
      key.variables[index] = 1;
    }
    return Poly{{std::move(key), 1.0}};
  }

  // First name node (left to right) in `node` that satisfies `pred`.
  template <class Pred>
  static const Node* find_name(const Node& node, const Pred& pred) {
    if (node.kind == Node::Kind::name && pred(node.text)) return &node;
    for (const Node& child : node.children) {
      if (const Node* found = find_name(child, pred)) return found;
    }
    return nullptr;
  }

  const Node* find_coefficient(const Node& node, const std::set<int>& present) const {
    return find_name(node, [&](const std::string& n) {
      const auto it = names_.find(n);
      return it != names_.end() && it->second.is_coefficient && present.count(it->second.index);
    });
  }

  // Fails naming the first name in `node` that is a coefficient present in `p` (if any).
  void fail_on_coefficient(const Poly& p, const Node& node, const std::string& message) const {
    const std::set<int> present = coefficients_of(p);
    if (present.empty()) return;
    if (const Node* found = find_coefficient(node, present)) {
      fail(message, found->position, found->text);
    }
    fail(message, node.begin, span(node));
  }

  // Fails naming the first name in `node` that is a variable present in `p` (if any).
  void fail_on_variable(const Poly& p, const Node& node, const std::string& message) const {
    const std::set<int> present = variables_of(p);
    if (present.empty()) return;
    const Node* found = find_name(node, [&](const std::string& n) {
      const auto it = names_.find(n);
      return it != names_.end() && !it->second.is_coefficient && present.count(it->second.index);
    });
    if (found != nullptr) fail(message, found->position, found->text);
    fail(message, node.begin, span(node));
  }

  Poly sum(const Node& node) {
    Poly acc = expand(node.children[0]);
    for (std::size_t i = 1; i < node.children.size(); ++i) {
      const double sign = node.ops[i] == '-' ? -1.0 : 1.0;
      for (const auto& term : expand(node.children[i])) {
        auto [it, inserted] = acc.emplace(term.first, sign * term.second);
        if (!inserted) {
          it->second += sign * term.second;
          if (it->second == 0.0) acc.erase(it);
        }
      }
      check_finite(acc, node.op_positions[i], std::string(1, node.ops[i]));
      check_size(acc, node.op_positions[i], std::string(1, node.ops[i]));
    }
    return acc;
  }

  // The key of l * r; fails when a degree limit is passed.
  Key combine(const Key& l, const Key& r, std::size_t position, const std::string& symbol) const {
    Key out = l;
    for (std::size_t c = 0; c < out.coefficients.size(); ++c) {
      out.coefficients[c] += r.coefficients[c];
    }
    for (std::size_t v = 0; v < out.variables.size(); ++v) out.variables[v] += r.variables[v];
    for (const auto& entry : r.factors) {
      auto it = std::lower_bound(out.factors.begin(), out.factors.end(), entry,
                                 [](const std::pair<std::string, int>& a,
                                    const std::pair<std::string, int>& b) {
                                   return a.first < b.first;
                                 });
      if (it != out.factors.end() && it->first == entry.first) {
        it->second += entry.second;
        if (it->second == 0) out.factors.erase(it);
      } else {
        out.factors.insert(it, entry);
      }
    }
    if (variable_degree(out.variables) > kMaxDegree) {
      fail("term degree above " + std::to_string(kMaxDegree), position, symbol);
    }
    for (int p : out.coefficients) {
      if (std::abs(p) > kMaxDegree) {
        fail("power of a coefficient above " + std::to_string(kMaxDegree), position, symbol);
      }
    }
    for (const auto& entry : out.factors) {
      if (std::abs(entry.second) > kMaxDegree) {
        fail("power of a factor above " + std::to_string(kMaxDegree), position, symbol);
      }
    }
    return out;
  }

  // Linear mode: fails when l * r multiplies two coefficients (or one by itself). `rhs_node` is
  // the AST of r's side, to name the offending coefficient.
  void check_linear_product(const Key& l, const Key& r, const Node& rhs_node,
                            std::size_t op_position) const {
    const std::set<int> lhs = coefficients_of(l);
    if (lhs.empty()) return;
    const std::set<int> rhs = coefficients_of(r);
    if (rhs.empty()) return;
    const Node* found = find_coefficient(rhs_node, rhs);
    const int rindex = found != nullptr ? names_.at(found->text).index : *rhs.begin();
    const std::string& rname = coefficient_name(rindex);
    const std::size_t position = found != nullptr ? found->position : op_position;
    if (lhs.size() == 1 && *lhs.begin() == rindex) {
      fail(
          "coefficient is not linear (multiplied by itself); a term must be linear in "
          "its coefficient",
          position, rname);
    }
    int lindex = *lhs.begin();
    for (int c : lhs) {
      if (c != rindex) {
        lindex = c;
        break;
      }
    }
    fail("term has two coefficients ('" + coefficient_name(lindex) + "' and '" + rname +
             "'); a term may have at most one",
         position, rname);
  }

  // lhs * rhs, where `rhs_node` is the AST of rhs (to name an offending coefficient).
  Poly multiply(const Poly& lhs, const Poly& rhs, const Node& rhs_node, std::size_t op_position,
                const std::string& op) const {
    Poly out;
    for (const auto& l : lhs) {
      for (const auto& r : rhs) {
        if (!allow_nonlinear_) check_linear_product(l.first, r.first, rhs_node, op_position);
        out[combine(l.first, r.first, op_position, op)] += l.second * r.second;
      }
      check_size(out, op_position, op);
    }
    drop_zeros(out);
    check_finite(out, op_position, op);
    return out;
  }

  // Registers an opaque factor and returns it as a polynomial (one term, factor^1).
  Poly opaque(Factor::Kind kind, std::vector<Sum> operands, std::string text,
              std::size_t position, const std::string& symbol) {
    if (text.size() > kMaxFactorText) {
      fail("formula too large (a factor's canonical text exceeds " +
               std::to_string(kMaxFactorText) + " characters)",
           position, symbol);
    }
    if (factors_.find(text) == factors_.end()) {
      auto f = std::make_shared<Factor>();
      f->kind = kind;
      f->text = text;
      for (const Sum& operand : operands) {
        for (const Term& t : operand) {
          for (std::size_t c = 0; c < t.coefficient_powers.size(); ++c) {
            if (t.coefficient_powers[c] != 0) f->coefficients.insert(static_cast<int>(c));
          }
          for (std::size_t v = 0; v < t.variable_powers.size(); ++v) {
            if (t.variable_powers[v] != 0) f->variables.insert(static_cast<int>(v));
          }
          for (const auto& inner : t.factors) {
            f->coefficients.insert(inner.first->coefficients.begin(),
                                   inner.first->coefficients.end());
            f->variables.insert(inner.first->variables.begin(), inner.first->variables.end());
          }
        }
      }
      f->operands = std::move(operands);
      factors_.emplace(text, std::move(f));
    }
    Key key = zero_key();
    key.factors.emplace_back(std::move(text), 1);
    return Poly{{std::move(key), 1.0}};
  }

  // Text of a sum as the base or exponent of a power: bare when it is one name, a non-negative
  // number or a max(...), parenthesized otherwise.
  std::string operand_text(const Sum& s) const {
    const std::string text = print(s, coefficient_names_, variable_names_);
    if (s.empty()) return text;
    bool atomic = false;
    if (s.size() == 1) {
      const Term& t = s[0];
      int names = 0;
      bool single_powers = true;
      for (int p : t.coefficient_powers) {
        names += p != 0;
        single_powers = single_powers && (p == 0 || p == 1);
      }
      for (int p : t.variable_powers) {
        names += p != 0;
        single_powers = single_powers && (p == 0 || p == 1);
      }
      const bool max_alone = names == 0 && t.factors.size() == 1 && t.factors[0].second == 1 &&
                             t.factors[0].first->kind == Factor::Kind::max;
      if (t.factor == 1.0 && ((names == 1 && single_powers && t.factors.empty()) || max_alone)) {
        atomic = true;
      }
      if (names == 0 && t.factors.empty() && t.factor > 0) atomic = true;  // a number
    }
    return atomic ? text : "(" + text + ")";
  }

  Poly opaque_power(const Poly& base, const Poly& exponent, std::size_t position,
                    const std::string& symbol) {
    Sum base_sum = to_sum(base);
    Sum exponent_sum = to_sum(exponent);
    std::string text = operand_text(base_sum) + "^" + operand_text(exponent_sum);
    return opaque(Factor::Kind::power, {std::move(base_sum), std::move(exponent_sum)},
                  std::move(text), position, symbol);
  }

  // 1 / p for a non-constant p without variables (non-linear mode): a single term is inverted
  // (powers negated), a sum becomes the factor (sum)^-1.
  Poly reciprocal(const Poly& p, std::size_t position, const std::string& symbol) {
    if (p.size() == 1) return single_term_power(*p.begin(), -1, position, symbol);
    Poly group = opaque(Factor::Kind::group, {to_sum(p)},
                        "(" + print(to_sum(p), coefficient_names_, variable_names_) + ")",
                        position, symbol);
    Poly out;
    Key key = group.begin()->first;
    key.factors[0].second = -1;
    out.emplace(std::move(key), 1.0);
    return out;
  }

  // (one term)^n for an integer n (may be negative). A group factor that ends with a positive
  // power is multiplied out again, so the canonical text re-reads as itself.
  Poly single_term_power(const std::pair<const Key, double>& term, int n, std::size_t position,
                         const std::string& symbol) {
    Key key = term.first;
    for (int& p : key.coefficients) p *= n;
    for (int& p : key.variables) p *= n;
    for (auto& entry : key.factors) entry.second *= n;
    if (variable_degree(key.variables) > kMaxDegree) {
      fail("term degree above " + std::to_string(kMaxDegree), position, symbol);
    }
    for (int p : key.coefficients) {
      if (std::abs(p) > kMaxDegree) {
        fail("power of a coefficient above " + std::to_string(kMaxDegree), position, symbol);
      }
    }
    for (const auto& entry : key.factors) {
      if (std::abs(entry.second) > kMaxDegree) {
        fail("power of a factor above " + std::to_string(kMaxDegree), position, symbol);
      }
    }
    const double value = std::pow(term.second, n);
    Poly out;
    std::vector<std::pair<std::string, int>> groups;
    for (auto it = key.factors.begin(); it != key.factors.end();) {
      if (factor(it->first).kind == Factor::Kind::group && it->second > 0) {
        groups.push_back(*it);
        it = key.factors.erase(it);
      } else {
        ++it;
      }
    }
    out.emplace(std::move(key), value);
    const Node none;
    for (const auto& [text, power] : groups) {
      const Poly inner = from_sum(factor(text).operands[0]);
      for (int k = 0; k < power; ++k) out = multiply(out, inner, none, position, symbol);
    }
    drop_zeros(out);
    check_finite(out, position, symbol);
    return out;
  }

  Poly product(const Node& node) {
    Poly acc = expand(node.children[0]);
    for (std::size_t i = 1; i < node.children.size(); ++i) {
      const Node& child = node.children[i];
      const std::size_t op_position = node.op_positions[i];
      const std::string op(1, node.ops[i]);
      Poly operand = expand(child);
      if (node.ops[i] == '*') {
        acc = multiply(acc, operand, child, op_position, op);
        continue;
      }
      if (!is_constant(operand)) {
        if (!allow_nonlinear_) {
          fail_on_coefficient(operand, child,
                              "coefficient is not linear (used in a divisor); division is by a "
                              "numeric constant only");
          fail_on_variable(operand, child,
                           "division by a non-constant; division is by a numeric constant only");
        }
        fail_on_variable(operand, child,
                         "division by a non-constant; division is by numbers and coefficients "
                         "only");
        acc = multiply(acc, reciprocal(operand, op_position, op), child, op_position, op);
        continue;
      }
      const double divisor = constant_value(operand);
      if (divisor == 0.0) fail("division by zero", child.begin, span(child));
      for (auto it = acc.begin(); it != acc.end();) {
        it->second /= divisor;
        it = it->second == 0.0 ? acc.erase(it) : std::next(it);
      }
      check_finite(acc, op_position, op);
    }
    return acc;
  }

  Poly power(const Node& node) {
    const Node& base_node = node.children[0];
    const Node& exponent_node = node.children[1];
    const Poly base = expand(base_node);
    const Poly exponent = expand(exponent_node);
    if (!is_constant(exponent)) {
      if (!allow_nonlinear_) {
        fail_on_coefficient(exponent, exponent_node,
                            "coefficient is not linear (used in an exponent)");
      }
      fail_on_variable(exponent, exponent_node,
                       "exponent must be a constant, not depend on a variable");
      return opaque_power(base, exponent, node.position, node.text);  // l^p
    }
    const double n = constant_value(exponent);
    const bool natural = n >= 0.0 && n == std::floor(n);
    if (!natural) {
      if (!allow_nonlinear_) {
        fail("exponent must be a non-negative integer", exponent_node.begin, span(exponent_node));
      }
      if (is_constant(base)) {
        const double folded = std::pow(constant_value(base), n);
        if (std::isnan(folded)) {
          fail("a negative number to a non-integer power is not a real number", node.position,
               node.text);
        }
        Poly out = constant(folded);
        check_finite(out, node.position, node.text);
        return out;
      }
      if (n < 0.0) {
        fail_on_variable(base, base_node,
                         "a negative exponent divides by a variable; division is by numbers "
                         "and coefficients only");
        if (n == std::floor(n)) {
          if (n < -kMaxDegree) {
            fail("exponent below -" + std::to_string(kMaxDegree), exponent_node.begin,
                 span(exponent_node));
          }
          if (base.size() == 1) {
            return single_term_power(*base.begin(), static_cast<int>(n), node.position,
                                     node.text);
          }
          Poly inverse = reciprocal(base, node.position, node.text);  // (sum)^-1
          Poly out = inverse;
          for (int k = 1; k < static_cast<int>(-n); ++k) {
            out = multiply(out, inverse, base_node, node.position, node.text);
          }
          return out;
        }
      }
      return opaque_power(base, exponent, node.position, node.text);  // l^1.5, a^-0.5
    }
    if (is_constant(base)) {
      Poly out = constant(std::pow(constant_value(base), n));
      check_finite(out, node.position, node.text);
      return out;
    }
    if (n == 0.0) return constant(1.0);
    if (n == 1.0) return base;
    if (!allow_nonlinear_) {
      fail_on_coefficient(base, base_node,
                          "coefficient is not linear (raised to a power); a term must be linear "
                          "in its coefficient");
    }
    int max_degree = 0;
    int max_other = 0;
    for (const auto& term : base) {
      max_degree = std::max(max_degree, variable_degree(term.first.variables));
      max_other = std::max(max_other, other_degree(term.first));
    }
    if (static_cast<double>(max_degree) * n > kMaxDegree) {
      fail("term degree above " + std::to_string(kMaxDegree), node.position, node.text);
    }
    if (static_cast<double>(max_other) * n > kMaxDegree) {
      fail("power of a coefficient or factor above " + std::to_string(kMaxDegree),
           node.position, node.text);
    }
    Poly out = base;
    for (int k = 1; k < static_cast<int>(n); ++k) {
      out = multiply(out, base, base_node, node.position, node.text);
    }
    return out;
  }

  // max(e1, e2, ...): constant arguments fold into the largest, nested max() flattens,
  // duplicates go, the rest sort by canonical text.
  Poly call(const Node& node) {
    std::map<std::string, Sum> arguments;  // canonical text -> argument
    bool has_constant = false;
    double largest_constant = 0.0;
    const auto add = [&](Sum s) {
      std::string text = print(s, coefficient_names_, variable_names_);
      arguments.emplace(std::move(text), std::move(s));
    };
    for (const Node& child : node.children) {
      const Poly arg = expand(child);
      if (is_constant(arg)) {
        const double v = constant_value(arg);
        largest_constant = has_constant ? std::max(largest_constant, v) : v;
        has_constant = true;
        continue;
      }
      if (arg.size() == 1 && arg.begin()->second == 1.0) {
        const Key& key = arg.begin()->first;
        const bool only_factor = key.factors.size() == 1 && key.factors[0].second == 1 &&
                                 other_degree(key) == 1 && variable_degree(key.variables) == 0;
        if (only_factor && factor(key.factors[0].first).kind == Factor::Kind::max) {
          for (const Sum& inner : factor(key.factors[0].first).operands) {
            if (inner.empty() || (inner.size() == 1 && inner[0].factors.empty() &&
                                  is_zero_term(inner[0]))) {
              const double v = inner.empty() ? 0.0 : inner[0].factor;
              largest_constant = has_constant ? std::max(largest_constant, v) : v;
              has_constant = true;
            } else {
              add(inner);
            }
          }
          continue;
        }
      }
      add(to_sum(arg));
    }
    if (arguments.empty()) return constant(largest_constant);
    if (has_constant) add(to_sum(constant(largest_constant)));
    if (arguments.size() == 1) return from_sum(arguments.begin()->second);
    std::string text = "max(";
    std::vector<Sum> operands;
    for (auto& [argument_text, argument] : arguments) {
      if (!operands.empty()) text += ", ";
      text += argument_text;
      operands.push_back(std::move(argument));
    }
    text += ")";
    return opaque(Factor::Kind::max, std::move(operands), std::move(text), node.position,
                  node.text);
  }

  static bool is_zero_term(const Term& t) {
    for (int p : t.coefficient_powers) {
      if (p != 0) return false;
    }
    for (int p : t.variable_powers) {
      if (p != 0) return false;
    }
    return t.factors.empty();
  }

  const std::string& coefficient_name(int index) const {
    return coefficient_names_[static_cast<std::size_t>(index)];
  }

  const std::string& text_;
  const std::vector<std::string>& coefficient_names_;
  const std::vector<std::string>& variable_names_;
  bool allow_nonlinear_;
  std::map<std::string, NameInfo> names_;
  std::map<std::string, FactorPtr> factors_;  // opaque factors by canonical text
};

bool term_is_linear(const Term& t) {
  if (!t.factors.empty()) return false;
  int coefficients = 0;
  for (int p : t.coefficient_powers) {
    if (p == 0) continue;
    if (p != 1) return false;
    ++coefficients;
  }
  return coefficients <= 1;
}

}  // namespace

std::shared_ptr<const Expression> expand(const Node& root, const std::string& text,
                                         const std::vector<std::string>& coefficient_names,
                                         const std::vector<std::string>& variable_names,
                                         bool allow_nonlinear) {
  Expander expander(text, coefficient_names, variable_names, allow_nonlinear);
  const Poly poly = expander.expand(root);
  auto expression = std::make_shared<Expression>();
  expression->terms = expander.to_sum(poly);
  for (const Term& t : expression->terms) {
    expression->linear = expression->linear && term_is_linear(t);
  }
  return expression;
}

std::string format_number(double value) {
  char buffer[64];
  std::to_chars_result result;
  if (value == std::floor(value) && value < 1e15) {
    result = std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::fixed);
  } else {
    result = std::to_chars(buffer, buffer + sizeof buffer, value);
  }
  std::string text(buffer, result.ptr);
  // "1e+20" -> "1e20", "1.5e-07" -> "1.5e-7".
  const std::size_t e = text.find('e');
  if (e != std::string::npos) {
    std::string mantissa = text.substr(0, e);
    std::string exponent = text.substr(e + 1);
    std::string sign;
    if (!exponent.empty() && (exponent[0] == '+' || exponent[0] == '-')) {
      if (exponent[0] == '-') sign = "-";
      exponent.erase(0, 1);
    }
    const std::size_t nonzero = exponent.find_first_not_of('0');
    exponent = nonzero == std::string::npos ? "0" : exponent.substr(nonzero);
    text = mantissa + "e" + sign + exponent;
  }
  return text;
}

std::string print(const Sum& terms, const std::vector<std::string>& coefficient_names,
                  const std::vector<std::string>& variable_names) {
  if (terms.empty()) return "0";
  const std::vector<std::size_t> coefficient_order = name_order(coefficient_names);
  const std::vector<std::size_t> variable_order = name_order(variable_names);
  std::string out;
  for (std::size_t i = 0; i < terms.size(); ++i) {
    const Term& t = terms[i];
    const bool negative = t.factor < 0.0;
    const std::string term =
        print_magnitude(t, coefficient_names, variable_names, coefficient_order, variable_order);
    if (i == 0) {
      out = (negative ? "-" : "") + term;
    } else {
      out += negative ? " - " : " + ";
      out += term;
    }
  }
  return out;
}

}  // namespace xpm::formula_ast
