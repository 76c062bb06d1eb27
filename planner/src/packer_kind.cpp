// packer_kind.cpp — the packers' table: names, make_packer (see packer_kind.hpp).
#include "xpm/planner/packer_kind.hpp"

#include <array>
#include <cstddef>
#include <stdexcept>
#include <utility>

#include "xpm/planner/enum_names.hpp"
#include "xpm/planner/fastest_packer.hpp"
#include "xpm/planner/ffd_packer.hpp"

namespace xpm {
namespace {

using PackerPtr = std::shared_ptr<const MicrobatchPacker>;

// The packers, one row each: a new packer is its class in a file of its own, a PackerKind value
// and a row here (its name, whether it takes sort_by, how it is made).
struct PackerRegistration {
  PackerKind kind;
  const char* name;
  bool takes_sort_by;
  PackerPtr (*make)(const std::string& sort_by);
};
constexpr std::array<PackerRegistration, 4> kPackers{{
    {PackerKind::kAdaptive, "adaptive", true,
     [](const std::string& sort_by) -> PackerPtr { return std::make_shared<AdaptivePacker>(AdaptivePackerOptions{sort_by}); }},
    {PackerKind::kUniform, "uniform", false,
     [](const std::string&) -> PackerPtr { return std::make_shared<UniformPacker>(); }},
    {PackerKind::kFirstFitDecreasing, "ffd", false,
     [](const std::string&) -> PackerPtr { return std::make_shared<FirstFitDecreasingPacker>(); }},
    {PackerKind::kFastest, "fastest", true,
     [](const std::string& sort_by) -> PackerPtr { return std::make_shared<FastestPacker>(sort_by); }},
}};

template <std::size_t... I>
constexpr EnumNames<PackerKind, sizeof...(I)> names_of(std::index_sequence<I...>) {
  return {{{kPackers[I].kind, kPackers[I].name}...}};
}
constexpr auto kPackerNames = names_of(std::make_index_sequence<kPackers.size()>{});

const PackerRegistration& registration(PackerKind kind) {
  for (const PackerRegistration& packer : kPackers) {
    if (packer.kind == kind) return packer;
  }
  throw std::logic_error("a PackerKind without a row in the packers' table");
}

}  // namespace

std::string to_string(PackerKind kind) { return enum_name(kPackerNames, kind); }

PackerKind parse_packer_kind(const std::string& text, const std::string& source) {
  return parse_enum(kPackerNames, text, source);
}

std::vector<std::string> packer_names() {
  std::vector<std::string> names;
  for (const PackerRegistration& packer : kPackers) names.emplace_back(packer.name);
  return names;
}

bool packer_takes_sort_by(PackerKind kind) { return registration(kind).takes_sort_by; }

std::shared_ptr<const MicrobatchPacker> make_packer(PackerKind kind, const std::string& sort_by) {
  const PackerRegistration& packer = registration(kind);
  if (!sort_by.empty() && !packer.takes_sort_by) {
    throw std::invalid_argument("sort_by '" + sort_by + "' applies to the adaptive and fastest packers only, not '" +
                                to_string(kind) + "'");
  }
  return packer.make(sort_by);
}

}  // namespace xpm
