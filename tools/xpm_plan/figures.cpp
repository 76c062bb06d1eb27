// xpm-plan figures (see figures.hpp).
#include "figures.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common.hpp"
#include "svg_plot.hpp"

namespace xpm_plan {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string significant(double v) {  // 3 significant digits, no exponent for |v| >= 1e-4
  char buf[64];
  std::snprintf(buf, sizeof buf, std::fabs(v) >= 1e-4 || v == 0 ? "%.3g" : "%.2e", v);
  return buf;
}

std::string fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace

std::string fit_figure_svg(const xpm::MemoryModel& model, const MeasurementSet& set,
                           const xpm::FitSummary& summary, const std::string& bytes_column) {
  const xpm::CostFormula& formula = model.formula();
  Figure fig;
  fig.title = "Fit of " + formula.canonical();
  fig.notes.push_back(std::to_string(set.measurements.size()) + " measurements of " +
                      bytes_column + " from " + set.path);
  std::string errors = "fitted: max |relative error| " + significant(summary.max_rel_error * 100) +
                       " %, mean " + significant(summary.mean_rel_error * 100) + " %";
  if (std::isfinite(summary.leave_one_out_max_rel_error)) {
    errors += "; leave-one-out max " + significant(summary.leave_one_out_max_rel_error * 100) + " %";
  }
  fig.notes.push_back(errors + (summary.usable ? "" : "; NOT USABLE"));
  if (!set.infeasible.empty()) {
    fig.notes.push_back(std::to_string(set.infeasible.size()) +
                        " probes ran out of memory (not fitted, not shown)");
  }
  Series measured_vs_predicted = make_series("probe: (measured, predicted)", SeriesKind::kPoints, "#1f77b4");
  Series residuals = make_series("fit on every point", SeriesKind::kPoints, "#ff7f0e");
  Series left_out = make_series("fit without that point (leave-one-out)", SeriesKind::kCrosses, "#7f7f7f");
  const bool label_points = set.measurements.size() <= 30;
  for (std::size_t i = 0; i < set.measurements.size(); ++i) {
    const auto& m = set.measurements[i];
    const double predicted = formula.predict(model.coefficients(), m.dims);
    const double rel = (predicted - m.bytes) / m.bytes;
    const std::string tip = dims_text(model, m.dims) + ": measured " + bytes_text(m.bytes) +
                            ", predicted " + bytes_text(predicted) + " (" +
                            fixed(rel * 100, 3) + " %)";
    measured_vs_predicted.x.push_back(m.bytes / kMiB);
    measured_vs_predicted.y.push_back(predicted / kMiB);
    measured_vs_predicted.tooltips.push_back(tip);
    residuals.x.push_back(m.bytes / kMiB);
    residuals.y.push_back(rel * 100);
    residuals.tooltips.push_back(tip);
    if (label_points) measured_vs_predicted.labels.push_back(dims_text(model, m.dims));
    if (i < summary.leave_one_out_rel_errors.size() &&
        std::isfinite(summary.leave_one_out_rel_errors[i])) {
      left_out.x.push_back(m.bytes / kMiB);
      left_out.y.push_back(summary.leave_one_out_rel_errors[i] * 100);
      left_out.tooltips.push_back(dims_text(model, m.dims) + ": left out " +
                                  fixed(summary.leave_one_out_rel_errors[i] * 100, 3) + " %");
    }
  }
  Series below = make_series("at or below the floor: not fitted", SeriesKind::kPoints, "#b0b0b0");
  for (const auto& m : set.below_floor) {
    const double predicted = formula.predict(model.coefficients(), m.dims);
    below.x.push_back(m.bytes / kMiB);
    below.y.push_back(predicted / kMiB);
    below.tooltips.push_back(dims_text(model, m.dims) + ": measured " + bytes_text(m.bytes) +
                             ", formula " + bytes_text(predicted) + " (not fitted)");
  }
  if (!set.below_floor.empty()) {
    fig.notes.push_back(std::to_string(set.below_floor.size()) +
                        " measurements at or below the floor not fitted (grey)");
  }
  Panel& top = fig.add_panel("measured " + bytes_column + " (MiB)", "predicted by the formula (MiB)");
  top.series.push_back(std::move(measured_vs_predicted));
  if (!below.x.empty()) top.series.push_back(std::move(below));
  top.diagonal = true;
  if (model.floor_bytes() > 0) {
    top.hlines.push_back({model.floor_bytes() / kMiB,
                          "floor " + mib_text(model.floor_bytes()) + " (prediction = max(floor, formula))",
                          "#2ca02c", true});
  }
  top.height = 340;
  Panel& bottom = fig.add_panel("measured " + bytes_column + " (MiB)",
                                "(predicted - measured) / measured (%)");
  bottom.series.push_back(std::move(residuals));
  if (!left_out.x.empty()) bottom.series.push_back(std::move(left_out));
  bottom.hlines.push_back({0.0, "", "#888", true});
  bottom.height = 200;
  // Symmetric residual axis, at least +-0.001 % so round-off noise is not blown up.
  double extent = 0.001;
  for (double r : summary.rel_errors) extent = std::max(extent, std::fabs(r) * 100 * 1.1);
  for (double r : summary.leave_one_out_rel_errors) {
    if (std::isfinite(r)) extent = std::max(extent, std::fabs(r) * 100 * 1.1);
  }
  bottom.y_min = -extent;
  bottom.y_max = extent;
  // Same x range in both panels: measured and predicted, snapped to tick values.
  if (!set.measurements.empty()) {
    double lo = 1e300, hi = -1e300;
    for (const Series& series : fig.panels[0].series) {
      for (const std::vector<double>* values : {&series.x, &series.y}) {
        for (double v : *values) {
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
      }
    }
    for (const ReferenceLine& floor : fig.panels[0].hlines) {
      lo = std::min(lo, floor.y);
      hi = std::max(hi, floor.y);
    }
    const double pad = std::max((hi - lo) * 0.04, std::fabs(hi) * 0.01);
    const std::vector<double> ticks = nice_ticks(lo - pad, hi + pad, 8);
    for (Panel* panel : {&fig.panels[0], &fig.panels[1]}) {
      panel->x_min = ticks.front();
      panel->x_max = ticks.back();
    }
  }
  return fig.render();
}

std::string plan_figure_svg(const xpm::MemoryModel& model, const xpm::MicrobatchPlan& plan,
                            std::int64_t usable_bytes, const std::string& packer,
                            const std::string& source) {
  Figure fig;
  std::size_t records = 0;
  double sum = 0, min = 1e300;
  for (const auto& mb : plan.microbatches) {
    records += mb.record_indices.size();
    const double u = mb.predicted_bytes / static_cast<double>(usable_bytes);
    sum += u;
    min = std::min(min, u);
  }
  const double mean = plan.microbatches.empty() ? 0 : sum / static_cast<double>(plan.microbatches.size());
  fig.title = "Microbatch fill: " + std::to_string(records) + " records in " +
              std::to_string(plan.microbatches.size()) + " microbatches (" + packer + " packer)";
  fig.notes.push_back("records from " + source + "; model " + model.formula().canonical() +
                      ", floor " + mib_text(model.floor_bytes()));
  fig.notes.push_back("usable budget " + mib_text(static_cast<double>(usable_bytes)) +
                      "; utilization mean " + fixed(mean * 100, 1) + " %, min " +
                      fixed((plan.microbatches.empty() ? 0 : min) * 100, 1) + " %" +
                      (plan.over_budget_records.empty()
                           ? std::string()
                           : "; " + std::to_string(plan.over_budget_records.size()) +
                                 " records over budget alone (red)"));
  Series fill = make_series("predicted / usable bytes", SeriesKind::kBars, "#4c78a8");
  Series sizes = make_series("records in the microbatch (@ its padded dims)", SeriesKind::kBars, "#72b7b2");
  for (std::size_t i = 0; i < plan.microbatches.size(); ++i) {
    const auto& mb = plan.microbatches[i];
    const double u = mb.predicted_bytes / static_cast<double>(usable_bytes);
    const std::string tip = "#" + std::to_string(i) + ": " +
                            std::to_string(mb.record_indices.size()) + " records, " +
                            dims_text(model, mb.dims) + ", predicted " +
                            bytes_text(mb.predicted_bytes) + " bytes (" + fixed(u * 100, 1) + " %)";
    fill.x.push_back(static_cast<double>(i));
    fill.y.push_back(u * 100);
    fill.tooltips.push_back(tip);
    fill.colors.push_back(mb.over_budget ? "#d62728" : "#4c78a8");
    sizes.x.push_back(static_cast<double>(i));
    sizes.y.push_back(static_cast<double>(mb.record_indices.size()));
    sizes.tooltips.push_back(tip);
    if (plan.microbatches.size() <= 24) {
      fill.labels.push_back(fixed(u * 100, 1) + " %");
      std::string dims;
      for (std::size_t v = 0; v < mb.dims.size(); ++v) {
        if (v == model.batch_size_index()) continue;
        dims += (dims.empty() ? "" : " ") + model.formula().variable_names()[v] + "=" + number_text(mb.dims[v]);
      }
      sizes.labels.push_back(std::to_string(mb.record_indices.size()) + (dims.empty() ? "" : " @ " + dims));
    }
  }
  Panel& top = fig.add_panel("microbatch (in plan order)", "utilization (% of usable bytes)");
  top.series.push_back(std::move(fill));
  top.hlines.push_back({100.0, "usable budget (100 %)", "#d62728", true});
  top.hlines.push_back({mean * 100, "mean " + fixed(mean * 100, 1) + " %", "#555", true});
  if (model.floor_bytes() > 0) {
    top.hlines.push_back({model.floor_bytes() / static_cast<double>(usable_bytes) * 100,
                          "floor (static memory)", "#2ca02c", true});
  }
  top.include_zero_y = true;
  top.height = 300;
  Panel& bottom = fig.add_panel("microbatch (in plan order)", "records");
  bottom.series.push_back(std::move(sizes));
  bottom.include_zero_y = true;
  bottom.height = 160;
  return fig.render();
}

}  // namespace xpm_plan
