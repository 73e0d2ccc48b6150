// Attention benchmark: the causal attention of one training micro-batch of mini, mega and
// behemoth (batch x ctx x heads x head dimension of the preset; mega_hd128: mega's in heads of
// 128), forward and backward, on each path this CPU runs: the FP32 tiles (fp32) and, with
// AVX512_BF16, the vdpbf16ps tiles (bf16).
// Prints GFLOP/s (the products' FLOPs: 2 x B x H x T^2 x D for the causal forward, 5/2 of that
// for the backward, which recomputes the scores) and % of the measured peak of the dtype.
//
//   build/bench_attention
//   build/bench_attention --benchmark_filter=mega
//
// Benchmarks are named attention/<path>/<preset>/<forward|backward>, counters GFLOPS and
// pct_peak (of the peak measured at the start); a table at the end gives the median GFLOP/s of
// each over its repetitions and its % of the higher of the peaks measured at the start and the
// end, so that a start in a slow spell does not inflate it. Sliding windows (Gemma 3 1B's layer: 4
// heads of 256, a window of 512): the forward and backward of each path at contexts of 2x and 4x
// the window, with the window and without, named attention/<path>/window512_T<T>/... and
// attention/<path>/full_T<T>/...; counter us_per_token (a windowed layer's stays level as the
// context grows, a full one's grows with it).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_timing.h"
#include "kernels/attention/attention.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/peak.h"
#include "models/model_config.h"

namespace cputrain::bench {
namespace {

kernels::Peak peak;

// "path/preset/pass" -> GFLOP/s of each reported repetition, in the order first run.
std::map<std::string, std::vector<double>> results;
std::vector<std::string> order;

struct Dims {
  std::string preset;
  int64_t B, T, H, D;
  int64_t window = 0;
  int64_t n() const { return B * T * H * D; }
  // (query, key) pairs of one head: causal (T^2 / 2), within the window.
  double pairs() const {
    const auto t = static_cast<double>(T), w = static_cast<double>(window);
    return window > 0 && window < T ? w * (w + 1) / 2 + (t - w) * w : t * t / 2;
  }
};

void run_one(benchmark::State& state, const Dims& s, bool bf16, bool backward) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(s.n()), k(s.n()), v(s.n()), dout(s.n()), out(s.n()), lse(s.B * s.H * s.T);
  for (auto* t : {&q, &k, &v, &dout})
    for (float& x : *t) x = kernels::bf16_to_fp32(kernels::fp32_to_bf16(normal(rng)));
  std::vector<uint16_t> q16(s.n()), k16(s.n()), v16(s.n()), out16(s.n());
  kernels::fp32_to_bf16_array(q16.data(), q.data(), s.n());
  kernels::fp32_to_bf16_array(k16.data(), k.data(), s.n());
  kernels::fp32_to_bf16_array(v16.data(), v.data(), s.n());
  std::vector<float> dq(s.n()), dk(s.n()), dv(s.n());
  kernels::AttentionOptions options;
  options.window = s.window;
  auto forward = [&] {
    if (bf16)
      kernels::attention_forward_bf16(out16.data(), lse.data(), q16.data(), k16.data(), v16.data(),
                                      s.B, s.T, s.H, s.H, s.D, options);
    else
      kernels::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.B, s.T,
                                 s.H, s.H, s.D, options);
  };
  auto call = [&] {
    if (!backward) return forward();
    if (bf16)
      kernels::attention_backward_bf16(dq.data(), dk.data(), dv.data(), dout.data(), q16.data(),
                                       k16.data(), v16.data(), out16.data(), lse.data(), s.B, s.T,
                                       s.H, s.H, s.D, false, options);
    else
      kernels::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                  v.data(), out.data(), lse.data(), s.B, s.T, s.H, s.H, s.D, false,
                                  options);
  };
  forward();
  if (!bf16) kernels::fp32_to_bf16_array(out16.data(), out.data(), s.n());
  call();  // warm-up: thread buffers
  bool reported = false;
  const double seconds = timed_median(state, call, &reported);
  // S = Q K^T and O = P V over the pairs: 2 x 2 D FLOPs a pair.
  const double fwd_flops = 4.0 * s.B * s.H * s.pairs() * s.D;
  const double gflops = (backward ? 2.5 : 1.0) * fwd_flops / seconds / 1e9;
  report_gflops(state, gflops, peak, bf16);
  if (reported) {
    const std::string key = std::string(bf16 ? "bf16" : "fp32") + "/" + s.preset + "/" +
                            (backward ? "backward" : "forward");
    if (!results.count(key)) order.push_back(key);
    results[key].push_back(gflops);
  }
  state.counters["us_per_token"] = seconds * 1e6 / static_cast<double>(s.B * s.T);
}

