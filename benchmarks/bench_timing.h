// What the benchmark programs share: each call timed by hand (Google Benchmark's manual time,
// so that set-up stays out of the figure), the median over the iterations, and one registration
// of every benchmark as manual time, at least 0.3 s, in milliseconds.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cpu/peak.h"

namespace cputrain::bench {

// The least time, in seconds, of a run Google Benchmark reports (MinTime of every benchmark).
constexpr double kMinSeconds = 0.3;

// The median of v (the upper one of an even count), for the programs' closing tables.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs call once per iteration of state, reporting its time; returns the median in seconds, and
// in *reported whether Google Benchmark reports this run: it first runs a benchmark with 1, 10,
// ... iterations to find how many fill kMinSeconds, and reports only the run that does.
template <class Call>
double timed_median(benchmark::State& state, Call&& call, bool* reported = nullptr) {
  std::vector<double> times;
  double total = 0.0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(t);
    times.push_back(t);
    total += t;
  }
  if (reported != nullptr) *reported = total >= kMinSeconds;
  std::sort(times.begin(), times.end());
  return times.empty() ? 0.0 : times[times.size() / 2];
}

// The counters GFLOPS and pct_peak (of the measured all-threads peak of the dtype; for bf16 the
// machine's best BF16 instruction, AMX where present).
inline void report_gflops(benchmark::State& state, double gflops, const kernels::Peak& peak,
                          bool bf16) {
  const double top = bf16 ? peak.bf16_best_all_threads() : peak.f32_all_threads;
  state.counters["GFLOPS"] = gflops;
  state.counters["pct_peak"] = top > 0 ? 100.0 * gflops / top : 0.0;
}

inline void register_timed(const std::string& name, std::function<void(benchmark::State&)> fn) {
  benchmark::RegisterBenchmark(name.c_str(), std::move(fn))
      ->UseManualTime()
      ->MinTime(kMinSeconds)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace cputrain::bench
