#include <doctest/doctest.h>

#include "xpm/planner/dims_text.hpp"

TEST_CASE("dims_text names each dim: whole numbers without a decimal point, others exactly") {
  CHECK(xpm::dims_text({"bs", "l"}, {8, 64}) == "bs=8 l=64");
  CHECK(xpm::dims_text({"bs", "hw"}, {2, 0.5}) == "bs=2 hw=0.5");
  CHECK(xpm::dims_text({"bs"}, {3000000, 7}) == "bs=3000000 dim1=7");
  CHECK(xpm::dims_text({"bs", "l"}, {}).empty());
}
