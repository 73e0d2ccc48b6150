// Causal attention in tiles (after FlashAttention-2): 64 queries x 64 keys at a time, online
// softmax in the forward, probabilities recomputed from the saved log-sum-exp in the backward,
// so no (T, T) matrix is ever stored. Written with GCC vector types of 16 floats; the file that
// includes this header picks the ISA by its compile flags (one zmm, or two ymm per vector) and
// RB, the rows of a register block.
//
// Layout inside a tile: the head dimension D is padded with zeros to Dp, a multiple of 16, so
// every row is whole vectors. Queries are pre-multiplied by 1/sqrt(D).
//
// Grouped-query attention: H query heads, KVH key/value heads, query head h reading key/value
// head h / (H / KVH); q, out, dq, dout rows of H * D floats, k, v, dk, dv rows of KVH * D.
//
// Forward: one task per (batch, query head), which packs its key/value head's K^T and V (unless
// the thread's previous task left them packed), then runs its query tiles. Backward: one task per
// (batch, key/value head), which packs K, K^T and V^T once, then runs the group's query heads g
// in order; per query head, key tiles outer and query tiles inner. dK and dV of a key tile and
// dQ of a query head accumulate in a fixed order, and a key/value head's dk and dv receive its
// query heads' contributions in the order g = 0, 1, ..: results do not depend on the thread
// count.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/attention/attention_isa.h"
#include "kernels/cpu/vec16.h"

namespace cputrain::kernels::detail {
namespace {

using vec::kLanes;
using vec::load;
using vec::splat;
using vec::store;
using vec::vf;
constexpr int64_t kTile = kAttentionTile;  // a multiple of kLanes

#if !defined(__AVX512F__)
// tile_product (below) on AVX2, in intrinsics: blocks of 6 rows x 16 columns, 12 accumulators,
// two vectors of B and a broadcast of A in the 16 ymm registers, where the generic blocks of
// 16-float vectors hold one row. Each element sums its products in the order of k, one fused
// multiply-add each, as the generic version does.
template <bool TA>
void tile_product_avx2(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                       int64_t ldb, int64_t M, int64_t N, int64_t K, bool accumulate) {
  const int64_t step_m = TA ? 1 : lda, step_k = TA ? lda : 1;
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    int64_t m0 = 0;
    auto block = [&]<int R>(std::integral_constant<int, R>) {
      __m256 lo[R], hi[R];
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        float* c = C + (m0 + r) * ldc + n0;
        lo[r] = accumulate ? _mm256_loadu_ps(c) : _mm256_setzero_ps();
        hi[r] = accumulate ? _mm256_loadu_ps(c + 8) : _mm256_setzero_ps();
      }
      const float* a = A + m0 * step_m;
      const float* b = B + n0;
      for (int64_t k = 0; k < K; ++k, a += step_k, b += ldb) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          const __m256 x = _mm256_broadcast_ss(a + r * step_m);
          lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
          hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
        }
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        float* c = C + (m0 + r) * ldc + n0;
        _mm256_storeu_ps(c, lo[r]);
        _mm256_storeu_ps(c + 8, hi[r]);
      }
    };
    for (; m0 + 6 <= M; m0 += 6) block(std::integral_constant<int, 6>{});
    // The last M % 6 rows: one block of their count.
    [&]<int... R>(std::integer_sequence<int, R...>) {
      ((M - m0 == R + 1 ? block(std::integral_constant<int, R + 1>{}) : void()), ...);
    }
    (std::make_integer_sequence<int, 5>{});
  }
}
#endif

