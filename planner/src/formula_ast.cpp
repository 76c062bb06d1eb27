// formula_ast.cpp — tokenizer, recursive-descent parser, polynomial expansion and canonical
// printing for cost formulas. Grammar and canonical form: docs/formula.md.
#include "formula_ast.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <system_error>
#include <utility>

namespace xpm::formula_ast {
namespace {

[[noreturn]] void fail(const std::string& message, std::size_t position, std::string symbol) {
  throw FormulaError(message, position, std::move(symbol));
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }
bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

// Reads a number starting at text[i] (a digit, or '.' followed by a digit).
Token read_number(const std::string& text, std::size_t& i) {
  const std::size_t start = i;
  const std::size_t n = text.size();
  bool bad = false;
  while (i < n && is_digit(text[i])) ++i;
  if (i < n && text[i] == '.') {
    ++i;
    while (i < n && is_digit(text[i])) ++i;
  }
  if (i < n && (text[i] == 'e' || text[i] == 'E')) {
    std::size_t j = i + 1;
    if (j < n && (text[j] == '+' || text[j] == '-')) ++j;
    if (j < n && is_digit(text[j])) {
      i = j;
      while (i < n && is_digit(text[i])) ++i;
    } else {
      bad = true;  // "1e", "1e+": exponent without digits
      i = j;
    }
  }
  if (i < n && (is_name_char(text[i]) || text[i] == '.')) bad = true;  // "2bs", "1.2.3"
  if (bad) {
    while (i < n && (is_name_char(text[i]) || text[i] == '.')) ++i;
    fail("bad number", start, text.substr(start, i - start));
  }
  Token token;
  token.kind = Token::Kind::number;
  token.position = start;
  token.text = text.substr(start, i - start);
  const char* first = text.data() + start;
  const char* last = text.data() + i;
  const auto [ptr, ec] = std::from_chars(first, last, token.value);
  if (ec == std::errc::result_out_of_range || !std::isfinite(token.value)) {
    fail("number out of range of a double", start, token.text);
  }
  if (ec != std::errc() || ptr != last) fail("bad number", start, token.text);
  return token;
}

}  // namespace

std::vector<Token> tokenize(const std::string& text) {
  std::vector<Token> tokens;
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    const char c = text[i];
    if (is_space(c)) {
      ++i;
      continue;
    }
    if (is_digit(c) || (c == '.' && i + 1 < n && is_digit(text[i + 1]))) {
      tokens.push_back(read_number(text, i));
      continue;
    }
    Token token;
    token.position = i;
    if (is_name_start(c)) {
      std::size_t j = i;
      while (j < n && is_name_char(text[j])) ++j;
      token.kind = Token::Kind::name;
      token.text = text.substr(i, j - i);
      tokens.push_back(std::move(token));
      i = j;
      continue;
    }
    std::size_t length = 1;
    switch (c) {
      case '+':
        token.kind = Token::Kind::plus;
        break;
      case '-':
        token.kind = Token::Kind::minus;
        break;
      case '/':
        token.kind = Token::Kind::slash;
        break;
      case '^':
        token.kind = Token::Kind::power;
        break;
      case '(':
        token.kind = Token::Kind::lparen;
        break;
      case ')':
        token.kind = Token::Kind::rparen;
        break;
      case '*':
        if (i + 1 < n && text[i + 1] == '*') {
          token.kind = Token::Kind::power;
          length = 2;
        } else {
          token.kind = Token::Kind::star;
        }
        break;
      default: {
        // Quote a whole UTF-8 sequence rather than half of it.
        std::size_t j = i + 1;
        if (static_cast<unsigned char>(c) >= 0xC0) {
          while (j < n && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80) ++j;
        }
        fail("unexpected character", i, text.substr(i, j - i));
      }
    }
    token.text = text.substr(i, length);
    tokens.push_back(std::move(token));
    i += length;
  }
  Token end;
  end.kind = Token::Kind::end;
  end.position = n;
  tokens.push_back(std::move(end));
  return tokens;
}

// ---------------------------------------------------------------------------------------------
// Parser
//
//   sum     := product (('+' | '-') product)*
//   product := unary (('*' | '/') unary)*
//   unary   := ('+' | '-') unary | power
//   power   := primary (('^' | '**') unary)?        right-associative: 2^3^2 = 2^(3^2)
//   primary := number | name | '(' sum ')'

namespace {

class Parser {
 public:
  explicit Parser(const std::string& text) : tokens_(tokenize(text)) {}

  Node parse() {
    if (peek().kind == Token::Kind::end) fail("empty formula", 0, "");
    Node root = parse_sum();
    const Token& t = peek();
    if (t.kind == Token::Kind::rparen) {
      fail("unbalanced parenthesis: ')' has no matching '('", t.position, t.text);
    }
    if (t.kind != Token::Kind::end) {
      fail("expected an operator (+ - * / ^ **) before this symbol", t.position, t.text);
    }
    return root;
  }

