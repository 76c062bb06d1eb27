// formula_lexer.cpp — cost formulas: the tokenizer (numbers, names, operators) and the error
// every stage of the formula's reading throws. Grammar: docs/formula.md.
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

[[noreturn]] void fail(const std::string& message, std::size_t position, std::string symbol) {
  throw FormulaError(message, position, std::move(symbol));
}

namespace {

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
      case ',':
        token.kind = Token::Kind::comma;
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

}  // namespace xpm::formula_ast