// C[m, 0:N] (+)= sum_k op(A)[m, k] B[k, 0:N] for m < M, N a multiple of kLanes, where op(A) is
// A (M x K, row stride lda) or, with TA, the transpose of A (K x M).
template <int RB, bool TA>
void tile_product(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                  int64_t M, int64_t N, int64_t K, bool accumulate) {
#if !defined(__AVX512F__)
  tile_product_avx2<TA>(C, ldc, A, lda, B, ldb, M, N, K, accumulate);  // its own blocks, not RB
#else
  auto a_at = [A, lda](int64_t m, int64_t k) { return TA ? A[k * lda + m] : A[m * lda + k]; };
  for (int64_t n0 = 0; n0 < N; n0 += 4 * kLanes) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (N - n0) / kLanes));
    int64_t m0 = 0;
    auto block = [&]<int R>(std::integral_constant<int, R>) {
      vf acc[R][4];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
          acc[r][v] = accumulate && v < nv ? load(C + (m0 + r) * ldc + n0 + v * kLanes) : vf{};
      if (nv == 4) {
        for (int64_t k = 0; k < K; ++k) {
          const float* b = B + k * ldb + n0;
          const vf b0 = load(b), b1 = load(b + 16), b2 = load(b + 32), b3 = load(b + 48);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            const vf a = splat(a_at(m0 + r, k));
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
            acc[r][2] += a * b2;
            acc[r][3] += a * b3;
          }
        }
      } else {
        for (int64_t k = 0; k < K; ++k) {
          const float* b = B + k * ldb + n0;
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            const vf a = splat(a_at(m0 + r, k));
            for (int v = 0; v < nv; ++v) acc[r][v] += a * load(b + v * kLanes);
          }
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < nv; ++v) store(C + (m0 + r) * ldc + n0 + v * kLanes, acc[r][v]);
    };
    for (; m0 + RB <= M; m0 += RB) block(std::integral_constant<int, RB>{});
    // The last M % RB rows: one block of their count.
    [&]<int... R>(std::integer_sequence<int, R...>) {
      ((M - m0 == R + 1 ? block(std::integral_constant<int, R + 1>{}) : void()), ...);
    }
    (std::make_integer_sequence<int, RB - 1>{});
  }
#endif
}

// C (+)= A B and C += A^T B.
template <int RB>
void tile_nn(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
             int64_t M, int64_t N, int64_t K, bool accumulate) {
  tile_product<RB, false>(C, ldc, A, lda, B, ldb, M, N, K, accumulate);
}
template <int RB>
void tile_tn(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
             int64_t M, int64_t N, int64_t K) {
  tile_product<RB, true>(C, ldc, A, lda, B, ldb, M, N, K, true);
}

// Buffers of the calling thread, grown on demand and kept for the next call.
inline float* attention_buffer(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.assign(floats, 0.0f);
  return buffer.data();
}

inline int64_t padded_dim(int64_t D) {
  return (D + kLanes - 1) / kLanes * kLanes;
}

// rows x Dp: dst[r, d] = scale * src[r * stride + d], zero for d >= D.
inline void pack_rows(float* dst, const float* src, int64_t stride, int64_t rows, int64_t D,
                      int64_t Dp, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* out = dst + r * Dp;
    const float* in = src + r * stride;
    for (int64_t d = 0; d < D; ++d) out[d] = in[d] * scale;
    for (int64_t d = D; d < Dp; ++d) out[d] = 0.0f;
  }
}

// Dp x kTile: dst[d, c] = src[c * stride + d] for c < cols, zero elsewhere.
inline void pack_transposed_tile(float* dst, const float* src, int64_t stride, int64_t cols,
                                 int64_t D, int64_t Dp) {
  std::memset(dst, 0, sizeof(float) * static_cast<size_t>(Dp * kTile));
  for (int64_t c = 0; c < cols; ++c) {
    // The rows are a head's slice of each token's row: fetch the slice 8 rows ahead.
    if (c + 8 < cols)
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(src + (c + 8) * stride + d);
    for (int64_t d = 0; d < D; ++d) dst[d * kTile + c] = src[c * stride + d];
  }
}

// The key columns c of a tile (keys j0 + c, cols of them) query i attends: first <= c < valid,
// keys up to i and, with a window, after i - window.
inline int64_t first_key(int64_t i, int64_t j0, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, i - window + 1 - j0) : 0;
}
inline int64_t valid_keys(int64_t i, int64_t j0, int64_t cols) {
  return std::min(cols, i - j0 + 1);
}

// x, with the lanes whose key column (c + lane) is outside [first, valid) set to `fill`.
inline vf keys_only(vf x, int64_t c, int64_t first, int64_t valid, float fill) {
  if (c >= first && c + kLanes <= valid) return x;
  alignas(64) static constexpr float kLaneIndex[kLanes] = {0, 1, 2,  3,  4,  5,  6,  7,
                                                           8, 9, 10, 11, 12, 13, 14, 15};
  const vf column = load(kLaneIndex) + static_cast<float>(c);
  x = vec::select_less(column, splat(static_cast<float>(valid)), x, splat(fill));
  return vec::select_less(column, splat(static_cast<float>(first)), splat(fill), x);
}

