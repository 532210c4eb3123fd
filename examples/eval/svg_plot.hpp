#pragma once
// A dependency-free SVG line plot: quality against budget. One row of panels per workload
// and one column per policy family (baselines, the seed papers' methods, kvevict's own,
// the ceiling), so no panel holds more than a handful of lines. Inside a column every
// series has its own colour, marker and dash pattern (distinct even in grey print), the
// legend sits above the column, and series that are identical in every panel of the
// column are drawn once under one legend entry ("snapkv = xkv"). Context series (e.g.
// StreamingLLM and the Oracle) are repeated in light grey in the other columns.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace kvevict::eval {

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  ///< (x, y), drawn in x order
  std::string group;                              ///< the column (policy family)
};

struct Panel {
  std::string title;  ///< the row (workload)
  std::vector<Series> series;
};

struct PlotSpec {
  std::string title;
  std::string x_label = "budget (fraction of the context)";
  std::string y_label = "quality";
  double x_min = 0.0, x_max = 1.0;
  double y_min = 0.0, y_max = 1.0;
  bool auto_y_min = false;           ///< lower y_min to the data (rounded down to 0.1)
  std::vector<std::string> groups;   ///< column order; groups not listed follow
  std::vector<std::string> context;  ///< series repeated in grey in the other columns
};

namespace detail {
inline std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}
/// A tick label; -0 (an axis starting at a negative zero) prints as 0.
inline std::string fmt_tick(double v) { return fmt::format("{:.3g}", v == 0.0 ? 0.0 : v); }

// Okabe-Ito colours (distinguishable with colour-vision deficiencies), then black.
constexpr const char* kPalette[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                    "#E69F00", "#56B4E9", "#000000", "#F0E442"};
constexpr const char* kDashes[] = {"", "7,3", "2,2", "9,3,2,3", "4,4", "1,3"};
constexpr int kMarkers = 6;  // circle, square, triangle, diamond, cross, triangle down

inline std::string marker(int kind, double x, double y, const char* colour) {
  const double r = 3.2;
  switch (kind % kMarkers) {
    case 0:
      return fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"{}\" fill=\"{}\"/>", x, y, r,
                         colour);
    case 1:
      return fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>",
                         x - r, y - r, 2 * r, 2 * r, colour);
    case 2:
      return fmt::format("<path d=\"M{:.1f},{:.1f} l{},{} l{},0 z\" fill=\"{}\"/>", x, y - 1.3 * r,
                         1.2 * r, 2.2 * r, -2.4 * r, colour);
    case 3:
      return fmt::format("<path d=\"M{:.1f},{:.1f} l{},{} l{},{} l{},{} z\" fill=\"{}\"/>", x,
                         y - 1.4 * r, 1.2 * r, 1.4 * r, -1.2 * r, 1.4 * r, -1.2 * r, -1.4 * r,
                         colour);
    case 4:
      return fmt::format(
          "<path d=\"M{:.1f},{:.1f} l{},{} m0,{} l{},{}\" stroke=\"{}\" stroke-width=\"2\"/>",
          x - r, y - r, 2 * r, 2 * r, -2 * r, -2 * r, 2 * r, colour);
    default:
      return fmt::format(
          "<path d=\"M{:.1f},{:.1f} l{},{} l{},0 z\" fill=\"none\" stroke=\"{}\" "
          "stroke-width=\"1.5\"/>",
          x, y + 1.3 * r, 1.2 * r, -2.2 * r, -2.4 * r, colour);
  }
}

inline bool same_points(const Series& a, const Series& b) {
  if (a.points.size() != b.points.size()) return false;
  auto pa = a.points, pb = b.points;
  std::sort(pa.begin(), pa.end());
  std::sort(pb.begin(), pb.end());
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (std::abs(pa[i].first - pb[i].first) > 1e-12 ||
        !(std::abs(pa[i].second - pb[i].second) <= 1e-9))
      return false;
  return true;
}
}  // namespace detail

