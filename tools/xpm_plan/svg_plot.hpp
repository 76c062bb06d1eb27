// xpm-plan figures: a small SVG writer for stacked x-y panels (points, lines, bars, reference
// lines, legend). Self-contained on purpose: no plotting program needs to be installed where
// xpm-plan runs, output is deterministic (same input, same bytes) and tests can check it.
//
//   Figure fig{"Fit of a*bs*l^2 + b*bs*l + c", 760};
//   Panel& top = fig.add_panel("measured (MiB)", "predicted (MiB)");
//   top.series.push_back({"probes", SeriesKind::kPoints, "#1f77b4", xs, ys});
//   top.diagonal = true;   // y = x
//   write_file_atomically("fit.svg", fig.render());
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace xpm_plan {

enum class SeriesKind { kPoints, kCrosses, kLine, kBars };

struct Series {
  std::string label;                 // legend text ("" = not in the legend)
  SeriesKind kind = SeriesKind::kPoints;
  std::string color = "#1f77b4";     // any SVG colour
  std::vector<double> x, y;          // same length; bars: x is the bar's centre
  std::vector<std::string> tooltips; // optional, one per point: SVG <title>
  std::vector<std::string> colors;   // optional, one per point/bar: overrides `color`
  std::vector<std::string> labels;   // optional, one per point/bar: small text beside it
};

/// A series with its legend label, kind and colour, no points yet.
Series make_series(std::string label, SeriesKind kind, std::string color);

struct ReferenceLine {
  double y = 0;                 // horizontal line at this y
  std::string label;            // printed at the right end
  std::string color = "#d62728";
  bool dashed = true;
};

struct Panel {
  std::string x_label, y_label;
  std::vector<Series> series;
  std::vector<ReferenceLine> hlines;
  bool diagonal = false;              // draw y = x
  bool include_zero_y = false;        // y range includes 0
  std::optional<double> y_min, y_max; // fixed y range ends
  std::optional<double> x_min, x_max; // fixed x range ends
  double height = 300;                // plot area height, px
};

struct Figure {
  std::string title;
  double width = 760;  // px
  std::vector<Panel> panels;
  std::vector<std::string> notes;  // small text lines under the title

  Panel& add_panel(std::string x_label, std::string y_label);
  /// The whole SVG document (starts with <?xml ...?>).
  std::string render() const;
};

/// "Nice" tick values (1, 2, 2.5, 5 x 10^k steps) covering [lo, hi], about `count` of them.
std::vector<double> nice_ticks(double lo, double hi, int count);

/// Escapes &, <, >, " and ' for SVG text and attributes.
std::string xml_escape(const std::string& text);

}  // namespace xpm_plan
