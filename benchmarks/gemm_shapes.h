// The GEMM shapes of one training micro-batch of a preset: each linear layer type's three
// products and the LM head's. Shared by the GEMM benchmark programs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"
#include "models/model_config.h"

namespace cputrain::bench {

// n values starting a 64-byte cache line, as the engine allocates its tensors
// (engine/core/memory.cpp): the operands of a training step's products start lines, and so do those
// of the benchmarks.
template <class T>
struct Aligned {
  explicit Aligned(size_t n)
      : data(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    if (data == nullptr) throw std::bad_alloc();
  }
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data;
  T* get() const { return data.get(); }
};

struct Shape {
  std::string preset, product;
  kernels::Transpose ta, tb;
  int64_t M, N, K;
  float beta;
  // Where above 0, the product and then a LoRA adapter's update of this rank, C += U op(V)
  // (kernels::gemm_bf16_low_rank): U (M x rank); V (N x rank), transposed, with B transposed (a
  // forward), else (rank x N) (a dX).
  int64_t rank = 0;
};

// For a linear layer Y = X W^T with X (T, in) and W (out, in), T = batch x ctx tokens:
// forward Y = X W^T, input gradient dX = dY W, weight gradient dW += dY^T X.
inline void add_layer(std::vector<Shape>& out, const std::string& preset, const std::string& layer,
                      int64_t T, int64_t in, int64_t outs) {
  using kernels::Transpose;
  out.push_back({preset, layer + "_fwd", Transpose::No, Transpose::Yes, T, outs, in, 0.0f});
  out.push_back({preset, layer + "_dx", Transpose::No, Transpose::No, T, in, outs, 0.0f});
  out.push_back({preset, layer + "_dw", Transpose::Yes, Transpose::No, outs, in, T, 1.0f});
}

// A shape's operands, uniform in [-1, 1) (the same for every implementation), with the bf16
// roundings of A and B, and C zero; stored on cache lines (Aligned).
struct GemmOperands {
  explicit GemmOperands(const Shape& s)
      : a_size(static_cast<size_t>(s.M * s.K)),
        b_size(static_cast<size_t>(s.K * s.N)),
        a(a_size),
        b(b_size),
        c(static_cast<size_t>(s.M * s.N)),
        a16(a_size),
        b16(b_size) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (size_t i = 0; i < a_size; ++i) a.get()[i] = dist(rng);
    for (size_t i = 0; i < b_size; ++i) b.get()[i] = dist(rng);
    std::fill(c.get(), c.get() + s.M * s.N, 0.0f);
    kernels::fp32_to_bf16_array(a16.get(), a.get(), static_cast<int64_t>(a_size));
    kernels::fp32_to_bf16_array(b16.get(), b.get(), static_cast<int64_t>(b_size));
  }
  size_t a_size, b_size;
  Aligned<float> a, b, c;
  Aligned<uint16_t> a16, b16;
};

// The shapes of each named preset, in order.
inline std::vector<Shape> training_shapes(const std::vector<std::string>& presets) {
  std::vector<Shape> shapes;
  for (const std::string& name : presets) {
    const Preset p = *find_preset(name);
    const ModelConfig& c = p.config;
    const int64_t T = p.batch * c.ctx;
    add_layer(shapes, name, "attn", T, c.d_model, c.d_model);  // wq, wk, wv, wo
    add_layer(shapes, name, "ffn_up", T, c.d_model, c.ffn);    // w1, w3
    add_layer(shapes, name, "ffn_down", T, c.ffn, c.d_model);  // w2
    add_layer(shapes, name, "lm_head", T, c.d_model, c.vocab);
  }
  return shapes;
}

}  // namespace cputrain::bench
