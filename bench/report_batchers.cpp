// report_batchers.cpp — the end-to-end batcher section of docs/benchmarks.md (see
// report_sections.hpp).
#include <algorithm>
#include <cmath>
#include <utility>
#include <functional>
#include <map>
#include <set>

#include "report_sections.hpp"
#include "xpm_plan/svg_plot.hpp"

namespace xpm_bench {
namespace {

// A series with its label, kind and colour; data filled in afterwards.
constexpr double kMiB = 1024.0 * 1024.0;
const std::map<std::string, std::string> kColors = {
    {"fixed", "#7f7f7f"}, {"power", "#ff7f0e"}, {"uniform", "#1f77b4"}, {"adaptive", "#2ca02c"}, {"ffd", "#9467bd"}};

bool succeeded(const nlohmann::json& run) { return run.value("status", 1) == 0 && run.contains("tokens_per_s"); }

// "98 x 20, 30 x 20": distinct values with counts, largest first.
std::string value_counts(const std::vector<std::int64_t>& values) {
  std::map<std::int64_t, int, std::greater<>> counts;
  for (std::int64_t v : values) ++counts[v];
  std::string out;
  for (const auto& [value, count] : counts) {
    out += (out.empty() ? "" : ", ") + std::to_string(value) + " x " + std::to_string(count);
  }
  return out;
}

std::string microbatch_size_text(const nlohmann::json& run) {
  if (run.contains("power_steps")) {
    std::vector<std::int64_t> sizes;
    for (const auto& step : run.at("power_steps")) sizes.push_back(step.at("microbatch_size"));
    return "per step: " + value_counts(sizes);
  }
  if (run.contains("plans")) {
    std::vector<std::int64_t> sizes;
    for (const auto& s : run.at("plans").at("records_per_microbatch")) sizes.push_back(s);
    if (run.value("key", "") == "fixed") return std::to_string(run.value("microbatch_size", 0));
    const auto [lo, hi] = std::minmax_element(sizes.begin(), sizes.end());
    double mean = 0;
    for (std::int64_t s : sizes) mean += static_cast<double>(s);
    return sizes.empty() ? "-" : format("%lld..%lld (mean %.1f)", static_cast<long long>(*lo),
                                        static_cast<long long>(*hi), mean / static_cast<double>(sizes.size()));
  }
  return "-";
}

// The setting of every run and the search for the fixed microbatch.
std::string settings_text(const nlohmann::json& b, const nlohmann::json& settings,
                          const nlohmann::json& fixed_search) {
  std::string md;
  md += format("Measured %s on %u cores; load average %s at the start, %s at the end (other engineers' "
               "builds shared the machine). Every run: %lld steps of %lld sentences (same seed, so the same "
               "outer batches and real tokens), %d intra-op threads, CPU cap %.1f x static memory, "
               "memory_fraction 0.9, no memory-model cache (probing is timed in every predictive run).\n\n",
               b.at("date").get<std::string>().c_str(), b.at("cores").get<unsigned>(),
               b.at("load_average_start").get<std::string>().c_str(),
               b.value("load_average_end", std::string("?")).c_str(),
               static_cast<long long>(settings.at("steps").get<std::int64_t>()),
               static_cast<long long>(settings.at("outer_batch_size").get<std::int64_t>()),
               settings.at("threads").get<int>(), settings.at("memory_cap_factor").get<double>());
  md += format("The fixed microbatch, measured: full training steps (zero_grad, forward, backward, AdamW) at "
               "the longest sentence (%.0f tokens) under the cap of %s bytes, doubling the microbatch from 1 "
               "until a step ran out of memory, then bisecting (%zu steps measured): **%lld sentences** fit, "
               "one more does not.\n\n",
               fixed_search.at("length").get<double>(), thousands(fixed_search.at("capacity_bytes").get<double>()).c_str(),
               fixed_search.at("probes").size(),
               static_cast<long long>(fixed_search.at("largest_microbatch").get<std::int64_t>()));
  return md;
}

// A run that did not finish, skipped or failed (with FFD's plans compared to run (4)'s).
std::string failed_run_row(const nlohmann::json& r) {
  std::string why = r.contains("skipped") ? "skipped: " + r.at("skipped").get<std::string>()
                                          : format("failed (exit %d)", r.value("status", -1));
  if (r.contains("ffd_plans_of_adaptive_run_identical")) {
    why += format("; FFD's plans of (4)'s %lld outer batches are %s (4)'s",
                  static_cast<long long>(r.value("ffd_plans_steps", 0)),
                  r.at("ffd_plans_of_adaptive_run_identical").get<bool>() ? "identical to" : "NOT identical to");
  }
  return "| " + r.at("label").get<std::string>() + " | " + why + " | | | | | | | | |\n";
}

// A finished run's row; `fixed_tps` is run (1)'s tokens/s (0 before it).
std::string run_row(const nlohmann::json& r, double fixed_tps) {
  const double tps = r.at("tokens_per_s");
  return format("| %s | %s | %s | %s | %lld | %lld | %s | %.1f / %.1f | %s | %.4f |\n",
                r.at("label").get<std::string>().c_str(), microbatch_size_text(r).c_str(), thousands(tps).c_str(),
                fixed_tps > 0 ? format("%.2fx", tps / fixed_tps).c_str() : "-",
                static_cast<long long>(r.at("ooms").get<std::int64_t>()),
                static_cast<long long>(r.value("retried_steps", 0)),
                thousands(r.at("microbatches").get<double>()).c_str(),
                r.at("peak_allocated_bytes").get<double>() / kMiB, r.at("capacity_bytes").get<double>() / kMiB,
                r.at("probes").get<int>() > 0 ? format("%d probes, %.1f s", r.at("probes").get<int>(),
                                                        r.at("probe_s").get<double>()).c_str() : "-",
                r.at("val_token_accuracy").get<double>());
}

// The table of runs (1)..(5), whether they saw the same tokens, and the goal of (4) against (1).
std::string runs_table(const nlohmann::json& runs) {
  std::string md = "| batcher | microbatch size (records) | real tokens/s | vs (1) | OOMs | steps redone | microbatches | "
        "peak / cap (MiB) | probing | validation accuracy |\n|---|---|---:|---:|---:|---:|---:|---|---:|---:|\n";
  double fixed_tps = 0, adaptive_tps = 0;
  std::int64_t adaptive_ooms = -1;
  std::set<double> token_counts;
  for (const nlohmann::json& r : runs) {
    const std::string key = r.at("key");
    if (!succeeded(r)) {
      md += failed_run_row(r);
      continue;
    }
    const double tps = r.at("tokens_per_s");
    if (key == "fixed") fixed_tps = tps;
    if (key == "adaptive") {
      adaptive_tps = tps;
      adaptive_ooms = r.at("ooms");
    }
    token_counts.insert(r.at("real_tokens").get<double>());
    md += run_row(r, fixed_tps);
  }
  if (token_counts.size() == 1) {
    md += format("\nEvery run trained on the same %s real tokens.", thousands(*token_counts.begin()).c_str());
  } else if (!token_counts.empty()) {
    md += "\n**The runs did not see the same number of real tokens** (a step was skipped).";
  }
  if (fixed_tps > 0 && adaptive_tps > 0) {
    const double ratio = adaptive_tps / fixed_tps;
    md += format(" Goal (4) >= 2x (1) in real tokens/s with 0 OOM: %.2fx with %lld OOM, %s.\n", ratio,
                 static_cast<long long>(adaptive_ooms),
                 ratio >= 2 && adaptive_ooms == 0 ? "**met**" : "**missed**");
  }
  return md;
}

// The microbatch sizes a limit-case run picked: "size x count", per step for the power batcher.
std::string limit_sizes_text(const nlohmann::json& r) {
  std::string sizes;
  if (r.contains("power_steps")) {
    std::vector<std::int64_t> per_step;
    for (const auto& step : r.at("power_steps")) per_step.push_back(step.at("microbatch_size"));
    sizes = "steps at size: " + value_counts(per_step) + " (first try 128)";
  } else if (r.contains("plans") && r.at("plans").contains("records_per_microbatch")) {
    std::vector<std::int64_t> all;
    for (const auto& s : r.at("plans").at("records_per_microbatch")) all.push_back(s);
    sizes = value_counts(all);
  }
  return sizes;
}

// The limit case: a true limit of 100 sentences, every batcher starting at 128.
std::string limit_case_text(const nlohmann::json& b) {
  std::string md;
  const nlohmann::json& settings = b.at("settings");
  const nlohmann::json& limit = b.at("limit_case");
  const nlohmann::json& peaks = limit.at("peaks").at("peaks");
  md += format("\n#### True limit 100, start 128\n\n%s (every outer batch of 128 pads to 32 tokens); cap "
               "%s bytes, halfway between the measured step peaks at 100 x 32 (%s bytes) and 101 x 32 "
               "(%s bytes): 100 sentences fit, 101 do not. %lld steps of 128 sentences; the predictive "
               "batcher with memory_fraction 0.99.\n\n",
               limit.at("corpus").get<std::string>().c_str(), thousands(limit.at("capacity_bytes").get<double>()).c_str(),
               thousands(peaks[0].at("step_peak_bytes").get<double>()).c_str(),
               thousands(peaks[1].at("step_peak_bytes").get<double>()).c_str(),
               static_cast<long long>(settings.at("limit_steps").get<std::int64_t>()));
  md += "| batcher | microbatch sizes picked (size x count) | OOMs | steps redone | real tokens/s | peak / cap (MiB) |\n"
        "|---|---|---:|---:|---:|---|\n";
  for (const nlohmann::json& r : limit.at("runs")) {
    if (!succeeded(r)) {
      md += "| " + r.at("label").get<std::string>() + format(" | failed (exit %d) | | | | |\n", r.value("status", -1));
      continue;
    }
    const std::string sizes = limit_sizes_text(r);
    md += format("| %s | %s | %lld | %lld | %s | %.1f / %.1f |\n", r.at("label").get<std::string>().c_str(),
                 sizes.c_str(), static_cast<long long>(r.at("ooms").get<std::int64_t>()),
                 static_cast<long long>(r.value("retried_steps", 0)),
                 thousands(r.at("tokens_per_s").get<double>()).c_str(),
                 r.at("peak_allocated_bytes").get<double>() / kMiB, r.at("capacity_bytes").get<double>() / kMiB);
  }
  return md;
}

// xpm-train's step time against a raw LibTorch loop replaying the same plans.
std::string overhead_text(const nlohmann::json& o) {
  std::string md;
  double xpm_s = 0, raw_s = 0, tokens = 0;
  for (const auto& r : o.at("xpm_train")) {
    xpm_s += r.at("train_s").get<double>();
    tokens += r.at("real_tokens").get<double>();
  }
  for (const auto& r : o.at("raw")) raw_s += r.value("train_s", 0.0);
  md += "\n#### xpm-train's overhead over a raw LibTorch loop\n\nThe run (4) configuration twice, each "
        "replayed by `raw-training-loop --replay --with-meter` right after it (same model code through "
        "TaggingModelSetup, same outer batches, same plans, checked step by step against "
        "metrics.jsonl; only collate, forward, loss, backward and AdamW, with xpm's CPU memory meter "
        "installed as in xpm-train, since it is the allocator that enforces the cap). Step time in "
        "both: planning, every microbatch's forward/backward, the optimizer step.\n\n"
        "| loop | step time, sum (s) | real tokens/s |\n|---|---:|---:|\n";
  md += format("| xpm-train (%zu runs) | %.2f | %s |\n", o.at("xpm_train").size(), xpm_s,
               thousands(tokens / std::max(1e-9, xpm_s)).c_str());
  md += format("| raw loop, same allocator (%zu replays) | %.2f | %s |\n", o.at("raw").size(), raw_s,
               thousands(tokens / std::max(1e-9, raw_s)).c_str());
  if (o.contains("raw_without_meter") && o.at("raw_without_meter").contains("train_s")) {
    const nlohmann::json& m = o.at("raw_without_meter");
    md += format("| raw loop without the meter, LibTorch's own CPU allocator (1 replay of the first run) "
                 "| %.2f | %s |\n", m.at("train_s").get<double>(), thousands(m.at("tokens_per_s").get<double>()).c_str());
  }
  if (o.contains("overhead")) {
    const double overhead = o.at("overhead");
    md += format("\nOverhead of xpm-train: %+.1f %% (goal <= 2 %%): %s.\n", 100 * overhead,
                 overhead <= 0.02 ? "**met**" : "**missed**");
  }
  return md;
}

// Real tokens/s per run, one bar each.
std::string throughput_figure(const nlohmann::json& b) {
  const nlohmann::json& runs = b.at("runs");
  xpm_plan::Figure fig;
  fig.title = "Real tokens/s per batcher (Brown, Transformer tagger, same CPU cap)";
  fig.notes = {b.at("date").get<std::string>() + ", load average " + b.at("load_average_start").get<std::string>()};
  xpm_plan::Panel& p = fig.add_panel("configuration (1)..(5)", "real tokens/s");
  double x = 1;
  for (const nlohmann::json& r : runs) {
    const std::string key = r.at("key");
    if (succeeded(r)) {
      xpm_plan::Series bar = xpm_plan::make_series(r.at("label"), xpm_plan::SeriesKind::kBars, kColors.at(key));
      bar.x = {x};
      bar.y = {r.at("tokens_per_s").get<double>()};
      bar.labels = {thousands(r.at("tokens_per_s").get<double>()) +
                    format(r.at("ooms").get<std::int64_t>() > 0 ? " (%lld OOM)" : "",
                           static_cast<long long>(r.at("ooms").get<std::int64_t>()))};
      p.series.push_back(bar);
    }
    x += 1;
  }
  p.x_min = 0.5;
  p.x_max = x - 0.5;
  return fig.render();
}

// Predicted step peak of every microbatch as a share of the cap, one panel per planned run.
std::string fill_figure(const nlohmann::json& runs) {
  xpm_plan::Figure fig;
  fig.title = "Microbatch fill: predicted step peak / CPU cap, every microbatch of every step";
  fig.notes = {"predictions of run (4)'s fitted memory model (held-out error below 0.001 %); bins of 2 % of the cap"};
  for (const nlohmann::json& r : runs) {
    if (!succeeded(r) || !r.contains("plans")) continue;
    const double cap = r.at("capacity_bytes");
    std::map<int, double> bins;
    for (const auto& bytes : r.at("plans").at("predicted_bytes")) {
      bins[static_cast<int>(std::floor(50.0 * bytes.get<double>() / cap))] += 1;
    }
    xpm_plan::Panel& p = fig.add_panel("predicted step peak, % of the cap", "microbatches");
    xpm_plan::Series bars = xpm_plan::make_series(r.at("label"), xpm_plan::SeriesKind::kBars, kColors.at(r.at("key")));
    for (const auto& [bin, count] : bins) {
      bars.x.push_back(2.0 * bin + 1.0);
      bars.y.push_back(count);
    }
    p.series.push_back(bars);
    p.x_min = 50;
    p.x_max = 100;
    p.height = 130;
  }
  return fig.render();
}

// Measured against predicted step peaks of the predictive runs, with the cap and the budget.
std::string peaks_figure(const nlohmann::json& runs) {
  xpm_plan::Figure fig;
  fig.title = "Measured vs predicted step peak (every step of the predictive runs)";
  xpm_plan::Panel& p = fig.add_panel("predicted step peak (MiB)", "measured step peak (MiB)");
  p.diagonal = true;
  double cap = 0, usable = 0;
  for (const nlohmann::json& r : runs) {
    if (!succeeded(r) || !r.contains("step_peaks")) continue;
    xpm_plan::Series points = xpm_plan::make_series(r.at("label"), xpm_plan::SeriesKind::kPoints, kColors.at(r.at("key")));
    for (const auto& pair : r.at("step_peaks")) {
      points.x.push_back(pair[0].get<double>() / kMiB);
      points.y.push_back(pair[1].get<double>() / kMiB);
    }
    p.series.push_back(points);
    cap = r.at("capacity_bytes").get<double>() / kMiB;
    usable = r.value("usable_bytes", 0.0) / kMiB;
  }
  if (cap > 0) p.hlines.push_back({cap, "CPU cap", "#d62728", true});
  if (usable > 0) p.hlines.push_back({usable, "usable budget (0.9 x cap)", "#ff7f0e", true});
  return fig.render();
}

}  // namespace

Section batchers_section(const nlohmann::json& b) {
  Section section;
  std::string& md = section.markdown;
  const nlohmann::json& settings = b.at("settings");
  const nlohmann::json& runs = b.at("runs");
  const nlohmann::json& fixed_search = b.at("fixed_search");
  md += settings_text(b, settings, fixed_search);
  md += runs_table(runs);
  md += "\n![Real tokens/s per batcher](figures/bench-throughput.svg)\n\n"
        "![Microbatch fill](figures/bench-fill.svg)\n\n"
        "![Measured vs predicted step peaks](figures/bench-peaks.svg)\n";
  if (b.contains("limit_case") && b.at("limit_case").contains("runs")) md += limit_case_text(b);
  if (b.contains("overhead")) md += overhead_text(b.at("overhead"));
  section.figures["bench-throughput.svg"] = throughput_figure(b);
  section.figures["bench-fill.svg"] = fill_figure(runs);
  section.figures["bench-peaks.svg"] = peaks_figure(runs);
  return section;
}

}  // namespace xpm_bench
