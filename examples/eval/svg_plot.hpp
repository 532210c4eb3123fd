#pragma once
// An SVG line plot (formatted with fmt): quality against budget, one line per policy, one
// panel per workload, a shared legend. Colours follow series order, so a policy keeps
// its colour across panels when every panel lists the series in the same order.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace kvevict::eval {

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  ///< (x, y), drawn in x order
  bool dashed = false;
};

struct Panel {
  std::string title;
  std::vector<Series> series;
};

struct PlotSpec {
  std::string title;
  std::string x_label = "budget (fraction of the context)";
  std::string y_label = "quality";
  double x_min = 0.0, x_max = 1.0;
  double y_min = 0.0, y_max = 1.0;
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
inline std::string fmt_tick(double v) { return fmt::format("{:.3g}", v); }
}  // namespace detail

/// Renders the panels side by side (up to 3 per row) as one SVG document.
inline std::string render_svg(const std::vector<Panel>& panels, const PlotSpec& spec) {
  static const char* palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                                  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939",
                                  "#e6550d", "#31a354", "#756bb1", "#843c39", "#000000"};
  std::vector<std::string> names;  // legend order: first appearance
  for (const auto& p : panels)
    for (const auto& s : p.series)
      if (std::find(names.begin(), names.end(), s.name) == names.end()) names.push_back(s.name);
  auto colour = [&](const std::string& n) {
    const auto i =
        static_cast<std::size_t>(std::find(names.begin(), names.end(), n) - names.begin());
    return palette[i % (sizeof(palette) / sizeof(*palette))];
  };
  const int pw = 360, ph = 260, ml = 60, mr = 15, mt = 30, mb = 45;
  const int cols =
      static_cast<int>(std::min<std::size_t>(3, std::max<std::size_t>(1, panels.size())));
  const int rows = static_cast<int>((panels.size() + static_cast<std::size_t>(cols) - 1) /
                                    static_cast<std::size_t>(cols));
  const int legend_w = 170, top = 40;
  // Tall enough for the panels and for every legend entry (18 px each, see below).
  const int legend_h = top + 30 + static_cast<int>(names.size()) * 18 + 10;
  const int W = cols * pw + legend_w, H = std::max(top + std::max(rows, 1) * ph + 10, legend_h);
  // Coordinates as ostream wrote them before (6 significant digits: "{:g}").
  std::string out;
  auto put = [&out](fmt::string_view f, auto&&... args) {
    fmt::vformat_to(std::back_inserter(out), f, fmt::make_format_args(args...));
  };
  put("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{3}</text>\n",
      W, H, W / 2, detail::xml_escape(spec.title));
  const double xr = spec.x_max - spec.x_min, yr = spec.y_max - spec.y_min;
  for (std::size_t pi = 0; pi < panels.size(); ++pi) {
    const int ox = static_cast<int>(pi % static_cast<std::size_t>(cols)) * pw;
    const int oy = top + static_cast<int>(pi / static_cast<std::size_t>(cols)) * ph;
    const int x0 = ox + ml, x1 = ox + pw - mr, y0 = oy + ph - mb, y1 = oy + mt;
    auto X = [&](double x) { return x0 + (x - spec.x_min) / xr * (x1 - x0); };
    auto Y = [&](double y) {
      return y0 - (std::clamp(y, spec.y_min, spec.y_max) - spec.y_min) / yr * (y0 - y1);
    };
    put("<g>\n<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"13\">{}</text>\n",
        (x0 + x1) / 2, oy + 18, detail::xml_escape(panels[pi].title));
    for (int i = 0; i <= 5; ++i) {
      const double yv = spec.y_min + yr * i / 5.0, xv = spec.x_min + xr * i / 5.0;
      put("<line x1=\"{}\" x2=\"{}\" y1=\"{:g}\" y2=\"{:g}\" stroke=\"#e5e5e5\"/>\n"
          "<text x=\"{}\" y=\"{:g}\" text-anchor=\"end\">{}</text>\n"
          "<text x=\"{:g}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
          x0, x1, Y(yv), Y(yv), x0 - 5, Y(yv) + 4, detail::fmt_tick(yv), X(xv), y0 + 15,
          detail::fmt_tick(xv));
    }
    put("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n"
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n"
        "<text transform=\"translate({},{}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
        x0, y1, x1 - x0, y0 - y1, (x0 + x1) / 2, y0 + 32, detail::xml_escape(spec.x_label),
        ox + 16, (y0 + y1) / 2, detail::xml_escape(spec.y_label));
    for (const auto& s : panels[pi].series) {
      auto pts = s.points;
      std::sort(pts.begin(), pts.end());
      std::string path;
      for (const auto& [x, y] : pts)
        if (std::isfinite(y)) fmt::format_to(std::back_inserter(path), "{:g},{:g} ", X(x), Y(y));
      const std::string c = colour(s.name);
      put("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.8\"{} points=\"{}\"/>\n", c,
          s.dashed ? " stroke-dasharray=\"5,3\"" : "", path);
      for (const auto& [x, y] : pts)
        if (std::isfinite(y))
          put("<circle cx=\"{:g}\" cy=\"{:g}\" r=\"2.3\" fill=\"{}\"/>\n", X(x), Y(y), c);
    }
    out += "</g>\n";
  }
  const int lx = cols * pw + 10;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const int ly = top + 30 + static_cast<int>(i) * 18;
    bool dashed = false;
    for (const auto& p : panels)
      for (const auto& s : p.series)
        if (s.name == names[i]) dashed = s.dashed;
    put("<line x1=\"{0}\" x2=\"{1}\" y1=\"{2}\" y2=\"{2}\" stroke=\"{3}\" stroke-width=\"2\"{4}/>\n"
        "<text x=\"{5}\" y=\"{6}\">{7}</text>\n",
        lx, lx + 24, ly, colour(names[i]), dashed ? " stroke-dasharray=\"5,3\"" : "", lx + 30,
        ly + 4, detail::xml_escape(names[i]));
  }
  out += "</svg>\n";
  return out;
}

}  // namespace kvevict::eval
