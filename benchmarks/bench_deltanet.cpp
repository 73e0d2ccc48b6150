// Gated DeltaNet's chunked delta rule (kernels/deltanet/gated_delta.h), forward and backward,
// its products in FP32 and on bf16 (bf16_products: vdpbf16ps, AMX where present), at a layer of
// SHAPE heads: B sequences of T positions, Hk key heads and Hv value
// heads of 128, chunks of 64. The default is Qwen3.5-2B's linear-attention layer (16 key and 16
// value heads of 128) at ctx 2048, one sequence.
//
//   build/bench_deltanet
//   build/bench_deltanet --benchmark_filter=forward
//
// Counters: GFLOPS of the chunked algorithm's products (what its GEMMs and triangular solve
// compute, counted below) and pct_peak of the machine's measured FP32 peak (bf16 peak for the
// bf16 products), all threads.
//
// deltanet/qwen3.5-2b/layer: the whole Gated DeltaNet layer as the decoder trains it in bf16
// (models/decoder.cpp: the q, k, v, z, beta and alpha projections, the convolutions, the L2 norms,
// the delta rule, the gated RMSNorm and the output projection; every weight trained), d_model
// 2048, one sequence of 2048, forward and backward: a one-layer DecoderModel whose MLP (ffn 16)
// and head (vocab 256) are all but free. Its GFLOPS count the projections' three products (6
// FLOPs a weight a position) and the delta rule's, against the machine's bf16 peak.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "benchmarks/bench_timing.h"
#include "engine/core/autograd.h"
#include "engine/core/tensor.h"
#include "kernels/cpu/peak.h"
#include "kernels/deltanet/gated_delta.h"
#include "models/architecture.h"
#include "models/decoder.h"

namespace cputrain::bench {
namespace {

kernels::GatedDeltaShape layer_shape() {
  kernels::GatedDeltaShape s;
  s.batch = 1;
  s.length = 2048;
  s.key_heads = 16;
  s.value_heads = 16;
  s.key_dim = 128;
  s.value_dim = 128;
  s.chunk = 64;
  return s;
}

// FLOPs of one chunk of n positions of one value head, dk = dv = d. Forward: K K^T, Q K^T, the
// two products by (I + X)^-1 and A U (n^2 d each, 2 FLOPs a multiply-add, 10 n^2 d), W S0, Q S0
// and K^T U (6 n d^2), the inverse (n^3 / 3). Backward: the forward's solve again (8 n^2 d +
// 2 n d^2 + n^3 / 3) and its own 20 n^2 d + 14 n d^2.
double chunk_flops(double n, double d, bool backward) {
  const double forward = 10 * n * n * d + 6 * n * d * d + n * n * n / 3;
  return backward ? 28 * n * n * d + 16 * n * d * d + n * n * n / 3 : forward;
}

double layer_flops(const kernels::GatedDeltaShape& s, bool backward) {
  return static_cast<double>(s.batch * s.value_heads * s.chunks()) *
         chunk_flops(static_cast<double>(s.chunk), static_cast<double>(s.key_dim), backward);
}

std::vector<float> values(int64_t n, float lo, float hi, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t x = seed;
  for (float& e : v) {
    x = x * 1664525u + 1013904223u;
    e = lo + (hi - lo) * static_cast<float>(x >> 8) / static_cast<float>(1u << 24);
  }
  return v;
}

void delta_rule(benchmark::State& state, bool backward, bool bf16, const kernels::Peak& peak) {
  kernels::GatedDeltaShape s = layer_shape();
  s.bf16_products = bf16;
  const int64_t rows = s.batch * s.length;
  std::vector<float> q = values(rows * s.key_heads * s.key_dim, -1, 1, 1);
  std::vector<float> k = values(rows * s.key_heads * s.key_dim, -1, 1, 2);
  // Unit q and k, as the layer's L2 norm gives them.
  for (std::vector<float>* x : {&q, &k})
    for (int64_t r = 0; r < rows * s.key_heads; ++r) {
      float* h = x->data() + r * s.key_dim;
      double sum = 0;
      for (int64_t a = 0; a < s.key_dim; ++a) sum += double(h[a]) * h[a];
      for (int64_t a = 0; a < s.key_dim; ++a) h[a] = static_cast<float>(h[a] / std::sqrt(sum));
    }
  const std::vector<float> v = values(rows * s.value_heads * s.value_dim, -1, 1, 3);
  const std::vector<float> g = values(rows * s.value_heads, -0.5f, -0.01f, 4);
  const std::vector<float> beta = values(rows * s.value_heads, 0.05f, 0.95f, 5);
  const std::vector<float> dout = values(rows * s.value_heads * s.value_dim, -1, 1, 6);
  std::vector<float> out(dout.size()), states(s.saved_state_elements()), dq(q.size()), dk(k.size()),
      dv(v.size()), dg(g.size()), dbeta(beta.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.key_dim));
  const auto forward = [&] {
    kernels::gated_delta_chunked_forward<float>(s, scale, q.data(), k.data(), v.data(), g.data(),
                                                beta.data(), nullptr, states.data(), out.data());
  };
  forward();
  const auto call = [&] {
    if (!backward) return forward();
    kernels::gated_delta_chunked_backward<float>(
        s, scale, q.data(), k.data(), v.data(), g.data(), beta.data(), states.data(), dout.data(),
        nullptr, dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), nullptr);
  };
  call();
  report_gflops(state, layer_flops(s, backward) / timed_median(state, call) / 1e9, peak, bf16);
}

