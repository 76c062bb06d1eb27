// report_packers.cpp — the packers section of docs/benchmarks.md (see report_sections.hpp).
#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <set>

#include "report_sections.hpp"
#include "xpm_plan/svg_plot.hpp"

namespace xpm_bench {
namespace {

// A series with its label, kind and colour; data filled in afterwards.
struct PackerRow {
  std::string packer, distribution, formula;
  double records = 0;
  const BenchmarkRow* row = nullptr;
};

const std::vector<std::string> kPackers = {"Uniform", "Adaptive", "AdaptiveSorted", "FFD",
                                           "MaxTokens", "Reference", "ReferenceSorted"};
const std::map<std::string, std::string> kPackerNames = {
    {"Uniform", "UniformPacker"},
    {"Adaptive", "AdaptivePacker, record order"},
    {"AdaptiveSorted", "AdaptivePacker, sort_by l"},
    {"FFD", "first fit decreasing (ours)"},
    {"MaxTokens", "fairseq max_tokens (baseline)"},
    {"Reference", "reference algorithm, record order"},
    {"ReferenceSorted", "reference algorithm, sorted"}};
const std::map<std::string, std::string> kColors = {
    {"Uniform", "#7f7f7f"}, {"Adaptive", "#1f77b4"}, {"AdaptiveSorted", "#2ca02c"},
    {"FFD", "#9467bd"}, {"MaxTokens", "#ff7f0e"}, {"Reference", "#d62728"},
    {"ReferenceSorted", "#8c564b"}};

std::vector<PackerRow> packer_rows(const std::vector<BenchmarkRow>& rows) {
  std::vector<PackerRow> out;
  for (const BenchmarkRow& r : rows) {
    if (r.parts.size() != 4 || r.parts[0].rfind("BM_Packer_", 0) != 0) continue;
    out.push_back({r.parts[0].substr(10), r.parts[1], r.parts[2], std::stod(r.parts[3]), &r});
  }
  return out;
}

const PackerRow* find(const std::vector<PackerRow>& rows, const std::string& packer,
                      const std::string& distribution, const std::string& formula, double records) {
  for (const PackerRow& r : rows) {
    if (r.packer == packer && r.distribution == distribution && r.formula == formula && r.records == records) {
      return &r;
    }
  }
  return nullptr;
}

std::string verdict(bool met) { return met ? "**met**" : "**missed**"; }

const std::vector<std::string> kFormulas = {"quadratic", "linear", "packed"};

// Goal: 1,048,576 Brown records planned in <= 0.2 s by the adaptive packer.
std::string adaptive_time_goal(const std::vector<PackerRow>& rows) {
  double worst = 0;
  std::string detail;
  for (const std::string& packer : {std::string("AdaptiveSorted"), std::string("Adaptive")}) {
    for (const std::string& f : kFormulas) {
      const PackerRow* r = find(rows, packer, "brown", f, 1048576);
      if (r == nullptr) continue;
      worst = std::max(worst, r->row->cpu_s);
      detail += (detail.empty() ? "" : "; ") + std::string(packer == "Adaptive" ? "unsorted " : "sorted ") + f +
                " " + duration(r->row->cpu_s);
    }
  }
  return "| 1,048,576 Brown records planned in <= 0.2 s by the adaptive packer | " + detail + " | " +
         verdict(worst > 0 && worst <= 0.2) + " |\n";
}

// Goal: >= 100x faster than the reference algorithm at 65,536 Brown records.
std::string reference_speed_goal(const std::vector<PackerRow>& rows, const std::string& ours,
                                 const std::string& reference) {
  double worst = 1e300;
  std::string detail;
  for (const std::string& f : kFormulas) {
    const PackerRow* a = find(rows, ours, "brown", f, 65536);
    const PackerRow* b = find(rows, reference, "brown", f, 65536);
    if (a == nullptr || b == nullptr) continue;
    const double ratio = b->row->cpu_s / a->row->cpu_s;
    worst = std::min(worst, ratio);
    detail += (detail.empty() ? "" : "; ") + f +
              format(" %.0fx (%s vs %s, %s records per microbatch)", ratio, duration(b->row->cpu_s).c_str(),
                     duration(a->row->cpu_s).c_str(), thousands(a->row->counter("records_per_microbatch")).c_str());
  }
  return std::string("| >= 100x faster than the reference algorithm at 65,536 Brown records, ") +
         (ours == "Adaptive" ? "both in record order" : "both sorted (what the reference recommends for variable lengths)") +
         " | " + detail + " | " + verdict(worst >= 100 && worst < 1e300) + " |\n";
}

// Goal: the sorted adaptive packer within 5 % of FFD in microbatch count on Brown.
std::string ffd_count_goal(const std::vector<PackerRow>& rows) {
  double worst = 0;
  std::string where;
  for (const PackerRow& r : rows) {
    if (r.packer != "AdaptiveSorted" || r.distribution != "brown" || r.formula == "quadratic-cpu") continue;
    const double v = r.row->counter("vs_ffd");
    if (v > worst) {
      worst = v;
      where = r.formula + format(", %s records", thousands(r.records).c_str());
    }
  }
  return format("| sorted adaptive packer within 5 %% of FFD in microbatch count on Brown | "
                "largest ratio %.3f (%s), over every size and formula | %s |\n",
                worst, where.c_str(), verdict(worst > 0 && worst <= 1.05).c_str());
}

// Brown lengths, Transformer formula: every packer at every size.
std::string brown_quadratic_table(const std::vector<PackerRow>& rows) {
  std::string md;
  md += "\n#### Brown lengths, Transformer formula (`a*bs*l^2 + b*bs*l + c`, budget c + 1 GiB)\n\n";
  md += "| packer | records | time per plan | records/s | ns per record | microbatches | lower bound | "
        "vs bound | vs FFD | utilization mean / min | padding waste |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n";
  for (const std::string& packer : kPackers) {
    for (const PackerRow& r : rows) {
      if (r.packer != packer || r.distribution != "brown" || r.formula != "quadratic") continue;
      const BenchmarkRow& b = *r.row;
      md += format("| %s | %s | %s | %s | %.1f | %s | %s | %.3f | %.3f | %.3f / %.3f | %.3f |\n",
                   kPackerNames.at(packer).c_str(), thousands(r.records).c_str(), duration(b.cpu_s).c_str(),
                   thousands(r.records / b.cpu_s).c_str(), 1e9 * b.cpu_s / r.records,
                   thousands(b.counter("microbatches")).c_str(), thousands(b.counter("lower_bound")).c_str(),
                   b.counter("vs_lower_bound"), b.counter("vs_ffd"), b.counter("util_mean"),
                   b.counter("util_min"), b.counter("padding_waste"));
    }
  }
  return md;
}

// A packer-by-column table's rows, one per distribution and formula: each cell what `cell`
// makes of that packer's benchmark row at `n` records (null: not run) and the formula.
std::string packer_grid(const std::vector<PackerRow>& rows, double n,
                        const std::function<std::string(const PackerRow*, const std::string&)>& cell) {
  std::string md = "| lengths | formula |";
  for (const std::string& p : kPackers) md += " " + p + " |";
  md += "\n|---|---|";
  for (std::size_t i = 0; i < kPackers.size(); ++i) md += "---|";
  md += "\n";
  for (const std::string& d : {std::string("brown"), std::string("uniform"), std::string("lognormal"),
                               std::string("bimodal")}) {
    for (const std::string& f : kFormulas) {
      md += "| " + d + " | " + f + " |";
      for (const std::string& p : kPackers) md += cell(find(rows, p, d, f, n), f);
      md += "\n";
    }
  }
  return md;
}

// Every distribution and formula at `n` records: microbatches (x lower bound), time per plan.
std::string distributions_table(const std::vector<PackerRow>& rows, double n) {
  return format("\n#### Every distribution and formula, %s records: microbatches (x lower bound) "
                "and time per plan\n\n", thousands(n).c_str()) +
         packer_grid(rows, n, [](const PackerRow* r, const std::string&) {
           return r == nullptr ? std::string(" not run |")
                               : format(" %s (%.2f), %s |", thousands(r->row->counter("microbatches")).c_str(),
                                        r->row->counter("vs_lower_bound"), duration(r->row->cpu_s).c_str());
         });
}

// Utilization and padding waste of every packer, distribution and formula at 65,536 records.
std::string utilization_table(const std::vector<PackerRow>& rows) {
  return "\nUtilization (mean predicted bytes / budget) and padding waste (padded / real tokens - 1), "
         "65,536 records:\n\n" +
         packer_grid(rows, 65536, [](const PackerRow* r, const std::string& f) {
           if (r == nullptr) return std::string(" - |");
           return f == "packed" ? format(" %.3f |", r->row->counter("util_mean"))
                                : format(" %.3f / %.3f |", r->row->counter("util_mean"),
                                         r->row->counter("padding_waste"));
         });
}

// Brown, Transformer formula under the demo's CPU budget, and the reference's time there.
std::string cpu_budget_table(const std::vector<PackerRow>& rows) {
  std::string md;
  md += "\n#### Brown, Transformer formula under the demo's CPU budget (88 MB usable, about 60 sentences "
        "per microbatch)\n\n| packer | records | time per plan | microbatches | vs FFD |\n|---|---:|---:|---:|---:|\n";
  for (const std::string& packer : kPackers) {
    for (const PackerRow& r : rows) {
      if (r.packer != packer || r.formula != "quadratic-cpu") continue;
      md += format("| %s | %s | %s | %s | %.3f |\n", kPackerNames.at(packer).c_str(), thousands(r.records).c_str(),
                   duration(r.row->cpu_s).c_str(), thousands(r.row->counter("microbatches")).c_str(),
                   r.row->counter("vs_ffd"));
    }
  }
  const PackerRow* a = find(rows, "AdaptiveSorted", "brown", "quadratic-cpu", 65536);
  const PackerRow* b = find(rows, "ReferenceSorted", "brown", "quadratic-cpu", 65536);
  if (a != nullptr && b != nullptr) {
    md += format("\nAt 65,536 records under this budget the sorted reference takes %.0fx the sorted adaptive "
                 "packer's time.\n", b->row->cpu_s / a->row->cpu_s);
  }
  return md;
}

// Time per plan and per record against the outer batch size, Brown, quadratic, log-log.
std::string plan_time_figure(const std::vector<PackerRow>& rows) {
  xpm_plan::Figure fig;
  fig.title = "Time per plan vs outer batch size (Brown lengths, Transformer formula)";
  fig.notes = {"log-log: both axes are log10 values; CPU time per pack() call"};
  fig.add_panel("log10 records per outer batch", "log10 seconds per plan");
  fig.add_panel("log10 records per outer batch", "log10 nanoseconds per record");
  xpm_plan::Panel& top = fig.panels[0];  // references taken after both panels exist
  xpm_plan::Panel& bottom = fig.panels[1];
  for (const std::string& packer : kPackers) {
    xpm_plan::Series line = xpm_plan::make_series(kPackerNames.at(packer), xpm_plan::SeriesKind::kLine, kColors.at(packer));
    xpm_plan::Series points = xpm_plan::make_series("", xpm_plan::SeriesKind::kPoints, kColors.at(packer));
    xpm_plan::Series per_record_line = xpm_plan::make_series("", xpm_plan::SeriesKind::kLine, kColors.at(packer));
    std::vector<const PackerRow*> mine;
    for (const PackerRow& r : rows) {
      if (r.packer == packer && r.distribution == "brown" && r.formula == "quadratic") mine.push_back(&r);
    }
    std::sort(mine.begin(), mine.end(), [](const PackerRow* a, const PackerRow* b) { return a->records < b->records; });
    for (const PackerRow* r : mine) {
      line.x.push_back(std::log10(r->records));
      line.y.push_back(std::log10(r->row->cpu_s));
      points.tooltips.push_back(kPackerNames.at(packer) + ", " + thousands(r->records) + " records: " +
                                duration(r->row->cpu_s));
      per_record_line.x.push_back(std::log10(r->records));
      per_record_line.y.push_back(std::log10(1e9 * r->row->cpu_s / r->records));
    }
    points.x = line.x;
    points.y = line.y;
    xpm_plan::Series per_record_points = per_record_line;
    per_record_points.kind = xpm_plan::SeriesKind::kPoints;
    top.series.push_back(line);
    top.series.push_back(points);
    bottom.series.push_back(per_record_line);
    bottom.series.push_back(per_record_points);
  }
  top.hlines.push_back({std::log10(0.2), "0.2 s (goal at 1M records)", "#d62728", true});
  return fig.render();
}

}  // namespace

Section packers_section(const std::vector<BenchmarkRow>& benchmark_rows) {
  const std::vector<PackerRow> rows = packer_rows(benchmark_rows);
  Section section;
  std::string& md = section.markdown;
  if (rows.empty()) {
    md = "_No packer results (packer_bench did not run)._\n";
    return section;
  }
  md += "| goal | measured (CPU time per plan) | verdict |\n|---|---|---|\n";
  md += adaptive_time_goal(rows);
  md += reference_speed_goal(rows, "AdaptiveSorted", "ReferenceSorted");
  md += reference_speed_goal(rows, "Adaptive", "Reference");
  md += ffd_count_goal(rows);
  md += brown_quadratic_table(rows);
  for (const double n : {65536.0, 1048576.0}) md += distributions_table(rows, n);
  md += utilization_table(rows);
  md += cpu_budget_table(rows);
  section.figures["bench-plan-time.svg"] = plan_time_figure(rows);
  return section;
}

}  // namespace xpm_bench
