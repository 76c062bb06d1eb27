// report_fit.cpp — the fit section of docs/benchmarks.md (see report_sections.hpp).
#include <cmath>

#include "report_sections.hpp"

namespace xpm_bench {

Section fit_section(const std::vector<BenchmarkRow>& rows, const std::vector<nlohmann::json>& heldout) {
  Section section;
  std::string& md = section.markdown;
  md += "| bundled model | formula | probes (out of memory) | canonicalize | fit on its probes | predict | "
        "largest microbatch | held-out shapes | held-out max \\|error\\| |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const nlohmann::json& h : heldout) {
    const nlohmann::json timing = h.value("timing", nlohmann::json::object());
    auto time_of = [&](const char* key) {
      return timing.contains(key) ? duration(timing.at(key).get<double>()) : std::string("-");
    };
    md += format("| %s | `%s` | %lld (%lld) | %s | %s | %s | %s | %zu | %.4f %% |\n",
                 h.at("architecture").get<std::string>().c_str(), h.at("formula").get<std::string>().c_str(),
                 static_cast<long long>(h.at("probes").get<std::int64_t>()),
                 static_cast<long long>(h.at("infeasible_probes").get<std::int64_t>()), time_of("canonicalize_s").c_str(),
                 time_of("fit_s").c_str(), time_of("predict_s").c_str(), time_of("max_microbatch_size_s").c_str(),
                 h.at("rows").size(), 100 * h.at("max_abs_rel_error").get<double>());
  }
  if (heldout.empty()) md += "| _heldout-prediction did not run_ | | | | | | | | |\n";

  md += "\nFit time vs number of probes (synthetic probes of the Transformer's formula, `fit_bench`):\n\n"
        "| probes | fit, leave-one-out on (as xpm-train) | fit, leave-one-out off | non-linear `max(c, a*bs*l^p)` |\n"
        "|---:|---:|---:|---:|\n";
  std::map<int, std::map<std::string, double>> by_probes;
  for (const BenchmarkRow& r : rows) {
    if (r.parts.size() == 2 && r.parts[0].rfind("BM_Fit_", 0) == 0) {
      by_probes[std::stoi(r.parts[1])][r.parts[0]] = r.cpu_s;
    }
  }
  for (const auto& [probes, times] : by_probes) {
    auto cell = [&](const char* name) {
      auto it = times.find(name);
      return it == times.end() ? std::string("-") : duration(it->second);
    };
    md += format("| %d | %s | %s | %s |\n", probes, cell("BM_Fit_Linear").c_str(),
                 cell("BM_Fit_LinearNoLeaveOneOut").c_str(), cell("BM_Fit_Nonlinear").c_str());
  }
  md += "\n| operation (`fit_bench`) | CPU time |\n|---|---:|\n";
  for (const BenchmarkRow& r : rows) {
    if (r.parts[0].rfind("BM_Fit_", 0) == 0) continue;
    md += "| `" + r.name + "` | " + duration(r.cpu_s) + " |\n";
  }
  return section;
}

}  // namespace xpm_bench
