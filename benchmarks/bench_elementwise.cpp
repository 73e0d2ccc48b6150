// Elementwise kernel benchmark: SwiGLU (forward, forward with bf16 output, backward), the
// residual sum into the next norm (apart and fused) and the cross-entropy forward at the shapes of
// one mega micro-batch (4096 tokens x ffn 1536; one LM head chunk of 512 rows x vocabulary 16384),
// for each ISA build this CPU runs (avx2 always, avx512 where present), so the builds can be
// compared on one machine. Next to them, what the memory-bound passes are measured against: the
// AdamW update over 16M parameters (30 bytes each) and a triad over arrays as large (c = a + s b),
// and the cost of entering an OpenMP parallel region.
//
//   build/bench_elementwise
//   build/bench_elementwise --benchmark_filter=avx2
//   build/bench_elementwise --benchmark_filter='memory|openmp'
//
//   build/bench_elementwise --benchmark_filter=residual
//
// Benchmarks are named elementwise/<isa>/<kernel>, residual/<variant> (the residual sum and the
// next norm, apart and fused), memory/<pass> (counter GBps: bytes read and
// written per second) and openmp/empty_parallel_region (counter us per region).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks/bench_timing.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/ops/adamw.h"
#include "kernels/ops/cross_entropy_isa.h"
#include "kernels/ops/rmsnorm.h"
#include "kernels/ops/swiglu_isa.h"
#include "kernels/ops/vector_add.h"

