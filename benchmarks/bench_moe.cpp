// A mixture-of-experts layer's expert products (engine/core/moe_ops.h) in bf16, next to one dense
// GEMM of the same FLOPs: Qwen3-30B-A3B's layer shape (d_model 2048, 128 experts of 768, 8 a
// token) over 2048 tokens, the router's choice drawn once (random logits, so each expert takes
// about 128 rows), the experts frozen with their bf16 copies (as in a LoRA fine-tune): forward
// (the gate, up and down
// products) and forward plus the input's gradient (dH = dY W2, dX = dG W1 + dU W3).
//
//   build/bench_moe --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
//
// Counters: GFLOPS of the expert products (2 x 3 x N k x F x C forward, twice that with dX) and
// pct_peak of the machine's bf16 peak; moe/dense/... is one bf16 GEMM (gemm_bf16, N k x F x C,
// the gate product's shape for all rows at once) of the same FLOPs a call, the rate the expert
// products aim at.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_timing.h"
#include "engine/core/autograd.h"
#include "engine/core/moe_ops.h"
#include "engine/core/profiler.h"
#include "engine/core/tensor.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/peak.h"
#include "kernels/gemm/gemm.h"

namespace cputrain::bench {
namespace {

constexpr int64_t kTokens = 2048, kModel = 2048, kExperts = 128, kFfn = 768, kUsed = 8;

Tensor normal(const Shape& shape, float std, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::F32, MemoryCategory::Workspace);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, std);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = d(rng);
  return t;
}

struct Layer {
  Tensor x = normal(Shape{1, kTokens, kModel}, 1.0f, 1);
  Tensor w1 = normal(Shape{kExperts, kFfn, kModel}, 0.02f, 2);
  Tensor w3 = normal(Shape{kExperts, kFfn, kModel}, 0.02f, 3);
  Tensor w2 = normal(Shape{kExperts, kModel, kFfn}, 0.02f, 4);
  Tensor logits = normal(Shape{1, kTokens, kExperts}, 1.0f, 5);
  Tensor dy = normal(Shape{1, kTokens, kModel}, 1.0f, 6);
  // The weights' bf16 copies, as a training run's parameters hold them (engine/train).
  Tensor w1_16 = rounding(w1), w3_16 = rounding(w3), w2_16 = rounding(w2);

  static Tensor rounding(const Tensor& t) {
    Tensor r = Tensor::empty(t.shape(), DType::BF16, MemoryCategory::Workspace);
    kernels::fp32_to_bf16_array(r.bf16(), t.f32(), t.numel());
    return r;
  }
};

void experts(benchmark::State& state, bool with_dx, const kernels::Peak& peak) {
  static Layer layer;
  ComputeDTypeGuard bf16(DType::BF16);
  Variable w1(layer.w1, false), w3(layer.w3, false), w2(layer.w2, false);
  w1.set_bf16_copy(layer.w1_16);
  w3.set_bf16_copy(layer.w3_16);
  w2.set_bf16_copy(layer.w2_16);
  const auto call = [&] {
    Variable x(layer.x, with_dx);
    const MoeRouting route =
        moe_route(Variable(layer.logits, false), kUsed, kernels::MoeGating::Softmax, true);
    const Variable y = moe_experts(x, w1, w3, w2, route);
    if (with_dx) backward(y, layer.dy);
  };
  call();
  profiler::reset();  // the profile (CPUTRAIN_BENCH_PROFILE) of the timed calls of the last run
  const double flops = 6.0 * kTokens * kUsed * kFfn * kModel * (with_dx ? 2.0 : 1.0);
  report_gflops(state, flops / timed_median(state, call) / 1e9, peak, true);
}

void dense(benchmark::State& state, const kernels::Peak& peak) {
  const int64_t M = kTokens * kUsed;
  std::vector<uint16_t> a(static_cast<size_t>(M * kModel)), b(static_cast<size_t>(kFfn * kModel));
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (uint16_t& v : a) v = kernels::fp32_to_bf16(d(rng));
  for (uint16_t& v : b) v = kernels::fp32_to_bf16(d(rng));
  std::vector<float> c(static_cast<size_t>(M * kFfn));
  const auto call = [&] {
    kernels::gemm_bf16(kernels::Transpose::No, kernels::Transpose::Yes, M, kFfn, kModel, a.data(),
                       kModel, b.data(), kModel, 0.0f, c.data(), kFfn);
  };
  call();
  report_gflops(state, 2.0 * M * kFfn * kModel / timed_median(state, call) / 1e9, peak, true);
}

}  // namespace
}  // namespace cputrain::bench

int main(int argc, char** argv) {
  using namespace cputrain::bench;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const cputrain::kernels::Peak peak = cputrain::kernels::measure_peak(2'000'000, 10);
  register_timed("moe/qwen3-30b-a3b/forward",
                 [&peak](benchmark::State& st) { experts(st, false, peak); });
  register_timed("moe/qwen3-30b-a3b/forward_dx",
                 [&peak](benchmark::State& st) { experts(st, true, peak); });
  register_timed("moe/dense/gemm_bf16", [&peak](benchmark::State& st) { dense(st, peak); });
  // CPUTRAIN_BENCH_PROFILE=1: where the time of the runs went, op by op (engine/core/profiler.h).
  const bool profile = std::getenv("CPUTRAIN_BENCH_PROFILE") != nullptr;
  cputrain::profiler::set_enabled(profile);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (profile)
    for (const std::string& line :
         cputrain::profiler::report(cputrain::profiler::entries(), 1, 0.0))
      std::printf("%s\n", line.c_str());
  return 0;
}
