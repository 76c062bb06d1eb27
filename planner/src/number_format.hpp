// Number, list and dims formatting shared by the fit's messages and reports (internal to
// xpm::planner).
#pragma once

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "xpm/planner/formula.hpp"

namespace xpm::detail {

/// Round-trip precision (17 significant digits).
inline std::string format_double(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

/// Six significant digits, for reports.
inline std::string short_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

/// A relative value as a percentage with three significant digits: 0.0123 -> "1.23 %".
inline std::string percent(double rel) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g %%", rel * 100.0);
  return buf;
}

/// "a", "a, b", "a, b, c".
inline std::string comma_list(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

/// "a", "a and b", "a, b and c".
inline std::string and_list(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " and " : ", ";
    out += names[i];
  }
  return out;
}

/// The dims of a point in the fit's messages: "bs = 4, l = 64".
inline std::string describe_dims(const CostFormula& formula, const std::vector<double>& dims) {
  std::string out;
  for (std::size_t v = 0; v < dims.size(); ++v) {
    if (v > 0) out += ", ";
    out += formula.variable_names()[v] + " = " + short_double(dims[v]);
  }
  return out;
}

}  // namespace xpm::detail
