// xpm-plan figures: SVG writer (see svg_plot.hpp).
#include "svg_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>

namespace xpm_plan {
namespace {

constexpr double kLeft = 86;     // room for y tick labels and the y label
constexpr double kRight = 24;
constexpr double kTitle = 34;    // title baseline area
constexpr double kNote = 16;     // per note line
constexpr double kLegendRow = 18;  // one legend row above a plot
constexpr double kCharWidth = 7;   // approximate width of a 12 px character
constexpr double kAxisBelow = 46;// x tick labels + x label under each plot
constexpr double kGap = 18;      // between panels

std::string num(double v) {  // coordinates: 2 decimals, no trailing zeros
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  std::string s = buf;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

std::string tick_text(double v, double step) {
  if (std::fabs(v) < step * 1e-9) v = 0;
  int decimals = 0;
  if (step < 1) {
    decimals = static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
    // 0.25-style steps need one more digit than their magnitude.
    const double scaled = step * std::pow(10.0, decimals);
    if (std::fabs(scaled - std::round(scaled)) > 1e-6) ++decimals;
  }
  char buf[64];
  if (std::fabs(v) >= 1e9) {
    std::snprintf(buf, sizeof buf, "%.3g", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  }
  return buf;
}

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    if (!std::isfinite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return !(lo <= hi); }
};

double tick_step(double lo, double hi, int count) {
  const double span = hi - lo;
  const double raw = span / std::max(count, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    if (m * mag >= raw) return m * mag;
  }
  return 10 * mag;
}

// Final axis range: padded data range snapped outward to the tick step.
struct Axis {
  double lo = 0, hi = 1, step = 0.25;
  std::vector<double> ticks;
};

Axis make_axis(Range r, bool pad, std::optional<double> fixed_lo, std::optional<double> fixed_hi,
               int count, bool integer_ticks) {
  if (r.empty()) r = {0, 1};
  if (fixed_lo) r.lo = *fixed_lo;
  if (fixed_hi) r.hi = *fixed_hi;
  if (r.hi - r.lo <= std::fabs(r.hi) * 1e-12) {  // one value: widen around it
    const double w = r.hi == 0 ? 1 : std::fabs(r.hi) * 0.05;
    if (!fixed_lo) r.lo -= w;
    if (!fixed_hi) r.hi += w;
  }
  if (pad) {
    const double p = (r.hi - r.lo) * 0.04;
    if (!fixed_lo) r.lo -= p;
    if (!fixed_hi) r.hi += p;
  }
  Axis a;
  a.step = tick_step(r.lo, r.hi, count);
  if (integer_ticks) a.step = std::max(1.0, std::round(a.step));
  a.lo = fixed_lo ? *fixed_lo : std::floor(r.lo / a.step + 1e-9) * a.step;
  a.hi = fixed_hi ? *fixed_hi : std::ceil(r.hi / a.step - 1e-9) * a.step;
  if (a.hi <= a.lo) a.hi = a.lo + a.step;
  for (double t = std::ceil(a.lo / a.step - 1e-9) * a.step; t <= a.hi + a.step * 1e-9;
       t += a.step) {
    a.ticks.push_back(std::fabs(t) < a.step * 1e-9 ? 0.0 : t);
    if (a.ticks.size() > 200) break;
  }
  return a;
}

// Height of a panel's legend: rows of entries wrapped to the plot width (as drawn in render()).
double legend_height(const Panel& p, double plot_w) {
  std::vector<std::string> labels;
  for (const Series& s : p.series) {
    if (!s.label.empty()) labels.push_back(s.label);
  }
  for (const ReferenceLine& r : p.hlines) {
    if (!r.label.empty()) labels.push_back(r.label);
  }
  if (labels.empty()) return 8;
  int rows = 1;
  double x = 0;
  for (const std::string& label : labels) {
    const double w = 28 + kCharWidth * static_cast<double>(label.size());
    if (x > 0 && x + w > plot_w) {
      ++rows;
      x = 0;
    }
    x += w;
  }
  return 4 + kLegendRow * rows;
}

// A panel's plot area on the page and its axes: data coordinates to page coordinates.
struct PlotArea {
  Axis ax, ay;
  double top = 0, left = kLeft, h = 0, plot_w = 0;
  double sx(double x) const { return left + (x - ax.lo) / (ax.hi - ax.lo) * plot_w; }
  double sy(double y) const { return top + h - (y - ay.lo) / (ay.hi - ay.lo) * h; }
};

// The axes of a panel from its data ranges (bars: integer x ticks and y from 0; diagonal: the
// same range on both axes), its plot area starting at `top`.
PlotArea plot_area(const Panel& p, double top, double plot_w) {
  bool bars = false;
  Range xr, yr;
  for (const Series& s : p.series) {
    if (s.kind == SeriesKind::kBars) bars = true;
    for (std::size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      xr.add(s.x[i]);
      yr.add(s.y[i]);
    }
  }
  for (const ReferenceLine& h : p.hlines) yr.add(h.y);
  if (p.include_zero_y || bars) yr.add(0);
  if (p.diagonal && !xr.empty()) {  // same range on both axes: y = x is the diagonal
    xr.add(yr.lo);
    xr.add(yr.hi);
    yr = xr;
  }
  if (bars && !xr.empty()) {
    xr.lo -= 0.5;
    xr.hi += 0.5;
  }
  PlotArea area;
  area.ax = make_axis(xr, !bars, p.x_min ? p.x_min : (bars ? std::optional<double>(xr.lo) : std::nullopt),
                      p.x_max ? p.x_max : (bars ? std::optional<double>(xr.hi) : std::nullopt),
                      8, bars);
  const bool y_from_zero = (p.include_zero_y || bars) && !yr.empty() && yr.lo >= 0;
  area.ay = make_axis(yr, true, p.y_min ? p.y_min : (y_from_zero ? std::optional<double>(0.0) : std::nullopt),
                      p.y_max, 6, false);
  if (p.diagonal) area.ay = area.ax;
  area.top = top;
  area.h = p.height;
  area.plot_w = plot_w;
  return area;
}

// The legend's mark for a series of kind `s.kind` at (lx, cy).
void write_legend_mark(std::ostream& svg, const Series& s, double lx, double cy) {
  switch (s.kind) {
    case SeriesKind::kPoints:
      svg << "<circle cx=\"" << num(lx + 6) << "\" cy=\"" << num(cy) << "\" r=\"4\" fill=\""
          << s.color << "\"/>";
      break;
    case SeriesKind::kCrosses:
      svg << "<path d=\"M" << num(lx + 2) << " " << num(cy - 4) << "l8 8M" << num(lx + 2)
          << " " << num(cy + 4) << "l8 -8\" stroke=\"" << s.color
          << "\" stroke-width=\"1.8\"/>";
      break;
    case SeriesKind::kLine:
      svg << "<line x1=\"" << num(lx) << "\" y1=\"" << num(cy) << "\" x2=\"" << num(lx + 14)
          << "\" y2=\"" << num(cy) << "\" stroke=\"" << s.color << "\" stroke-width=\"2\"/>";
      break;
    case SeriesKind::kBars:
      svg << "<rect x=\"" << num(lx) << "\" y=\"" << num(cy - 5) << "\" width=\"12\""
          << " height=\"10\" fill=\"" << s.color << "\"/>";
      break;
  }
}

// Legend: one entry per labelled series and reference line, wrapped to the plot width, in the
// rows that legend_height() counts from `y0`.
void write_legend(std::ostream& svg, const Panel& p, double y0, double plot_w) {
  const double left = kLeft;
  double lx = left;
  double cy = y0 + 11;
  auto next_entry = [&](const std::string& label) {
    const double w = 28 + kCharWidth * static_cast<double>(label.size());
    if (lx > left && lx + w > left + plot_w) {
      lx = left;
      cy += kLegendRow;
    }
    return w;
  };
  for (const Series& s : p.series) {
    if (s.label.empty()) continue;
    const double w = next_entry(s.label);
    write_legend_mark(svg, s, lx, cy);
    svg << "<text x=\"" << num(lx + 18) << "\" y=\"" << num(cy + 4) << "\">"
        << xml_escape(s.label) << "</text>\n";
    lx += w;
  }
  for (const ReferenceLine& r : p.hlines) {
    if (r.label.empty()) continue;
    const double w = next_entry(r.label);
    svg << "<line x1=\"" << num(lx) << "\" y1=\"" << num(cy) << "\" x2=\"" << num(lx + 14)
        << "\" y2=\"" << num(cy) << "\" stroke=\"" << r.color << "\" stroke-width=\"1.5\""
        << (r.dashed ? " stroke-dasharray=\"5 3\"" : "") << "/>"
        << "<text x=\"" << num(lx + 18) << "\" y=\"" << num(cy + 4) << "\">"
        << xml_escape(r.label) << "</text>\n";
    lx += w;
  }
}

// Frame, grid, ticks and the axis labels.
void write_frame(std::ostream& svg, const Panel& p, const PlotArea& a) {
  const double left = a.left, top = a.top, h = a.h, plot_w = a.plot_w;
  svg << "<g stroke=\"#e6e6e6\" stroke-width=\"1\">";
  for (double t : a.ax.ticks) {
    svg << "<line x1=\"" << num(a.sx(t)) << "\" y1=\"" << num(top) << "\" x2=\"" << num(a.sx(t))
        << "\" y2=\"" << num(top + h) << "\"/>";
  }
  for (double t : a.ay.ticks) {
    svg << "<line x1=\"" << num(left) << "\" y1=\"" << num(a.sy(t)) << "\" x2=\""
        << num(left + plot_w) << "\" y2=\"" << num(a.sy(t)) << "\"/>";
  }
  svg << "</g>\n<rect x=\"" << num(left) << "\" y=\"" << num(top) << "\" width=\""
      << num(plot_w) << "\" height=\"" << num(h)
      << "\" fill=\"none\" stroke=\"#333\" stroke-width=\"1\"/>\n<g fill=\"#333\">";
  for (double t : a.ax.ticks) {
    svg << "<text x=\"" << num(a.sx(t)) << "\" y=\"" << num(top + h + 15)
        << "\" text-anchor=\"middle\">" << tick_text(t, a.ax.step) << "</text>";
  }
  for (double t : a.ay.ticks) {
    svg << "<text x=\"" << num(left - 6) << "\" y=\"" << num(a.sy(t) + 4)
        << "\" text-anchor=\"end\">" << tick_text(t, a.ay.step) << "</text>";
  }
  svg << "</g>\n<text x=\"" << num(left + plot_w / 2) << "\" y=\"" << num(top + h + 36)
      << "\" text-anchor=\"middle\">" << xml_escape(p.x_label) << "</text>\n"
      << "<text transform=\"translate(" << num(18) << " " << num(top + h / 2)
      << ") rotate(-90)\" text-anchor=\"middle\">" << xml_escape(p.y_label) << "</text>\n";
}

// A series drawn as one polyline.
void write_line(std::ostream& svg, const Series& s, const PlotArea& a) {
  const std::size_t n = std::min(s.x.size(), s.y.size());
  svg << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"2\" points=\"";
  for (std::size_t i = 0; i < n; ++i) {
    svg << (i ? " " : "") << num(a.sx(s.x[i])) << "," << num(a.sy(s.y[i]));
  }
  svg << "\"/>\n";
}

// Point i's text label: above its bar (when the bar is wide enough), else beside its mark,
// on the left when it would leave the plot on the right.
void write_point_label(std::ostream& svg, const Series& s, std::size_t i, double px, double py,
                       const PlotArea& a) {
  const double bar_spacing = a.plot_w / (a.ax.hi - a.ax.lo);
  const double bar_label_w = 6.0 * static_cast<double>(s.labels[i].size());
  if (s.kind == SeriesKind::kBars && bar_label_w > bar_spacing) {
    // too narrow for its label: the tooltip still has it
  } else if (s.kind == SeriesKind::kBars) {
    const double base = a.sy(std::max(a.ay.lo, 0.0));
    svg << "<text x=\"" << num(px) << "\" y=\"" << num(std::min(py, base) - 4)
        << "\" text-anchor=\"middle\" font-size=\"10\" fill=\"#333\">"
        << xml_escape(s.labels[i]) << "</text>\n";
  } else {
    const double text_w = 6.0 * static_cast<double>(s.labels[i].size());
    const bool left_side = px + 7 + text_w > a.left + a.plot_w;
    svg << "<text x=\"" << num(left_side ? px - 7 : px + 7) << "\" y=\"" << num(py + 4)
        << "\" font-size=\"10\" fill=\"#555\""
        << (left_side ? " text-anchor=\"end\"" : "") << ">" << xml_escape(s.labels[i])
        << "</text>\n";
  }
}

// A series of points, crosses or bars, one mark (with its tooltip and label) per finite point.
void write_marks(std::ostream& svg, const Series& s, const PlotArea& a) {
  const std::size_t n = std::min(s.x.size(), s.y.size());
  auto color_of = [&](std::size_t i) { return i < s.colors.size() ? s.colors[i] : s.color; };
  auto tooltip = [&](std::size_t i) {
    return i < s.tooltips.size() ? "<title>" + xml_escape(s.tooltips[i]) + "</title>"
                                 : std::string();
  };
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
    const double px = a.sx(s.x[i]), py = a.sy(s.y[i]);
    switch (s.kind) {
      case SeriesKind::kPoints:
        svg << "<circle cx=\"" << num(px) << "\" cy=\"" << num(py) << "\" r=\"4\" fill=\""
            << color_of(i) << "\" fill-opacity=\"0.85\">" << tooltip(i) << "</circle>\n";
        break;
      case SeriesKind::kCrosses:
        svg << "<path d=\"M" << num(px - 4) << " " << num(py - 4) << "l8 8M" << num(px - 4)
            << " " << num(py + 4) << "l8 -8\" stroke=\"" << color_of(i)
            << "\" stroke-width=\"1.8\">" << tooltip(i) << "</path>\n";
        break;
      case SeriesKind::kBars: {
        const double half = 0.4 * a.plot_w / (a.ax.hi - a.ax.lo);
        const double base = a.sy(std::max(a.ay.lo, 0.0));
        svg << "<rect x=\"" << num(px - half) << "\" y=\"" << num(std::min(py, base))
            << "\" width=\"" << num(std::max(2 * half, 0.5)) << "\" height=\""
            << num(std::fabs(base - py)) << "\" fill=\"" << color_of(i) << "\">" << tooltip(i)
            << "</rect>\n";
        break;
      }
      case SeriesKind::kLine: break;
    }
    if (i < s.labels.size() && !s.labels[i].empty()) write_point_label(svg, s, i, px, py, a);
  }
}

// Data, clipped to the plot area: the diagonal, the series, the reference lines.
void write_data(std::ostream& svg, const Panel& p, const PlotArea& a, int panel_index) {
  const std::string clip = "plot" + std::to_string(panel_index);
  svg << "<clipPath id=\"" << clip << "\"><rect x=\"" << num(a.left) << "\" y=\"" << num(a.top)
      << "\" width=\"" << num(a.plot_w) << "\" height=\"" << num(a.h) << "\"/></clipPath>\n"
      << "<g clip-path=\"url(#" << clip << ")\">\n";
  if (p.diagonal) {
    svg << "<line x1=\"" << num(a.sx(a.ax.lo)) << "\" y1=\"" << num(a.sy(a.ax.lo)) << "\" x2=\""
        << num(a.sx(a.ax.hi)) << "\" y2=\"" << num(a.sy(a.ax.hi))
        << "\" stroke=\"#888\" stroke-width=\"1\" stroke-dasharray=\"4 3\"/>\n";
  }
  for (const Series& s : p.series) {
    if (s.kind == SeriesKind::kLine) {
      write_line(svg, s, a);
    } else {
      write_marks(svg, s, a);
    }
  }
  for (const ReferenceLine& r : p.hlines) {
    svg << "<line x1=\"" << num(a.left) << "\" y1=\"" << num(a.sy(r.y)) << "\" x2=\""
        << num(a.left + a.plot_w) << "\" y2=\"" << num(a.sy(r.y)) << "\" stroke=\"" << r.color
        << "\" stroke-width=\"1.5\"" << (r.dashed ? " stroke-dasharray=\"5 3\"" : "") << "/>\n";
  }
  svg << "</g>\n";
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int count) {
  Range r;
  r.add(lo);
  r.add(hi);
  return make_axis(r, false, std::nullopt, std::nullopt, count, false).ticks;
}

std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

Panel& Figure::add_panel(std::string x_label, std::string y_label) {
  panels.emplace_back();
  panels.back().x_label = std::move(x_label);
  panels.back().y_label = std::move(y_label);
  return panels.back();
}

std::string Figure::render() const {
  double total_height = kTitle + kNote * static_cast<double>(notes.size()) + 8;
  for (const Panel& p : panels) {
    total_height += legend_height(p, width - kLeft - kRight) + p.height + kAxisBelow + kGap;
  }

  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(width) << "\" height=\""
      << num(total_height) << "\" viewBox=\"0 0 " << num(width) << " " << num(total_height)
      << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << num(width / 2) << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\""
      << " font-weight=\"bold\">" << xml_escape(title) << "</text>\n";
  double y0 = kTitle;
  for (const std::string& note : notes) {
    svg << "<text x=\"" << num(width / 2) << "\" y=\"" << num(y0 + 10)
        << "\" text-anchor=\"middle\" fill=\"#444\">" << xml_escape(note) << "</text>\n";
    y0 += kNote;
  }
  y0 += 8;

  const double plot_w = width - kLeft - kRight;
  int panel_index = 0;
  for (const Panel& p : panels) {
    const PlotArea area = plot_area(p, y0 + legend_height(p, plot_w), plot_w);
    write_legend(svg, p, y0, plot_w);
    write_frame(svg, p, area);
    write_data(svg, p, area, panel_index);
    y0 = area.top + area.h + kAxisBelow + kGap;
    ++panel_index;
  }
  svg << "</svg>\n";
  return svg.str();
}

Series make_series(std::string label, SeriesKind kind, std::string color) {
  Series s;
  s.label = std::move(label);
  s.kind = kind;
  s.color = std::move(color);
  return s;
}

}  // namespace xpm_plan
