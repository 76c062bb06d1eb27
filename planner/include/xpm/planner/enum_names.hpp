// xpm/planner/enum_names.hpp — one name per value of a closed set (an enum), read both ways.
// Every enum of xpm that crosses a text edge (a CLI option, a config file, a model file) has
// one table; its `to_string(value)` and `parse_<enum>(text, source)` are written with these two
// functions, so every error for an unknown name reads the same:
//
//   enum class Fruit { kApple, kPear };
//   constexpr xpm::EnumNames<Fruit, 2> kFruitNames{{{Fruit::kApple, "apple"}, {Fruit::kPear, "pear"}}};
//   std::string to_string(Fruit f) { return xpm::enum_name(kFruitNames, f); }
//   Fruit parse_fruit(const std::string& text, const std::string& source) {
//     return xpm::parse_enum(kFruitNames, text, source);
//   }
//   parse_fruit("fig", "--fruit");  // std::invalid_argument: --fruit must be 'apple' or 'pear', got 'fig'
#pragma once

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

namespace xpm {

/// Each value of `Enum` with its name; a value appears once.
template <class Enum, std::size_t N>
using EnumNames = std::array<std::pair<Enum, const char*>, N>;

/// "'a', 'b' or 'c'": the names in table order, for error messages.
template <class Enum, std::size_t N>
std::string enum_name_list(const EnumNames<Enum, N>& names) {
  std::string list;
  for (std::size_t i = 0; i < N; ++i) {
    if (i > 0) list += i + 1 == N ? " or " : ", ";
    list += std::string("'") + names[i].second + "'";
  }
  return list;
}

/// The value named `text`. Throws std::invalid_argument "<source> must be 'a', 'b' or 'c', got
/// '<text>'" for any other text (case-sensitive).
template <class Enum, std::size_t N>
Enum parse_enum(const EnumNames<Enum, N>& names, const std::string& text, const std::string& source) {
  for (const auto& [value, name] : names) {
    if (text == name) return value;
  }
  throw std::invalid_argument(source + " must be " + enum_name_list(names) + ", got '" + text + "'");
}

/// The name of `value`. Throws std::logic_error for a value missing from the table (a table
/// that lags its enum).
template <class Enum, std::size_t N>
const char* enum_name(const EnumNames<Enum, N>& names, Enum value) {
  for (const auto& [entry, name] : names) {
    if (entry == value) return name;
  }
  throw std::logic_error("an enum value without a name in its table");
}

}  // namespace xpm