 private:
  // Counts nesting depth (parentheses, unary signs, powers) so hostile input cannot overflow
  // the stack.
  struct DepthGuard {
    explicit DepthGuard(Parser& parser) : parser_(parser) {
      if (++parser_.depth_ > kMaxNesting) {
        fail("formula nested too deeply (more than " + std::to_string(kMaxNesting) + " levels)",
             parser_.peek().position, parser_.peek().text);
      }
    }
    ~DepthGuard() { --parser_.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;
    Parser& parser_;
  };

  const Token& peek() const { return tokens_[next_]; }
  const Token& take() { return tokens_[next_++]; }

  Node parse_sum() {
    Node first = parse_product();
    if (peek().kind != Token::Kind::plus && peek().kind != Token::Kind::minus) return first;
    Node sum;
    sum.kind = Node::Kind::sum;
    sum.position = peek().position;
    sum.begin = first.begin;
    sum.ops.push_back('+');
    sum.op_positions.push_back(first.begin);
    sum.children.push_back(std::move(first));
    while (peek().kind == Token::Kind::plus || peek().kind == Token::Kind::minus) {
      const Token& op = take();
      sum.ops.push_back(op.text[0]);
      sum.op_positions.push_back(op.position);
      sum.children.push_back(parse_product());
    }
    sum.end = sum.children.back().end;
    return sum;
  }

  Node parse_product() {
    Node first = parse_unary();
    if (peek().kind != Token::Kind::star && peek().kind != Token::Kind::slash) return first;
    Node product;
    product.kind = Node::Kind::product;
    product.position = peek().position;
    product.begin = first.begin;
    product.ops.push_back('*');
    product.op_positions.push_back(first.begin);
    product.children.push_back(std::move(first));
    while (peek().kind == Token::Kind::star || peek().kind == Token::Kind::slash) {
      const Token& op = take();
      product.ops.push_back(op.text[0]);
      product.op_positions.push_back(op.position);
      product.children.push_back(parse_unary());
    }
    product.end = product.children.back().end;
    return product;
  }

  Node parse_unary() {
    DepthGuard guard(*this);
    if (peek().kind == Token::Kind::plus || peek().kind == Token::Kind::minus) {
      const Token& sign = take();
      const bool negative = sign.kind == Token::Kind::minus;
      const std::size_t position = sign.position;
      Node operand = parse_unary();
      if (!negative) {
        operand.begin = position;
        return operand;
      }
      Node negate;
      negate.kind = Node::Kind::negate;
      negate.position = position;
      negate.begin = position;
      negate.end = operand.end;
      negate.text = "-";
      negate.children.push_back(std::move(operand));
      return negate;
    }
    return parse_power();
  }

  Node parse_power() {
    Node base = parse_primary();
    if (peek().kind != Token::Kind::power) return base;
    const Token& op = take();
    Node power;
    power.kind = Node::Kind::power;
    power.position = op.position;
    power.text = op.text;
    power.begin = base.begin;
    power.children.push_back(std::move(base));
    power.children.push_back(parse_unary());
    power.end = power.children.back().end;
    return power;
  }

  Node parse_primary() {
    const Token& t = peek();
    Node node;
    node.position = t.position;
    node.begin = t.position;
    node.end = t.position + t.text.size();
    node.text = t.text;
    switch (t.kind) {
      case Token::Kind::number:
        node.kind = Node::Kind::number;
        node.value = t.value;
        take();
        return node;
      case Token::Kind::name:
        node.kind = Node::Kind::name;
        take();
        return node;
      case Token::Kind::lparen: {
        const Token& open = take();
        const std::size_t open_position = open.position;
        Node inner = parse_sum();
        const Token& close = peek();
        if (close.kind == Token::Kind::end) {
          fail("unbalanced parenthesis: '(' is never closed", open_position, "(");
        }
        if (close.kind != Token::Kind::rparen) {
          fail("expected ')' or an operator before this symbol", close.position, close.text);
        }
        inner.begin = open_position;
        inner.end = close.position + 1;
        take();
        return inner;
      }
      case Token::Kind::end:
        if (next_ > 0) {
          const Token& previous = tokens_[next_ - 1];
          fail("expected a number, name or '(' after this operator, found the end of the formula",
               previous.position, previous.text);
        }
        fail("empty formula", 0, "");
      default:
        fail("expected a number, name or '(' here", t.position, t.text);
    }
  }

