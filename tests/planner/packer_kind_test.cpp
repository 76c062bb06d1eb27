// Tests of packer_kind.hpp (the packers by name, make_packer), enum_names.hpp and
// record_dims_from_lengths (record_dims_view.hpp).
#include <stdexcept>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include "xpm/planner/enum_names.hpp"
#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/record_dims_view.hpp"

namespace {

enum class Fruit { kApple, kPear, kFig };
constexpr xpm::EnumNames<Fruit, 3> kFruitNames{{{Fruit::kApple, "apple"}, {Fruit::kPear, "pear"}, {Fruit::kFig, "fig"}}};

}  // namespace

TEST_CASE("an enum's name table reads both ways and names every choice in its error") {
  CHECK(xpm::parse_enum(kFruitNames, "pear", "--fruit") == Fruit::kPear);
  CHECK(std::string(xpm::enum_name(kFruitNames, Fruit::kFig)) == "fig");
  CHECK(xpm::enum_name_list(kFruitNames) == "'apple', 'pear' or 'fig'");
  CHECK_THROWS_WITH_AS(xpm::parse_enum(kFruitNames, "Pear", "--fruit"),
                       "--fruit must be 'apple', 'pear' or 'fig', got 'Pear'", std::invalid_argument);
}

TEST_CASE("make_packer builds each packer by kind; sort_by is the adaptive and fastest packers' alone") {
  for (const char* name : {"adaptive", "uniform", "ffd", "fastest"}) {
    const xpm::PackerKind kind = xpm::parse_packer_kind(name, "--packer");
    CHECK(xpm::to_string(kind) == name);
    CHECK(xpm::make_packer(kind)->name().rfind(name, 0) == 0);
  }
  CHECK_THROWS_WITH_AS(xpm::parse_packer_kind("best", "--packer"),
                       "--packer must be 'adaptive', 'uniform', 'ffd' or 'fastest', got 'best'", std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::make_packer(xpm::PackerKind::kUniform, "l"),
                       "sort_by 'l' applies to the adaptive and fastest packers only, not 'uniform'", std::invalid_argument);
  CHECK(xpm::make_packer(xpm::PackerKind::kAdaptive, "l")->name().find("l") != std::string::npos);
}

TEST_CASE("record_dims_from_lengths puts 1 under the batch size and the length under every other variable") {
  const std::vector<std::vector<double>> dims = xpm::record_dims_from_lengths({12, 40}, {"l", "bs", "t"});
  CHECK(dims == std::vector<std::vector<double>>{{12, 1, 12}, {40, 1, 40}});
  CHECK(xpm::record_dims_from_lengths({}, {"bs", "l"}).empty());
  CHECK_THROWS_WITH_AS(xpm::record_dims_from_lengths({3}, {"n", "l"}),
                       "record_dims_from_lengths: the variables lack the batch size 'bs'", std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::record_dims_from_lengths({3}, {"bs"}),
                       "record_dims_from_lengths: no variable besides the batch size 'bs'", std::invalid_argument);
  CHECK_THROWS_AS(xpm::record_dims_from_lengths({3, -1}, {"bs", "l"}), std::invalid_argument);
}
