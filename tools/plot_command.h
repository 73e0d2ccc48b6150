// `cputrain plot`: train and validation loss and tokens/s against steps, from a run's
// metrics.jsonl, as an SVG file (no plotting library needed to view it: any browser shows it).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace cputrain {

struct PlotArgs {
  std::string run;
  std::string out;  // default <run>/plot.svg
};

struct Series {
  std::string name;
  std::string color;
  std::vector<double> x, y;
};

// One panel: a title, axes with ticks, and the series as polylines; width x height pixels,
// placed at (left, top). The SVG elements only, to go inside an <svg>.
std::string svg_panel(const std::string& title, const std::string& x_label,
                      const std::vector<Series>& series, double left, double top, double width,
                      double height);

void add_plot_flags(CLI::App& app, PlotArgs& args);
int run_plot(const PlotArgs& args);

}  // namespace cputrain
