// report_sections.hpp — the generated sections of docs/benchmarks.md: Markdown and SVG figures
// (xpm_svg_plot) from the benchmark outputs. Used by bench-report.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "report_common.hpp"

namespace xpm_bench {

struct Section {
  std::string markdown;                       // goes between the section's markers
  std::map<std::string, std::string> figures;  // file name (bench-*.svg) -> SVG document
};

/// Packers: goals, Brown table, all distributions, the demo budget, and bench-plan-time.svg.
/// Rows are packer_bench's (BM_Packer_<packer>/<distribution>/<formula>/<records>).
Section packers_section(const std::vector<BenchmarkRow>& rows);

/// Fit: per bundled model (heldout-prediction --json files) canonicalize / fit / predict times
/// and held-out error in one table; fit time vs number of probes from fit_bench's rows.
Section fit_section(const std::vector<BenchmarkRow>& rows, const std::vector<nlohmann::json>& heldout);

/// Batchers: batcher-comparison's JSON: throughput table and bars, the limit case, the
/// overhead, microbatch fill histogram and measured vs predicted peaks.
Section batchers_section(const nlohmann::json& batchers);

}  // namespace xpm_bench