  std::vector<Token> tokens_;
  std::size_t next_ = 0;
  int depth_ = 0;
};

}  // namespace

Node parse(const std::string& text) { return Parser(text).parse(); }

// ---------------------------------------------------------------------------------------------
// Expansion into a polynomial: sum of factor * coefficient? * prod(variable^power).

namespace {

using Key = std::pair<int, std::vector<int>>;  // coefficient index (-1: none), powers
using Poly = std::map<Key, double>;            // key -> nonzero factor

int degree(const std::vector<int>& powers) {
  return std::accumulate(powers.begin(), powers.end(), 0);
}

class Expander {
 public:
  Expander(const std::string& text, const std::vector<std::string>& coefficient_names,
           const std::vector<std::string>& variable_names)
      : text_(text), coefficient_names_(coefficient_names), variable_count_(variable_names.size()) {
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
    }
    fail("internal error: unknown formula node", node.position, node.text);
  }

 private:
  struct NameInfo {
    bool is_coefficient;
    int index;
  };

  Poly constant(double value) const {
    Poly p;
    if (value != 0.0) p.emplace(Key{-1, std::vector<int>(variable_count_, 0)}, value);
    return p;
  }

  static bool is_constant(const Poly& p) {
    if (p.empty()) return true;
    if (p.size() > 1) return false;
    const Key& key = p.begin()->first;
    return key.first < 0 && degree(key.second) == 0;
  }

  static double constant_value(const Poly& p) { return p.empty() ? 0.0 : p.begin()->second; }

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

  std::string span(const Node& node) const {
    return text_.substr(node.begin, node.end - node.begin);
  }

  Poly name(const Node& node) const {
    const auto it = names_.find(node.text);
    if (it == names_.end()) {
      fail("undeclared symbol (neither a declared coefficient nor a declared variable)",
           node.position, node.text);
    }
    std::vector<int> powers(variable_count_, 0);
    if (it->second.is_coefficient) return Poly{{Key{it->second.index, powers}, 1.0}};
    powers[static_cast<std::size_t>(it->second.index)] = 1;
    return Poly{{Key{-1, powers}, 1.0}};
  }

  // First name node (left to right) in `node` that satisfies `pred`; never null when the
  // expansion of `node` contains a matching symbol.
  template <class Pred>
  static const Node* find_name(const Node& node, const Pred& pred) {
    if (node.kind == Node::Kind::name && pred(node.text)) return &node;
    for (const Node& child : node.children) {
      if (const Node* found = find_name(child, pred)) return found;
    }
    return nullptr;
  }

  // Fails naming the first name in `node` that is a coefficient present in `p` (if any).
  void fail_on_coefficient(const Poly& p, const Node& node, const std::string& message) const {
    std::set<int> present;
    for (const auto& term : p) {
      if (term.first.first >= 0) present.insert(term.first.first);
    }
    if (present.empty()) return;
    const Node* found = find_name(node, [&](const std::string& n) {
      const auto it = names_.find(n);
      return it != names_.end() && it->second.is_coefficient && present.count(it->second.index);
    });
    if (found != nullptr) fail(message, found->position, found->text);
    fail(message, node.begin, span(node));
  }

  // Fails naming the first name in `node` that is a variable present in `p` (if any).
  void fail_on_variable(const Poly& p, const Node& node, const std::string& message) const {
    std::set<int> present;
    for (const auto& term : p) {
      for (std::size_t v = 0; v < variable_count_; ++v) {
        if (term.first.second[v] != 0) present.insert(static_cast<int>(v));
      }
    }
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

  // lhs * rhs, where `rhs_node` is the AST of rhs (to name an offending coefficient).
  Poly multiply(const Poly& lhs, const Poly& rhs, const Node& rhs_node, std::size_t op_position,
                const std::string& op) const {
    Poly out;
    for (const auto& l : lhs) {
      for (const auto& r : rhs) {
        const int lc = l.first.first;
        const int rc = r.first.first;
        if (lc >= 0 && rc >= 0) {
          const std::string& rname = coefficient_name(rc);
          const Node* found = find_name(rhs_node, [&](const std::string& n) { return n == rname; });
          const std::size_t position = found != nullptr ? found->position : op_position;
          if (lc == rc) {
            fail(
                "coefficient is not linear (multiplied by itself); a term must be linear in "
                "its coefficient",
                position, rname);
          }
          fail("term has two coefficients ('" + coefficient_name(lc) + "' and '" + rname +
                   "'); a term may have at most one",
               position, rname);
        }
        std::vector<int> powers(variable_count_, 0);
        for (std::size_t v = 0; v < variable_count_; ++v) {
          powers[v] = l.first.second[v] + r.first.second[v];
        }
        if (degree(powers) > kMaxDegree) {
          fail("term degree above " + std::to_string(kMaxDegree), op_position, op);
        }
        out[Key{lc >= 0 ? lc : rc, std::move(powers)}] += l.second * r.second;
      }
      check_size(out, op_position, op);
    }
    for (auto it = out.begin(); it != out.end();) {
      it = it->second == 0.0 ? out.erase(it) : std::next(it);
    }
    check_finite(out, op_position, op);
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
        fail_on_coefficient(operand, child,
                            "coefficient is not linear (used in a divisor); division is by a "
                            "numeric constant only");
        fail_on_variable(operand, child,
                         "division by a non-constant; division is by a numeric constant only");
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
      fail_on_coefficient(exponent, exponent_node,
                          "coefficient is not linear (used in an exponent)");
      fail_on_variable(exponent, exponent_node,
                       "exponent must be a constant, not depend on a variable");
    }
    const double n = constant_value(exponent);
    if (n < 0.0 || n != std::floor(n)) {
      fail("exponent must be a non-negative integer", exponent_node.begin, span(exponent_node));
    }
    if (is_constant(base)) {
      Poly out = constant(std::pow(constant_value(base), n));
      check_finite(out, node.position, node.text);
      return out;
    }
    if (n == 0.0) return constant(1.0);
    if (n == 1.0) return base;
    fail_on_coefficient(base, base_node,
                        "coefficient is not linear (raised to a power); a term must be linear "
                        "in its coefficient");
    int max_degree = 0;
    for (const auto& term : base) max_degree = std::max(max_degree, degree(term.first.second));
    if (static_cast<double>(max_degree) * n > kMaxDegree) {
      fail("term degree above " + std::to_string(kMaxDegree), node.position, node.text);
    }
    Poly out = base;
    for (int k = 1; k < static_cast<int>(n); ++k) {
      out = multiply(out, base, base_node, node.position, node.text);
    }
    return out;
  }

