// packer_kind.cpp — the packers' names and make_packer (see packer_kind.hpp).
#include "xpm/planner/packer_kind.hpp"

#include <stdexcept>

#include "xpm/planner/enum_names.hpp"
#include "xpm/planner/ffd_packer.hpp"

namespace xpm {
namespace {

constexpr EnumNames<PackerKind, 3> kPackerNames{{{PackerKind::kAdaptive, "adaptive"},
                                                 {PackerKind::kUniform, "uniform"},
                                                 {PackerKind::kFirstFitDecreasing, "ffd"}}};

}  // namespace

std::string to_string(PackerKind kind) { return enum_name(kPackerNames, kind); }

PackerKind parse_packer_kind(const std::string& text, const std::string& source) {
  return parse_enum(kPackerNames, text, source);
}

std::shared_ptr<const MicrobatchPacker> make_packer(PackerKind kind, const std::string& sort_by) {
  if (kind == PackerKind::kAdaptive) return std::make_shared<AdaptivePacker>(AdaptivePackerOptions{sort_by});
  if (!sort_by.empty()) {
    throw std::invalid_argument("sort_by '" + sort_by + "' applies to the adaptive packer only, not '" +
                                to_string(kind) + "'");
  }
  if (kind == PackerKind::kUniform) return std::make_shared<UniformPacker>();
  return std::make_shared<FirstFitDecreasingPacker>();
}

}  // namespace xpm
