#include "kernels/attention/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/attention/attention_isa.h"
#include "kernels/cpu/dispatch.h"

namespace cputrain::kernels {

namespace {
// The heads' contract of every entry point: KVH key/value heads, each shared by H / KVH query
// heads.
void check_heads(const char* fn, int64_t H, int64_t KVH) {
  if (KVH <= 0 || H % KVH != 0)
    throw std::invalid_argument(std::string(fn) + ": H = " + std::to_string(H) +
                                " query heads are not a multiple of KVH = " + std::to_string(KVH) +
                                " key/value heads");
}
}  // namespace

namespace {

// The implementations, fastest first (kernels/cpu/dispatch.h).
using AttentionRow = KernelChoice<const AttentionKernels& (*)()>;
const AttentionRow kAttention[] = {
    {{"amx", Isa::Amx}, attention_kernels_amx},
    {{"avx512_bf16", Isa::Avx512Bf16}, attention_kernels_avx512_bf16},
    {{"avx512", Isa::Avx512}, attention_kernels_avx512},
    {{"avx2", Isa::Avx2}, attention_kernels_avx2},
};

const AttentionRow& chosen() {
  static const AttentionRow& row = choose_kernel("attention", kAttention);
  return row;
}

const AttentionKernels& kernels() {
  static const AttentionKernels& k = chosen().entry();
  return k;
}

}  // namespace

std::string_view attention_kernel() {
  return chosen().row.name;
}

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                       const AttentionOptions& options) {
  check_heads("attention_forward", H, KVH);
  kernels().forward(out, lse, q, k, v, B, T, H, KVH, D, options);
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, bool accumulate,
                        const AttentionOptions& options) {
  check_heads("attention_backward", H, KVH);
  kernels().backward(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D, accumulate, options);
}

bool attention_bf16_native() {
  return kernels().forward_bf16 != nullptr;
}

void attention_forward_bf16(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                            const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t D, const AttentionOptions& options) {
  if (!attention_bf16_native())
    throw std::logic_error("attention_forward_bf16: the " + std::string(attention_kernel()) +
                           " attention has no bf16 instructions");
  check_heads("attention_forward_bf16", H, KVH);
  kernels().forward_bf16(out, lse, q, k, v, B, T, H, KVH, D, options);
}

void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                             const uint16_t* k, const uint16_t* v, const uint16_t* out,
                             const float* lse, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t D, bool accumulate, const AttentionOptions& options) {
  if (!attention_bf16_native())
    throw std::logic_error("attention_backward_bf16: the " + std::string(attention_kernel()) +
                           " attention has no bf16 instructions");
  check_heads("attention_backward_bf16", H, KVH);
  kernels().backward_bf16(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D, accumulate,
                          options);
}

void attention_decode(float* out, const float* q, const float* keys, const float* values, int64_t n,
                      int64_t m, int64_t H, int64_t KVH, int64_t D,
                      const AttentionOptions& options) {
  check_heads("attention_decode", H, KVH);
  const float scale = attention_score_scale(options, D);
  const float cap = options.softcap;
  const int64_t row = H * D, kv_row = KVH * D, group = H / KVH;
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(n + m));
#pragma omp for collapse(2) schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const float* qi = q + i * row + h * D;
        const int64_t kv = h / group * D;  // the query head's key/value head, in a row
        const int64_t len = n + i + 1;
        const int64_t first = options.window > 0 ? std::max<int64_t>(0, len - options.window) : 0;
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t j = first; j < len; ++j) {
          const float* kj = keys + j * kv_row + kv;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qi[d] * kj[d];
          p[j] = s * scale;
          if (cap > 0.0f) p[j] = cap * std::tanh(p[j] / cap);
          max = std::max(max, p[j]);
        }
        if (options.sinks) max = std::max(max, options.sinks[h]);
        float sum = options.sinks ? std::exp(options.sinks[h] - max) : 0.0f;
        for (int64_t j = first; j < len; ++j) {
          p[j] = std::exp(p[j] - max);
          sum += p[j];
        }
        float* oi = out + i * row + h * D;
        std::fill(oi, oi + D, 0.0f);
        for (int64_t j = first; j < len; ++j) {
          const float* vj = values + j * kv_row + kv;
          const float w = p[j] / sum;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oi[d] += w * vj[d];
        }
      }
    }
  }
}

}  // namespace cputrain::kernels