void layer(benchmark::State& state, const kernels::Peak& peak) {
  const kernels::GatedDeltaShape s = layer_shape();
  // One Gated DeltaNet layer as train --arch qwen35 builds it, with the layer shape's heads.
  ModelConfig base;
  base.vocab = 256;
  base.d_model = 2048;
  base.n_layers = 1;
  base.n_heads = 16;
  base.head_dim = 128;
  base.ffn = 16;
  base.ctx = s.length;
  base.tie_embeddings = true;
  ModelConfig c = with_architecture(base, *find_architecture("qwen35"));
  c.linear_key_heads = s.key_heads;
  c.linear_value_heads = s.value_heads;
  ModelOptions options;
  options.compute_dtype = DType::BF16;
  DecoderModel model(c, options);
  model.init_weights(1);
  Tensor inputs = Tensor::empty(Shape{1, s.length}, DType::I32, MemoryCategory::Workspace);
  Tensor targets = Tensor::empty(Shape{1, s.length}, DType::I32, MemoryCategory::Workspace);
  for (int64_t t = 0; t < s.length; ++t) {
    inputs.i32()[t] = static_cast<int32_t>((t * 37) % c.vocab);
    targets.i32()[t] = static_cast<int32_t>((t * 37 + 11) % c.vocab);
  }
  const auto call = [&] {
    model.parameters().zero_grad();
    backward(model.loss(inputs, targets));
  };
  call();
  // The projections' weights (q, k, v, z, beta, alpha in; out), each position's 2 FLOPs a weight
  // forward and 4 backward; the delta rule's forward and backward.
  const double LQ = static_cast<double>(c.linear_qk_dim()),
               LV = static_cast<double>(c.linear_v_dim());
  const double weights = static_cast<double>(c.d_model) *
                         (2 * LQ + 3 * LV + 2 * static_cast<double>(c.linear_value_heads));
  const double flops =
      6.0 * weights * static_cast<double>(s.length) + layer_flops(s, false) + layer_flops(s, true);
  report_gflops(state, flops / timed_median(state, call) / 1e9, peak, true);
}

}  // namespace
}  // namespace cputrain::bench

int main(int argc, char** argv) {
  using namespace cputrain::bench;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const cputrain::kernels::Peak peak = cputrain::kernels::measure_peak(2'000'000, 10);
  for (const bool bf16 : {false, true}) {
    const std::string type = bf16 ? "bf16" : "fp32";
    register_timed("deltanet/qwen3.5-2b/forward/" + type,
                   [&peak, bf16](benchmark::State& st) { delta_rule(st, false, bf16, peak); });
    register_timed("deltanet/qwen3.5-2b/backward/" + type,
                   [&peak, bf16](benchmark::State& st) { delta_rule(st, true, bf16, peak); });
  }
  register_timed("deltanet/qwen3.5-2b/layer", [&peak](benchmark::State& st) { layer(st, peak); });
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