namespace cputrain::bench {
namespace {

using kernels::CrossEntropyKernels;
using kernels::SwigluKernels;

constexpr int64_t kSwigluN = 4096 * 1536;
constexpr int64_t kRows = 512, kVocab = 16384;

// Varied values in a range where exp neither under- nor overflows.
std::vector<float> values(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[i] = scale * static_cast<float>((i * 7919) % 2001 - 1000) / 1000;
  return v;
}

void swiglu(benchmark::State& state, const SwigluKernels& k, const std::string& which) {
  const int64_t n = kSwigluN;
  const std::vector<float> gate = values(n, 6.0f), up = values(n, 2.0f), dout = values(n, 1.0f);
  std::vector<float> out(n), dgate(n), dup(n);
  std::vector<uint16_t> out16(n), gate16(n), up16(n);
  double bytes = 0.0;
  std::function<void()> call;
  if (which == "forward") {
    call = [&] { k.forward(out.data(), gate.data(), up.data(), n); };
    bytes = 12.0 * n;
  } else if (which == "forward_bf16") {
    call = [&] {
      k.forward_bf16(out16.data(), gate16.data(), up16.data(), gate.data(), up.data(), n);
    };
    bytes = 14.0 * n;
  } else {
    call = [&] {
      k.backward(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), n, false);
    };
    bytes = 20.0 * n;  // reads dout, gate, up; writes dgate, dup
  }
  call();
  state.counters["GBps"] = bytes / timed_median(state, call) / 1e9;
}

void cross_entropy(benchmark::State& state, const CrossEntropyKernels& k) {
  const std::vector<float> logits = values(kRows * kVocab, 8.0f);
  std::vector<int32_t> targets(kRows);
  for (int64_t i = 0; i < kRows; ++i) targets[i] = static_cast<int32_t>((i * 131) % kVocab);
  std::vector<float> losses(kRows), lse(kRows);
  auto call = [&] {
    k.forward(losses.data(), lse.data(), logits.data(), targets.data(), kRows, kVocab);
  };
  call();
  state.counters["GBps"] = 4.0 * kRows * kVocab / timed_median(state, call) / 1e9;
}

// The LM head's bf16-mode pass over a chunk of FP32 logits: losses and the gradient's bf16
// rounding in one kernel, which overwrites the logits (the values it then sees differ, the work
// does not). At mega's vocabulary (512 rows) and at Qwen's (64 rows of 151936). Counter GBps:
// the chunk's FP32 bytes read and its bf16 bytes written per second.
void cross_entropy_forward_gradient_bf16(benchmark::State& state, const CrossEntropyKernels& k,
                                         int64_t rows, int64_t vocab) {
  std::vector<float> logits = values(rows * vocab, 8.0f);
  std::vector<int32_t> targets(rows);
  for (int64_t i = 0; i < rows; ++i) targets[i] = static_cast<int32_t>((i * 131) % vocab);
  std::vector<float> losses(rows);
  std::vector<uint16_t> out16(rows * vocab);
  auto call = [&] {
    k.forward_gradient(nullptr, out16.data(), losses.data(), logits.data(), logits.data(),
                       targets.data(), 1.0f / static_cast<float>(rows), rows, vocab);
  };
  call();
  const double seconds = timed_median(state, call);
  state.counters["GBps"] = 6.0 * rows * vocab / seconds / 1e9;
  state.counters["ms"] = seconds * 1e3;
}

// The residual sum into the next norm at one mega micro-batch (4096 tokens x 512), bf16 mode:
// apart (vector_add, then rmsnorm_forward_bf16 rounding the sum; backward rmsnorm_backward
// onto the sum's gradient, then add's copy to one side and rounding to the other) or fused
// (add_rmsnorm_forward_bf16; add_rmsnorm_backward). Counter GBps: the bytes each variant reads
// and writes per second; ms: one call.
constexpr int64_t kTokens = 4096, kModel = 512;

void residual_norm(benchmark::State& state, bool fused, bool forward) {
  const int64_t N = kTokens, C = kModel, n = N * C;
  const std::vector<float> a = values(n, 1.0f), b = values(n, 0.5f), w = values(C, 1.0f);
  const std::vector<float> dy = values(n, 0.01f), dsum0 = values(n, 0.02f);
  std::vector<float> sum(n), rstd(N, 1.0f), dsum = dsum0, da(n), dw(C);
  std::vector<uint16_t> out16(n), sum16(n), db16(n);
  for (int64_t i = 0; i < n; ++i) sum16[i] = cputrain::kernels::fp32_to_bf16(a[i] + b[i]);
  std::function<void()> call;
  double bytes = 0.0;
  if (forward && fused) {
    call = [&] {
      kernels::add_rmsnorm_forward_bf16(sum.data(), out16.data(), sum16.data(), rstd.data(),
                                        a.data(), b.data(), w.data(), N, C, 1e-5f);
    };
    bytes = 16.0 * n;  // reads a, b; writes the sum, its rounding, the norm's
  } else if (forward) {
    call = [&] {
      kernels::vector_add(sum.data(), a.data(), b.data(), n);
      kernels::rmsnorm_forward_bf16(out16.data(), sum16.data(), rstd.data(), sum.data(), w.data(),
                                    N, C, 1e-5f);
    };
    bytes = 20.0 * n;  // the add's 12, the norm's read of the sum and its two roundings
  } else if (fused) {
    call = [&] {
      kernels::SumGradient to_a, to_b;
      to_a.grad = da.data();
      to_b.rounded = db16.data();
      kernels::add_rmsnorm_backward(to_a, to_b, dw.data(), dsum.data(), dy.data(), sum16.data(),
                                    w.data(), rstd.data(), N, C);
    };
    bytes = 16.0 * n;  // reads dsum, dy, the sum's rounding; writes da, db's rounding
  } else {
    call = [&] {
      kernels::rmsnorm_backward(dsum.data(), dw.data(), dy.data(), sum16.data(), w.data(),
                                rstd.data(), N, C, true);
      kernels::vector_copy(da.data(), dsum.data(), n);
      kernels::fp32_to_bf16_array(db16.data(), dsum.data(), n);
    };
    bytes = 28.0 * n;  // the norm's 14, the copy's 8, the rounding's 6
  }
  call();
  const double seconds = timed_median(state, call);
  state.counters["GBps"] = bytes / seconds / 1e9;
  state.counters["ms"] = seconds * 1e3;
}

constexpr int64_t kParams = int64_t{16} << 20;

// One AdamW step over kParams parameters with a bf16 copy: reads parameter, gradient, m and v,
// writes parameter, m, v and the copy (30 bytes per parameter).
void adamw(benchmark::State& state) {
  std::vector<float> p = values(kParams, 1.0f), g = values(kParams, 0.01f), m(kParams), v(kParams);
  std::vector<uint16_t> copy(kParams);
  kernels::AdamWHyper h;
  h.weight_decay = 0.1f;
  auto call = [&] {
    kernels::adamw_update(p.data(), g.data(), m.data(), v.data(), kParams, h, 1.0f, copy.data());
  };
  call();
  state.counters["GBps"] = 30.0 * kParams / timed_median(state, call) / 1e9;
}

// c = a + s b over kParams floats, split over the threads: 12 bytes per element.
void triad(benchmark::State& state) {
  const std::vector<float> a = values(kParams, 1.0f), b = values(kParams, 2.0f);
  std::vector<float> c(kParams);
  auto call = [&] {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < kParams; ++i) c[i] = a[i] + 1.5f * b[i];
  };
  call();
  state.counters["GBps"] = 12.0 * kParams / timed_median(state, call) / 1e9;
}