  const std::string& coefficient_name(int index) const {
    return coefficient_names_[static_cast<std::size_t>(index)];
  }

  const std::string& text_;
  const std::vector<std::string>& coefficient_names_;
  std::size_t variable_count_;
  std::map<std::string, NameInfo> names_;
};

// Indices of `names` sorted by name (byte order).
std::vector<std::size_t> name_order(const std::vector<std::string>& names) {
  std::vector<std::size_t> order(names.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return names[a] < names[b]; });
  return order;
}

}  // namespace

std::vector<Monomial> expand(const Node& root, const std::string& text,
                             const std::vector<std::string>& coefficient_names,
                             const std::vector<std::string>& variable_names) {
  const Poly poly = Expander(text, coefficient_names, variable_names).expand(root);
  std::vector<Monomial> monomials;
  monomials.reserve(poly.size());
  for (const auto& term : poly) {
    Monomial m;
    m.factor = term.second;
    m.coefficient = term.first.first;
    m.powers = term.first.second;
    monomials.push_back(std::move(m));
  }

  // Canonical order: coefficient terms grouped by coefficient name, offset terms last; then
  // total degree, highest first; then the powers in variable-name order, highest first.
  const std::vector<std::size_t> coefficient_order = name_order(coefficient_names);
  std::vector<std::size_t> coefficient_rank(coefficient_names.size());
  for (std::size_t r = 0; r < coefficient_order.size(); ++r)
    coefficient_rank[coefficient_order[r]] = r;
  const std::vector<std::size_t> variable_order = name_order(variable_names);
  const auto group = [&](const Monomial& m) {
    return m.coefficient < 0 ? coefficient_names.size()
                             : coefficient_rank[static_cast<std::size_t>(m.coefficient)];
  };
  std::sort(monomials.begin(), monomials.end(), [&](const Monomial& a, const Monomial& b) {
    if (group(a) != group(b)) return group(a) < group(b);
    const int da = degree(a.powers);
    const int db = degree(b.powers);
    if (da != db) return da > db;
    for (std::size_t v : variable_order) {
      if (a.powers[v] != b.powers[v]) return a.powers[v] > b.powers[v];
    }
    return false;
  });
  return monomials;
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

std::string print(const std::vector<Monomial>& monomials,
                  const std::vector<std::string>& coefficient_names,
                  const std::vector<std::string>& variable_names) {
  if (monomials.empty()) return "0";
  const std::vector<std::size_t> variable_order = name_order(variable_names);
  std::string out;
  for (std::size_t i = 0; i < monomials.size(); ++i) {
    const Monomial& m = monomials[i];
    const bool negative = m.factor < 0.0;
    const double magnitude = std::fabs(m.factor);
    std::string term;
    const auto append = [&term](const std::string& part) {
      if (!term.empty()) term += '*';
      term += part;
    };
    const bool bare = m.coefficient < 0 && degree(m.powers) == 0;
    if (magnitude != 1.0 || bare) append(format_number(magnitude));
    if (m.coefficient >= 0) append(coefficient_names[static_cast<std::size_t>(m.coefficient)]);
    for (std::size_t v : variable_order) {
      if (m.powers[v] == 0) continue;
      append(variable_names[v] + (m.powers[v] > 1 ? "^" + std::to_string(m.powers[v]) : ""));
    }
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
