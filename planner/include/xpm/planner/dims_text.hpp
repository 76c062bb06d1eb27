// xpm/planner/dims_text.hpp — dims as a user reads them in messages: "bs=8 l=64".
//
//   dims_text({"bs", "l"}, {8, 64});     // "bs=8 l=64"
//   dims_text({"bs", "hw"}, {2, 0.5});   // "bs=2 hw=0.5"
#pragma once

#include <string>
#include <vector>

namespace xpm {

/// Each value after its variable's name, separated by spaces; whole numbers without a decimal
/// point, others in the shortest form that reads back exactly. A value without a name (more
/// dims than names) is shown as dim<i>=...
std::string dims_text(const std::vector<std::string>& variable_names, const std::vector<double>& dims);

}  // namespace xpm
