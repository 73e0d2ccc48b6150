#include "engine/core/profiler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <utility>

namespace cputrain::profiler {
namespace {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Open {
  const char* name;
  Pass pass;
  double flops;
  double start;
  double nested = 0.0;  // time of the scopes closed inside this one
};

struct State {
  bool enabled = false;
  Clock clock = steady_seconds;
  std::vector<Open> open;
  // Keyed by the name's text (not its address): the same literal in two files is one entry.
  std::map<std::pair<std::string, Pass>, Entry> table;
};

State& state() {
  static State s;
  return s;
}

}  // namespace

void set_enabled(bool on) {
  State& s = state();
  if (!s.open.empty()) throw std::logic_error("profiler::set_enabled inside an open scope");
  s.enabled = on;
}

bool enabled() {
  return state().enabled;
}

void reset() {
  State& s = state();
  if (!s.open.empty()) throw std::logic_error("profiler::reset inside an open scope");
  s.table.clear();
}

Scope::Scope(const char* name, Pass pass, double flops) : active_(state().enabled) {
  if (!active_) return;
  State& s = state();
  if (pass == Pass::Enclosing) pass = s.open.empty() ? Pass::Step : s.open.back().pass;
  s.open.push_back(Open{name, pass, flops, s.clock()});
}

Scope::~Scope() {
  if (!active_) return;
  State& s = state();
  const Open o = s.open.back();
  s.open.pop_back();
  const double total = s.clock() - o.start;
  if (!s.open.empty()) s.open.back().nested += total;
  Entry& e = s.table[{std::string(o.name), o.pass}];
  if (e.calls == 0) {
    e.name = o.name;
    e.pass = o.pass;
  }
  ++e.calls;
  e.seconds += total - o.nested;
  e.flops += o.flops;
}

void add_flops(double flops) {
  State& s = state();
  if (s.enabled && !s.open.empty()) s.open.back().flops += flops;
}

std::vector<Entry> entries() {
  std::vector<Entry> out;
  for (const auto& [key, e] : state().table) out.push_back(e);
  std::stable_sort(out.begin(), out.end(),
                   [](const Entry& a, const Entry& b) { return a.seconds > b.seconds; });
  return out;
}

std::string_view pass_name(Pass pass) {
  switch (pass) {
    case Pass::Forward:
      return "forward";
    case Pass::Backward:
      return "backward";
    case Pass::Step:
      return "step";
    case Pass::Enclosing:
      return "enclosing";
  }
  return "?";
}

std::vector<std::string> report(const std::vector<Entry>& list, int64_t steps, double seconds) {
  std::vector<std::string> lines;
  const double per = steps > 0 ? 1.0 / static_cast<double>(steps) : 0.0;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%9s %6s %8s %10s  %-8s  %s", "ms/step", "share", "GFLOP/s",
                "calls/step", "pass", "scope");
  lines.emplace_back(buf);
  double covered = 0.0;
  auto row = [&](double s, double flops, double calls, std::string_view pass,
                 const std::string& name) {
    const double share = seconds > 0.0 ? 100.0 * s / seconds : 0.0;
    char gf[32] = "";
    if (flops > 0.0 && s > 0.0) std::snprintf(gf, sizeof gf, "%.1f", flops / s / 1e9);
    char cl[32] = "";
    if (calls > 0.0) std::snprintf(cl, sizeof cl, "%.1f", calls);
    std::snprintf(buf, sizeof buf, "%9.1f %5.1f%% %8s %10s  %-8.*s  %s", 1e3 * s * per, share, gf,
                  cl, static_cast<int>(pass.size()), pass.data(), name.c_str());
    lines.emplace_back(buf);
  };
  for (const Entry& e : list) {
    covered += e.seconds;
    row(e.seconds, e.flops, static_cast<double>(e.calls) * per, pass_name(e.pass), e.name);
  }
  row(std::max(0.0, seconds - covered), 0.0, 0.0, "-", "(in no scope)");
  return lines;
}

void set_clock(Clock clock) {
  state().clock = clock ? clock : steady_seconds;
}

}  // namespace cputrain::profiler