// The forward's online softmax over one tile of scores S (rows x kTile) of query rows i0.. and
// key columns j0.. (cols of them): each row's running maximum m and sum l move to this tile,
// its scores become exp(S - m) (zero where the key is past the query or the sequence, or before
// a window), and its output row in O (Dp wide) is scaled by exp(m_old - m). One pass for the
// maximum and one for the exponentials and their sum, each over the row's vectors with keys.
inline void online_softmax_tile(float* S, float* O, float* m, float* l, int64_t rows, int64_t cols,
                                int64_t i0, int64_t j0, int64_t window, int64_t Dp) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = S + r * kTile;
    const int64_t valid = valid_keys(i0 + r, j0, cols);
    const int64_t first = first_key(i0 + r, j0, window);
    // The vectors holding keys: [begin, end).
    const int64_t begin = first / kLanes * kLanes;
    const int64_t end = valid <= first ? begin : (valid + kLanes - 1) / kLanes * kLanes;
    vf top = splat(kNegInf);
    for (int64_t c = begin; c < end; c += kLanes)
      top = vec::max(top, keys_only(load(s + c), c, first, valid, kNegInf));
    const float mx = std::max(m[r], vec::hmax(top));
    // m[r] = -inf on the first tile: alpha ~ 0; a row with no key yet (a window's first tiles)
    // keeps its zeros.
    const float alpha = mx == kNegInf ? 1.0f : vec::exp(m[r] - mx);
    m[r] = mx;
    const vf shift = splat(mx);
    vf sum{};
    for (int64_t c = 0; c < kTile; c += kLanes) {
      if (c < begin || c >= end) {
        store(s + c, vf{});
        continue;
      }
      const vf p = keys_only(vec::exp(load(s + c) - shift), c, first, valid, 0.0f);
      sum += p;
      store(s + c, p);
    }
    l[r] = l[r] * alpha + vec::hsum(sum);
    if (alpha != 1.0f) {
      float* o = O + r * Dp;
      const vf a = splat(alpha);
      for (int64_t d = 0; d < Dp; d += kLanes) store(o + d, load(o + d) * a);
    }
  }
}

// Replaces the scores S (rows x kTile) of query rows i0.. and key columns j0.. by
// exp(S - shift[r]), zero where the key is past the query or past the sequence (cols), or with a
// window before it.
inline void exp_scores(float* S, const float* shift, int64_t rows, int64_t cols, int64_t i0,
                       int64_t j0, int64_t window = 0) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = S + r * kTile;
    const vf m = splat(shift[r]);
    const int64_t valid = valid_keys(i0 + r, j0, cols);
    const int64_t first = first_key(i0 + r, j0, window);
    for (int64_t c = 0; c < kTile; c += kLanes) {
      if (c >= valid || c + kLanes <= first) {
        store(s + c, vf{});
        continue;
      }
      vf p = vec::exp(load(s + c) - m);
      if (c + kLanes > valid) {
        for (int64_t l = valid - c; l < kLanes; ++l) p[l] = 0.0f;
      }
      for (int64_t l = 0; l < first - c; ++l) p[l] = 0.0f;
      store(s + c, p);
    }
  }
}

// Soft-capping of a tile's scores S (rows x kTile): t = tanh(S / cap) into Tt (where not null),
// S = cap * t.
inline void softcap_scores(float* S, float* Tt, int64_t rows, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kTile; c += kLanes) {
      const vf t = vec::tanh(load(S + r * kTile + c) * inv);
      if (Tt != nullptr) store(Tt + r * kTile + c, t);
      store(S + r * kTile + c, t * cap);
    }
}

