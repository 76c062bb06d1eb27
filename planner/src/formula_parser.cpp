// formula_parser.cpp — cost formulas: the recursive-descent parser from tokens to the AST.
// Grammar: docs/formula.md.
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
namespace {

constexpr const char* kMaxFunction = "max";

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parser
//
//   sum     := product (('+' | '-') product)*
//   product := unary (('*' | '/') unary)*
//   unary   := ('+' | '-') unary | power
//   power   := primary (('^' | '**') unary)?        right-associative: 2^3^2 = 2^(3^2)
//   primary := number | name | call | '(' sum ')'
//   call    := 'max' '(' sum (',' sum)+ ')'

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
    if (t.kind == Token::Kind::comma) {
      fail("',' outside max(...); arguments are separated by ',' only inside max(...)",
           t.position, t.text);
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
        if (t.text == kMaxFunction) return parse_call();
        node.kind = Node::Kind::name;
        take();
        if (peek().kind == Token::Kind::lparen) {
          fail("unknown function '" + node.text + "'; the only function is max(...) (write '*' " +
                   "for a product)",
               node.position, node.text);
        }
        return node;
      case Token::Kind::lparen: {
        const Token& open = take();
        const std::size_t open_position = open.position;
        Node inner = parse_sum();
        const Token& close = peek();
        if (close.kind == Token::Kind::end) {
          fail("unbalanced parenthesis: '(' is never closed", open_position, "(");
        }
        if (close.kind == Token::Kind::comma) {
          fail("',' outside max(...); arguments are separated by ',' only inside max(...)",
               close.position, close.text);
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

  // 'max' '(' sum (',' sum)+ ')'; the current token is the name 'max'.
  Node parse_call() {
    DepthGuard guard(*this);
    const Token& name = take();
    Node call;
    call.kind = Node::Kind::call;
    call.position = name.position;
    call.begin = name.position;
    call.text = name.text;
    if (peek().kind != Token::Kind::lparen) {
      fail("'max' is a function; write max(e1, e2, ...)", name.position, name.text);
    }
    const std::size_t open_position = take().position;
    for (;;) {
      if (peek().kind == Token::Kind::end) {
        fail("unbalanced parenthesis: '(' is never closed", open_position, "(");
      }
      call.children.push_back(parse_sum());
      const Token& t = peek();
      if (t.kind == Token::Kind::comma) {
        take();
        continue;
      }
      if (t.kind == Token::Kind::rparen) {
        call.end = t.position + 1;
        take();
        break;
      }
      if (t.kind == Token::Kind::end) {
        fail("unbalanced parenthesis: '(' is never closed", open_position, "(");
      }
      fail("expected ',' or ')' in max(...) before this symbol", t.position, t.text);
    }
    if (call.children.size() < 2) {
      fail("max(...) needs two arguments or more, got 1", call.position, call.text);
    }
    return call;
  }

  std::vector<Token> tokens_;
  std::size_t next_ = 0;
  int depth_ = 0;
};

}  // namespace

Node parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace xpm::formula_ast
