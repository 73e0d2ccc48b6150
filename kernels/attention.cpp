#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/attention_isa.h"
#include "kernels/cpu_features.h"
#include "kernels/gemm.h"

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

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  check_heads("attention_forward", H, KVH);
  if (cpu_features().avx512) return attention_forward_avx512(out, lse, q, k, v, B, T, H, KVH, D);
  attention_forward_avx2(out, lse, q, k, v, B, T, H, KVH, D);
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, bool accumulate) {
  check_heads("attention_backward", H, KVH);
  if (cpu_features().avx512)
    return attention_backward_avx512(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D,
                                     accumulate);
  attention_backward_avx2(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D, accumulate);
}

bool attention_bf16_native() {
  static const bool allowed = [] {
    const char* env = std::getenv("CPUTRAIN_ATTENTION");
    if (env == nullptr || *env == '\0' || std::string_view(env) == "native") return true;
    if (std::string_view(env) == "fp32") return false;
    throw std::invalid_argument(std::string("CPUTRAIN_ATTENTION=") + env +
                                ": not an attention path (native or fp32)");
  }();
  const GemmBackend gemm = gemm_backend();
  return allowed && cpu_features().avx512_bf16 &&
         (gemm == GemmBackend::Avx512 || gemm == GemmBackend::Amx);
}

// The bf16 attention's products on AMX tiles where the GEMM runs on AMX (selectable only where
// the CPU has AMX and the AMX GEMM passed its self-test); CPUTRAIN_GEMM=avx512 keeps both on
// vdpbf16ps.
namespace {
bool attention_amx() {
  return gemm_backend() == GemmBackend::Amx;
}
}  // namespace

void attention_forward_bf16(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                            const uint16_t* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t D) {
  if (!attention_bf16_native())
    throw std::logic_error("attention_forward_bf16: needs AVX-512 BF16 and the avx512/amx GEMM");
  check_heads("attention_forward_bf16", H, KVH);
  attention_forward_bf16_avx512(out, lse, q, k, v, B, T, H, KVH, D, attention_amx());
}

void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const uint16_t* q,
                             const uint16_t* k, const uint16_t* v, const uint16_t* out,
                             const float* lse, int64_t B, int64_t T, int64_t H, int64_t KVH,
                             int64_t D, bool accumulate) {
  if (!attention_bf16_native())
    throw std::logic_error("attention_backward_bf16: needs AVX-512 BF16 and the avx512/amx GEMM");
  check_heads("attention_backward_bf16", H, KVH);
  attention_backward_bf16_avx512(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D, accumulate,
                                 attention_amx());
}

void attention_decode(float* out, const float* q, const float* keys, const float* values, int64_t n,
                      int64_t m, int64_t H, int64_t KVH, int64_t D) {
  check_heads("attention_decode", H, KVH);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
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
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < len; ++j) {
          const float* kj = keys + j * kv_row + kv;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qi[d] * kj[d];
          p[j] = s * scale;
          max = std::max(max, p[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) {
          p[j] = std::exp(p[j] - max);
          sum += p[j];
        }
        float* oi = out + i * row + h * D;
        std::fill(oi, oi + D, 0.0f);
        for (int64_t j = 0; j < len; ++j) {
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