template <int RB>
void attention_forward_tiled(float* out, float* lse, const float* q, const float* k, const float* v,
                             int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                             const AttentionOptions& opt) {
  const float scale = attention_score_scale(opt, D);
  const int64_t window = opt.window;
  const int64_t row = H * D, kv_row = KVH * D, group = H / KVH, Dp = padded_dim(D);
  const int64_t Tp = (T + kTile - 1) / kTile * kTile;
#pragma omp parallel
  {
    // Whole key/value head: K^T per key tile and V; per query tile: Q, O, scores, statistics.
    float* Kt = attention_buffer(
        static_cast<size_t>(2 * Tp * Dp + 2 * kTile * Dp + kTile * kTile + 2 * kTile));
    float* V = Kt + Tp * Dp;
    float* Q = V + Tp * Dp;
    float* O = Q + kTile * Dp;
    float* S = O + kTile * Dp;
    float* m = S + kTile * kTile;
    float* l = m + kTile;
    int64_t packed = -1;  // b * KVH + the key/value head whose K^T and V are in Kt and V
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H, bkv = b * KVH + h / group;
      const int64_t off = b * T * row + h * D;
      const int64_t kv_off = b * T * kv_row + h / group * D;
      if (bkv != packed) {
        for (int64_t j0 = 0; j0 < T; j0 += kTile)
          pack_transposed_tile(Kt + j0 * Dp, k + kv_off + j0 * kv_row, kv_row,
                               std::min(kTile, T - j0), D, Dp);
        pack_rows(V, v + kv_off, kv_row, T, D, Dp, 1.0f);
        packed = bkv;
      }
      for (int64_t i0 = 0; i0 < T; i0 += kTile) {
        const int64_t rows = std::min(kTile, T - i0);
        pack_rows(Q, q + off + i0 * row, row, rows, D, Dp, scale);
        std::fill(O, O + rows * Dp, 0.0f);
        std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
        std::fill(l, l + rows, 0.0f);
        for (int64_t j0 = window_first_key_tile(i0, window); j0 <= i0; j0 += kTile) {
          const int64_t cols = std::min(kTile, T - j0);
          tile_nn<RB>(S, kTile, Q, Dp, Kt + j0 * Dp, kTile, rows, kTile, Dp, false);
          if (opt.softcap > 0.0f) softcap_scores(S, nullptr, rows, opt.softcap);
          online_softmax_tile(S, O, m, l, rows, cols, i0, j0, window, Dp);
          tile_nn<RB>(O, Dp, S, kTile, V + j0 * Dp, Dp, rows, Dp, cols, true);
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = out + off + (i0 + r) * row;
          float mr = m[r], lr = l[r], a = 1.0f;
          if (opt.sinks) {  // the sink joins the sum as one more key, of value zero
            const float sink = opt.sinks[h], top = std::max(mr, sink);
            a = std::exp(mr - top);
            lr = lr * a + std::exp(sink - top);
            mr = top;
          }
          const float inv = a / lr;
          for (int64_t d = 0; d < D; ++d) dst[d] = O[r * Dp + d] * inv;
          lse[bh * T + i0 + r] = mr + std::log(lr);
        }
      }
    }
  }
}