/// Renders the panels (one per workload) as a grid: a row per panel, a column per group.
inline std::string render_svg(const std::vector<Panel>& panels, PlotSpec spec) {
  // Columns: the listed groups that occur, then any other group in order of appearance.
  std::vector<std::string> groups;
  auto occurs = [&](const std::string& g) {
    for (const auto& p : panels)
      for (const auto& s : p.series)
        if (s.group == g) return true;
    return false;
  };
  for (const auto& g : spec.groups)
    if (occurs(g)) groups.push_back(g);
  for (const auto& p : panels)
    for (const auto& s : p.series)
      if (std::find(groups.begin(), groups.end(), s.group) == groups.end())
        groups.push_back(s.group);

  // Per column: series names in order, merged into classes of identical series.
  struct Entry {
    std::vector<std::string> names;  // first one drawn
    std::string label;
  };
  std::vector<std::vector<Entry>> legend(groups.size());
  auto find_series = [](const Panel& p, const std::string& n) -> const Series* {
    for (const auto& s : p.series)
      if (s.name == n) return &s;
    return nullptr;
  };
  for (std::size_t c = 0; c < groups.size(); ++c) {
    std::vector<std::string> names;
    for (const auto& p : panels)
      for (const auto& s : p.series)
        if (s.group == groups[c] && std::find(names.begin(), names.end(), s.name) == names.end())
          names.push_back(s.name);
    for (const auto& n : names) {
      bool merged = false;
      for (auto& e : legend[c]) {
        bool same = true;
        for (const auto& p : panels) {
          const Series* a = find_series(p, e.names.front());
          const Series* b = find_series(p, n);
          if ((a == nullptr) != (b == nullptr) || (a && !detail::same_points(*a, *b))) same = false;
        }
        if (same) {
          e.names.push_back(n);
          e.label += " = " + n;
          merged = true;
          break;
        }
      }
      if (!merged) legend[c].push_back({{n}, n});
    }
  }

  if (spec.auto_y_min) {
    double lo = spec.y_max;
    for (const auto& p : panels)
      for (const auto& s : p.series)
        for (const auto& pt : s.points)
          if (std::isfinite(pt.second)) lo = std::min(lo, pt.second);
    spec.y_min = std::min(std::floor(lo * 10.0) / 10.0, spec.y_max - 0.1);
  }

  const int pw = 290, ph = 215, ml = 60, mr = 12, mt = 12, mb = 40, row_label = 26;
  const int cols = static_cast<int>(std::max<std::size_t>(1, groups.size()));
  const int rows = static_cast<int>(std::max<std::size_t>(1, panels.size()));
  std::size_t max_entries = 0;
  for (const auto& l : legend) max_entries = std::max(max_entries, l.size());
  const int top = 36, header = 22,
            legend_h = static_cast<int>(max_entries + spec.context.size()) * 16 + 8;
  const int grid_top = top + header + legend_h;
  const int W = row_label + cols * pw + 10, H = grid_top + rows * ph + 8;
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} "
      "{1}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n<text x=\"{2}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{3}"
      "</text>\n",
      W, H, W / 2, detail::xml_escape(spec.title));

  // Column headers and legends.
  for (std::size_t c = 0; c < groups.size(); ++c) {
    const int ox = row_label + static_cast<int>(c) * pw;
    out += fmt::format(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"13\" "
        "font-weight=\"bold\">{}</text>\n",
        ox + (ml + pw - mr) / 2, top + 14, detail::xml_escape(groups[c]));
    int ly = top + header + 10;
    for (std::size_t i = 0; i < legend[c].size(); ++i, ly += 16) {
      const char* colour = detail::kPalette[i % std::size(detail::kPalette)];
      const char* dash = detail::kDashes[i % std::size(detail::kDashes)];
      const int lx = ox + ml;
      out += fmt::format(
          "<line x1=\"{}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"{}\" "
          "stroke-width=\"2\" stroke-dasharray=\"{}\"/>",
          lx, lx + 30, ly, ly, colour, dash);
      out += detail::marker(static_cast<int>(i), lx + 15, ly, colour);
      out += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", lx + 38, ly + 4,
                         detail::xml_escape(legend[c][i].label));
    }
    for (std::size_t k = 0; k < spec.context.size(); ++k) {
      const auto& n = spec.context[k];
      const bool own = std::find_if(legend[c].begin(), legend[c].end(), [&](const Entry& e) {
                         return std::find(e.names.begin(), e.names.end(), n) != e.names.end();
                       }) != legend[c].end();
      if (own) continue;
      out += fmt::format(
          "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2}\" y2=\"{2}\" stroke=\"#bbb\" "
          "stroke-width=\"2\" stroke-dasharray=\"{5}\"/><text x=\"{3}\" y=\"{4}\" "
          "fill=\"#888\">{6}</text>\n",
          ox + ml, ox + ml + 30, ly, ox + ml + 38, ly + 4, k % 2 ? "6,4" : "",
          detail::xml_escape(n));
      ly += 16;
    }
  }

  const double xr = spec.x_max - spec.x_min, yr = spec.y_max - spec.y_min;
  for (std::size_t r = 0; r < panels.size(); ++r) {
    const int oy = grid_top + static_cast<int>(r) * ph;
    out += fmt::format(
        "<text transform=\"translate({},{}) rotate(-90)\" text-anchor=\"middle\" "
        "font-size=\"13\" font-weight=\"bold\">{}</text>\n",
        14, oy + (mt + ph - mb) / 2, detail::xml_escape(panels[r].title));
    for (std::size_t c = 0; c < groups.size(); ++c) {
      const int ox = row_label + static_cast<int>(c) * pw;
      const int x0 = ox + ml, x1 = ox + pw - mr, y0 = oy + ph - mb, y1 = oy + mt;
      auto X = [&](double x) { return x0 + (x - spec.x_min) / xr * (x1 - x0); };
      auto Y = [&](double y) {
        return y0 - (std::clamp(y, spec.y_min, spec.y_max) - spec.y_min) / yr * (y0 - y1);
      };
      // Ticks at a round step: at most 8 intervals.
      auto step_for = [](double range) {
        for (double st : {0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0})
          if (range / st <= 8.0 + 1e-9) return st;
        return range / 5.0;
      };
      const double ys = step_for(yr), xs = step_for(xr);
      for (double yv = std::ceil(spec.y_min / ys - 1e-9) * ys; yv <= spec.y_max + 1e-9; yv += ys)
        out += fmt::format(
            "<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#e5e5e5\"/>"
            "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
            x0, x1, Y(yv), Y(yv), x0 - 4, Y(yv) + 4, detail::fmt_tick(yv));
      for (double xv = std::ceil(spec.x_min / xs - 1e-9) * xs; xv <= spec.x_max + 1e-9; xv += xs)
        out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", X(xv),
                           y0 + 14, detail::fmt_tick(xv));
      out += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" "
          "stroke=\"#333\"/>\n",
          x0, y1, x1 - x0, y0 - y1);
      if (r + 1 == panels.size())
        out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                           (x0 + x1) / 2, y0 + 30, detail::xml_escape(spec.x_label));
      if (c == 0)
        out += fmt::format(
            "<text transform=\"translate({},{}) rotate(-90)\" "
            "text-anchor=\"middle\">{}</text>\n",
            row_label + 12, (y0 + y1) / 2, detail::xml_escape(spec.y_label));
      auto line = [&](const Series& s, const std::string& attrs) {
        auto pts = s.points;
        std::sort(pts.begin(), pts.end());
        std::string path;
        for (const auto& [x, y] : pts)
          if (std::isfinite(y)) path += fmt::format("{:.1f},{:.1f} ", X(x), Y(y));
        out += fmt::format("<polyline fill=\"none\" {} points=\"{}\"/>\n", attrs, path);
        return pts;
      };
      // Context series first (underneath), then the column's own.
      for (std::size_t k = 0; k < spec.context.size(); ++k) {
        const Series* s = find_series(panels[r], spec.context[k]);
        if (s == nullptr || s->group == groups[c]) continue;
        line(*s, k % 2 ? "stroke=\"#bbb\" stroke-width=\"2\" stroke-dasharray=\"6,4\""
                       : "stroke=\"#bbb\" stroke-width=\"2\"");
      }
      for (std::size_t i = 0; i < legend[c].size(); ++i) {
        const Series* s = find_series(panels[r], legend[c][i].names.front());
        if (s == nullptr) continue;
        const char* colour = detail::kPalette[i % std::size(detail::kPalette)];
        const char* dash = detail::kDashes[i % std::size(detail::kDashes)];
        const auto pts = line(*s, fmt::format("stroke=\"{}\" stroke-width=\"1.8\" "
                                              "stroke-dasharray=\"{}\"",
                                              colour, dash));
        for (const auto& [x, y] : pts)
          if (std::isfinite(y)) out += detail::marker(static_cast<int>(i), X(x), Y(y), colour);
        out += "\n";
      }
    }
  }
  out += "</svg>\n";
  return out;
}

}  // namespace kvevict::eval
