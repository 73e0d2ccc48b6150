#include "tools/plot_command.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/io/atomic_file.h"

namespace cputrain {
namespace {

// About five round tick values covering [lo, hi].
std::vector<double> ticks(double lo, double hi) {
  const double span = hi - lo;
  const double raw = span / 5.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double r = raw / mag;
  const double step = (r < 1.5 ? 1.0 : r < 3.5 ? 2.0 : r < 7.5 ? 5.0 : 10.0) * mag;
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) t.push_back(v);
  return t;
}

std::string label(double v) {
  return fmt::format("{:g}", std::abs(v) < 1e-12 ? 0.0 : v);
}

}  // namespace

std::string svg_panel(const std::string& title, const std::string& x_label,
                      const std::vector<Series>& series, double left, double top, double width,
                      double height) {
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const Series& s : series) {
    for (double v : s.x) x0 = std::min(x0, v), x1 = std::max(x1, v);
    for (double v : s.y) y0 = std::min(y0, v), y1 = std::max(y1, v);
  }
  if (!(x1 >= x0)) x0 = 0, x1 = 1;
  if (!(y1 >= y0)) y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y0 -= 0.5, y1 += 0.5;
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad;
  y1 += pad;
  const double pl = left + 60, pr = left + width - 20, pt = top + 30, pb = top + height - 40;
  auto px = [&](double x) { return pl + (x - x0) / (x1 - x0) * (pr - pl); };
  auto py = [&](double y) { return pb - (y - y0) / (y1 - y0) * (pb - pt); };
  std::string svg;
  svg += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"15\" font-weight=\"bold\">{}</text>\n", pl,
      top + 18, title);
  svg += fmt::format(
      "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
      "fill=\"none\" stroke=\"#444\"/>\n",
      pl, pt, pr - pl, pb - pt);
  for (double v : ticks(x0, x1)) {
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#ddd\"/>"
        "<text x=\"{0:.1f}\" y=\"{3:.1f}\" font-size=\"11\" text-anchor=\"middle\">{4}</text>\n",
        px(v), pt, pb, pb + 15, label(v));
  }
  for (double v : ticks(y0, y1)) {
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"#ddd\"/>"
        "<text x=\"{3:.1f}\" y=\"{4:.1f}\" font-size=\"11\" text-anchor=\"end\">{5}</text>\n",
        pl, py(v), pr, pl - 5, py(v) + 4, label(v));
  }
  svg += fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"12\" text-anchor=\"middle\">{}</text>\n",
      (pl + pr) / 2, pb + 32, x_label);
  double legend_x = pr;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    const Series& s = *it;
    std::string points;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
      points += fmt::format("{:.1f},{:.1f} ", px(s.x[i]), py(s.y[i]));
    svg +=
        fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                    s.color, points);
    if (s.x.size() == 1)
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", px(s.x[0]),
                         py(s.y[0]), s.color);
    legend_x -= 8.0 * static_cast<double>(s.name.size()) + 30;
    svg += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"{3}\" "
        "stroke-width=\"3\"/><text x=\"{4:.1f}\" y=\"{5:.1f}\" font-size=\"12\">{6}</text>\n",
        legend_x, top + 14, legend_x + 18, s.color, legend_x + 22, top + 18, s.name);
  }
  return svg;
}

void add_plot_flags(CLI::App& app, PlotArgs& a) {
  app.add_option("--run", a.run, "Run directory written by `cputrain train`")->required();
  app.add_option("--out", a.out, "SVG file to write (default: <run>/plot.svg)");
}

int run_plot(const PlotArgs& a) {
  const std::string path = a.run + "/metrics.jsonl";
  std::ifstream in(path);
  if (!in) throw UserError("--run " + a.run + ": no metrics.jsonl to plot");
  Series train{"train loss", "#1f77b4", {}, {}}, val{"validation loss", "#d62728", {}, {}},
      speed{"tokens/s", "#2ca02c", {}, {}};
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
      const double step = j.at("step").get<double>();
      train.x.push_back(step);
      train.y.push_back(j.at("loss").get<double>());
      speed.x.push_back(step);
      speed.y.push_back(j.at("tokens_per_s").get<double>());
      if (j.contains("val_loss")) {
        val.x.push_back(step);
        val.y.push_back(j["val_loss"].get<double>());
      }
    } catch (const std::exception& e) {
      throw UserError(path + ": line " + std::to_string(n) + " is not a metrics record (" +
                      e.what() + ")");
    }
  }
  if (train.x.empty()) throw UserError(path + ": no steps to plot");
  const double w = 900, h = 320;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "font-family=\"sans-serif\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n",
      w, 2 * h);
  std::vector<Series> losses = {train};
  if (!val.x.empty()) losses.push_back(val);
  svg += svg_panel("loss (nats)", "step", losses, 0, 0, w, h);
  svg += svg_panel("throughput", "step", {speed}, 0, h, w, h);
  svg += "</svg>\n";
  const std::string out = a.out.empty() ? a.run + "/plot.svg" : a.out;
  write_file_atomic(out, svg);
  std::printf("wrote %s (%zu steps)\n", out.c_str(), train.x.size());
  return 0;
}

}  // namespace cputrain