// The table: each benchmark's median GFLOP/s over its repetitions, % of the higher peak.
void print_summary(const kernels::Peak& start, const kernels::Peak& end) {
  if (results.empty()) return;
  const kernels::Peak top = kernels::higher_peak(start, end);
  std::printf(
      "\npeak GFLOP/s, all threads, at the start / the end: f32 %.1f / %.1f, bf16 %.1f / %.1f\n",
      start.f32_all_threads, end.f32_all_threads, start.bf16_best_all_threads(),
      end.bf16_best_all_threads());
  std::printf("%%peak is of the higher of the two; GFLOP/s, the median of the repetitions\n");
  std::printf("%-40s %9s %7s\n", "path/preset/pass", "GFLOP/s", "%peak");
  for (const std::string& key : order) {
    const double gflops = median(results[key]);
    const double p = key.rfind("bf16/", 0) == 0 ? top.bf16_best_all_threads() : top.f32_all_threads;
    std::printf("%-40s %9.1f %6.1f%%\n", key.c_str(), gflops, p > 0 ? 100 * gflops / p : 0.0);
  }
}

}  // namespace
}  // namespace cputrain::bench

int main(int argc, char** argv) {
  using namespace cputrain::bench;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  peak = cputrain::kernels::measure_peak();
  std::printf("peak GFLOP/s (measured, all threads): f32 %.1f, bf16 %.1f, amx %.1f\n",
              peak.f32_all_threads, peak.bf16_all_threads, peak.amx_all_threads);
  for (const char* name : {"mini", "mega", "behemoth"}) {
    const cputrain::Preset p = *cputrain::find_preset(name);
    const Dims s{name, p.batch, p.config.ctx, p.config.n_heads,
                 p.config.d_model / p.config.n_heads};
    for (bool bf16 : {false, true}) {
      if (bf16 && !cputrain::kernels::attention_bf16_native()) continue;
      for (bool backward : {false, true}) {
        const std::string bench = std::string("attention/") + (bf16 ? "bf16" : "fp32") + "/" +
                                  name + "/" + (backward ? "backward" : "forward");
        register_timed(
            bench, [s, bf16, backward](benchmark::State& st) { run_one(st, s, bf16, backward); });
      }
    }
  }
  // Mega's batch, context and width in 4 heads of 128 (the head dimension of Qwen3 and Llama 3.2
  // 3B) beside its 8 of 64.
  {
    const cputrain::Preset p = *cputrain::find_preset("mega");
    const Dims s{"mega_hd128", p.batch, p.config.ctx, p.config.d_model / 128, 128};
    for (bool bf16 : {false, true}) {
      if (bf16 && !cputrain::kernels::attention_bf16_native()) continue;
      for (bool backward : {false, true})
        register_timed(
            std::string("attention/") + (bf16 ? "bf16/" : "fp32/") + s.preset +
                (backward ? "/backward" : "/forward"),
            [s, bf16, backward](benchmark::State& st) { run_one(st, s, bf16, backward); });
    }
  }
  // Gemma 3 1B's attention: 4 query heads of 256 (one key/value head, read as four here), a
  // sliding window of 512.
  for (const int64_t T : {1024, 2048}) {
    for (const int64_t window : {512, 0}) {
      const std::string name = (window > 0 ? "window512_T" : "full_T") + std::to_string(T);
      const Dims s{name, 1, T, 4, 256, window};
      for (bool bf16 : {false, true}) {
        if (bf16 && !cputrain::kernels::attention_bf16_native()) continue;
        for (bool backward : {false, true})
          register_timed(
              std::string("attention/") + (bf16 ? "bf16/" : "fp32/") + name +
                  (backward ? "/backward" : "/forward"),
              [s, bf16, backward](benchmark::State& st) { run_one(st, s, bf16, backward); });
      }
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  print_summary(peak, cputrain::kernels::measure_peak());
  benchmark::Shutdown();
  return 0;
}