// 10000 empty parallel regions of all threads.
void empty_parallel_regions(benchmark::State& state) {
  constexpr int kRegions = 10000;
  int sink = 0;
  auto call = [&] {
    for (int r = 0; r < kRegions; ++r) {
#pragma omp parallel
      {
        if (omp_get_thread_num() == 0) sink += 1;
      }
    }
  };
  call();
  state.counters["us"] = 1e6 * timed_median(state, call) / kRegions;
  benchmark::DoNotOptimize(sink);
}

}  // namespace
}  // namespace cputrain::bench

int main(int argc, char** argv) {
  using namespace cputrain::bench;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  struct Build {
    const char* isa;
    const cputrain::kernels::SwigluKernels* swiglu;
    const cputrain::kernels::CrossEntropyKernels* cross_entropy;
  };
  std::vector<Build> builds{{"avx2", &cputrain::kernels::swiglu_kernels_avx2(),
                             &cputrain::kernels::cross_entropy_kernels_avx2()}};
  if (cputrain::kernels::cpu_features().avx512)
    builds.push_back({"avx512", &cputrain::kernels::swiglu_kernels_avx512(),
                      &cputrain::kernels::cross_entropy_kernels_avx512()});
  for (const Build& b : builds) {
    const std::string prefix = std::string("elementwise/") + b.isa + "/";
    for (const char* which : {"forward", "forward_bf16", "backward"}) {
      const auto* k = b.swiglu;
      register_timed(prefix + "swiglu_" + which,
                     [k, which](benchmark::State& st) { swiglu(st, *k, which); });
    }
    const auto* ce = b.cross_entropy;
    register_timed(prefix + "cross_entropy_forward",
                   [ce](benchmark::State& st) { cross_entropy(st, *ce); });
    register_timed(prefix + "cross_entropy_forward_gradient_bf16/v16384",
                   [ce](benchmark::State& st) {
                     cross_entropy_forward_gradient_bf16(st, *ce, kRows, kVocab);
                   });
    register_timed(
        prefix + "cross_entropy_forward_gradient_bf16/v151936",
        [ce](benchmark::State& st) { cross_entropy_forward_gradient_bf16(st, *ce, 64, 151936); });
  }
  for (const bool forward : {true, false})
    for (const bool fused : {false, true})
      register_timed(std::string("residual/") + (fused ? "add_rmsnorm_" : "add_then_rmsnorm_") +
                         (forward ? "forward_bf16" : "backward"),
                     [fused, forward](benchmark::State& st) { residual_norm(st, fused, forward); });
  register_timed("memory/adamw_update", adamw);
  register_timed("memory/triad", triad);
  register_timed("openmp/empty_parallel_region", empty_parallel_regions);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
