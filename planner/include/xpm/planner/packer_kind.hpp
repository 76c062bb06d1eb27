// xpm/planner/packer_kind.hpp — the packers by name, and the one factory that builds them.
//
//   const xpm::PackerKind kind = xpm::parse_packer_kind("ffd", "--packer");
//   std::shared_ptr<const xpm::MicrobatchPacker> packer = xpm::make_packer(kind);
//   xpm::make_packer(xpm::PackerKind::kAdaptive, "l");  // sorted by l, longest first
//
// A new packer: its MicrobatchPacker in a file of its own, a PackerKind value, and one row in
// the packers' table of packer_kind.cpp (name, whether it takes sort_by, how it is made); the
// CLIs and the Python package take its name from there.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "xpm/planner/packer.hpp"

namespace xpm {

enum class PackerKind {
  kAdaptive,            // AdaptivePacker (packer.hpp): grows each microbatch record by record
  kUniform,             // UniformPacker (packer.hpp): one size for the whole outer batch
  kFirstFitDecreasing,  // FirstFitDecreasingPacker (ffd_packer.hpp): best with a summed dim
  kFastest,             // FastestPacker (fastest_packer.hpp): least predicted time (a time model)
};

std::string to_string(PackerKind kind);  // "adaptive" | "uniform" | "ffd" | "fastest"
/// Throws std::invalid_argument "<source> must be 'adaptive', 'uniform', 'ffd' or 'fastest', got
/// '<text>'".
PackerKind parse_packer_kind(const std::string& text, const std::string& source);

/// Every packer's name, in the table's order ("adaptive", "uniform", "ffd", "fastest").
std::vector<std::string> packer_names();
/// Whether the packer of `kind` takes a sort_by (the adaptive and the fastest one).
bool packer_takes_sort_by(PackerKind kind);

/// The packer of `kind`. `sort_by` (AdaptivePackerOptions::sort_by: variables, comma-separated,
/// heaviest first; FastestPacker: one variable) applies to kAdaptive and kFastest only; throws
/// std::invalid_argument for a non-empty sort_by with another kind. Thread-safe; the packers
/// are stateless.
std::shared_ptr<const MicrobatchPacker> make_packer(PackerKind kind, const std::string& sort_by = "");

}  // namespace xpm