template <int RB>
void attention_backward_tiled(float* dq, float* dk, float* dv, const float* dout, const float* q,
                              const float* k, const float* v, const float* out, const float* lse,
                              int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                              bool accumulate, const AttentionOptions& opt) {
  const float scale = attention_score_scale(opt, D);
  const int64_t window = opt.window;
  const bool capped = opt.softcap > 0.0f;
  const int64_t row = H * D, kv_row = KVH * D, group = H / KVH, Dp = padded_dim(D);
  const int64_t Tp = (T + kTile - 1) / kTile * kTile;
#pragma omp parallel
  {
    // Whole key/value head: keys, and K^T and V^T per key tile; whole query head: scaled
    // queries, output gradients, dQ; per key tile: dK, dV; per tile pair: probabilities and
    // their gradients, and soft-capping's tanh.
    float* K = attention_buffer(
        static_cast<size_t>(6 * Tp * Dp + 2 * kTile * Dp + 3 * kTile * kTile + Tp));
    float* Kt = K + Tp * Dp;
    float* Vt = Kt + Tp * Dp;
    float* Qs = Vt + Tp * Dp;
    float* G = Qs + Tp * Dp;
    float* dQ = G + Tp * Dp;
    float* dK = dQ + Tp * Dp;
    float* dV = dK + kTile * Dp;
    float* P = dV + kTile * Dp;
    float* dS = P + kTile * kTile;
    float* Di = dS + kTile * kTile;
    float* Tt = Di + Tp;
#pragma omp for schedule(dynamic, 1)
    for (int64_t bkv = 0; bkv < B * KVH; ++bkv) {
      const int64_t b = bkv / KVH, kh = bkv % KVH;
      const int64_t kv_off = b * T * kv_row + kh * D;
      pack_rows(K, k + kv_off, kv_row, T, D, Dp, 1.0f);
      for (int64_t j0 = 0; j0 < T; j0 += kTile) {
        const int64_t cols = std::min(kTile, T - j0);
        pack_transposed_tile(Kt + j0 * Dp, k + kv_off + j0 * kv_row, kv_row, cols, D, Dp);
        pack_transposed_tile(Vt + j0 * Dp, v + kv_off + j0 * kv_row, kv_row, cols, D, Dp);
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kh * group + g, bh = b * H + h;
        const int64_t off = b * T * row + h * D;
        const float* lse_bh = lse + bh * T;
        // dk and dv: the group's first query head writes them (or adds, with accumulate), the
        // others add to that.
        const bool add = accumulate || g > 0;
        pack_rows(Qs, q + off, row, T, D, Dp, scale);
        pack_rows(G, dout + off, row, T, D, Dp, 1.0f);
        std::fill(dQ, dQ + T * Dp, 0.0f);
        // D_i = sum_j P_ij dP_ij = dout_i . out_i, summed in the order tile_nn sums dP_ij, so
        // that where P_ii = 1 (a single key) dS is exactly 0.
        // Eight rows' sums side by side: each its own chain of multiply-adds in the order of d,
        // eight chains in flight where one row at a time waits on each one's latency.
        int64_t i = 0;
        for (; i + 8 <= T; i += 8) {
          float s[8] = {};
          for (int64_t d = 0; d < D; ++d)
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u)
              s[u] = std::fma(G[(i + u) * Dp + d], out[off + (i + u) * row + d], s[u]);
          for (int u = 0; u < 8; ++u) Di[i + u] = s[u];
        }
        for (; i < T; ++i) {
          const float* gi = G + i * Dp;
          const float* o = out + off + i * row;
          float s = 0.0f;
          for (int64_t d = 0; d < D; ++d) s = std::fma(gi[d], o[d], s);
          Di[i] = s;
        }
        for (int64_t j0 = 0; j0 < T; j0 += kTile) {
          const int64_t cols = std::min(kTile, T - j0);
          std::fill(dK, dK + kTile * Dp, 0.0f);
          std::fill(dV, dV + kTile * Dp, 0.0f);
          // Query tiles from the key tile's first to the last whose window reaches its last key.
          for (int64_t i0 = j0; i0 < window_query_end(j0, cols, T, window); i0 += kTile) {
            const int64_t rows = std::min(kTile, T - i0);
            tile_nn<RB>(P, kTile, Qs + i0 * Dp, Dp, Kt + j0 * Dp, kTile, rows, kTile, Dp, false);
            if (capped) softcap_scores(P, Tt, rows, opt.softcap);
            exp_scores(P, lse_bh + i0, rows, cols, i0, j0, window);
            tile_tn<RB>(dV, Dp, P, kTile, G + i0 * Dp, Dp, cols, Dp, rows);  // dV += P^T dO
            // dP = dO V^T
            tile_nn<RB>(dS, kTile, G + i0 * Dp, Dp, Vt + j0 * Dp, kTile, rows, kTile, Dp, false);
            for (int64_t r = 0; r < rows; ++r) {  // dS = P (dP - D_i)
              const float di = Di[i0 + r];
              float* ds = dS + r * kTile;
              const float* p = P + r * kTile;
#pragma omp simd
              for (int64_t c = 0; c < kTile; ++c) ds[c] = p[c] * (ds[c] - di);
              if (capped) {  // through cap * tanh(s / cap): times 1 - tanh^2
                const float* t = Tt + r * kTile;
#pragma omp simd
                for (int64_t c = 0; c < kTile; ++c) ds[c] *= 1.0f - t[c] * t[c];
              }
            }
            tile_tn<RB>(dK, Dp, dS, kTile, Qs + i0 * Dp, Dp, cols, Dp, rows);  // dK += dS^T Qs
            tile_nn<RB>(dQ + i0 * Dp, Dp, dS, kTile, K + j0 * Dp, Dp, rows, Dp, cols, true);
          }
          for (int64_t c = 0; c < cols; ++c) {
            float* gk = dk + kv_off + (j0 + c) * kv_row;
            float* gv = dv + kv_off + (j0 + c) * kv_row;
            for (int64_t d = 0; d < D; ++d) {
              gk[d] = (add ? gk[d] : 0.0f) + dK[c * Dp + d];
              gv[d] = (add ? gv[d] : 0.0f) + dV[c * Dp + d];
            }
          }
        }
        for (int64_t i = 0; i < T; ++i) {  // the scores were scaled: dq = scale * dS K
          float* gq = dq + off + i * row;
          for (int64_t d = 0; d < D; ++d)
            gq[d] = (accumulate ? gq[d] : 0.0f) + scale * dQ[i * Dp + d];
        }
      }
    }
  }
}

}  // namespace
}  // namespace cputrain::kernels::detail
