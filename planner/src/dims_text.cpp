#include "xpm/planner/dims_text.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <system_error>

namespace xpm {
namespace {

std::string number_text(double value) {
  if (std::isfinite(value) && std::floor(value) == value && std::abs(value) < 9.0e15) {
    return std::to_string(static_cast<std::int64_t>(value));
  }
  char buffer[64];
  const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, value);
  return error == std::errc() ? std::string(buffer, end) : std::to_string(value);
}

}  // namespace

std::string dims_text(const std::vector<std::string>& variable_names, const std::vector<double>& dims) {
  std::string text;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const std::string name = i < variable_names.size() ? variable_names[i] : "dim" + std::to_string(i);
    text += (i == 0 ? "" : " ") + name + "=" + number_text(dims[i]);
  }
  return text;
}

}  // namespace xpm
