#include "kernels/deltanet/gated_delta.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/deltanet/deltanet_isa.h"
#include "kernels/gemm/gemm.h"

namespace cputrain::kernels {
namespace {

// One sequence's view of one value head: where its rows lie.
template <class T>
struct HeadRows {
  const GatedDeltaShape& s;
  int64_t b, hv, hk;
  int64_t qk_at(int64_t t) const { return (b * s.length + t) * s.qk_row() + hk * s.key_dim; }
  int64_t v_at(int64_t t) const { return (b * s.length + t) * s.v_row() + hv * s.value_dim; }
  int64_t gate_at(int64_t t) const { return (b * s.length + t) * s.value_heads + hv; }
  int64_t out_at(int64_t t) const { return gate_at(t) * s.value_dim; }
  // Whether a sequence begins at t (packed rows).
  bool starts(int64_t t) const {
    return s.positions != nullptr && s.positions[b * s.length + t] == 0;
  }
  int64_t state_at(int64_t c) const {
    return ((b * s.value_heads + hv) * (s.chunks() + 1) + c) * s.key_dim * s.value_dim;
  }
};

template <class T>
T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += a x
template <class T>
void axpy(T a, const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// y (cols) = M^T x, M (rows x cols) row-major.
template <class T>
void matvec_t(const T* m, const T* x, T* y, int64_t rows, int64_t cols) {
  std::fill(y, y + cols, T(0));
  for (int64_t r = 0; r < rows; ++r) axpy(x[r], m + r * cols, y, cols);
}

// C (M x N) = op(A) op(B) + beta C, row-major, as gemm_f32: for float Eigen's product, or with
// the shape's bf16_products the bf16 products of deltanet_kernels() where the CPU has them; for
// double a loop. Each thread multiplies its own heads' chunks: Eigen blocks them on that thread's
// stack and the bf16 products pack into the thread's scratch, where the GEMM of gemm.h would grow
// buffers of each calling thread's that outlive the call and that the memory budget, which
// measures the thread that runs a step, does not see.
template <class T>
struct Products;

template <>
struct Products<float> {
  decltype(DeltanetKernels::product_bf16) bf16 = nullptr;
  PairsScratch scratch;

  explicit Products(const GatedDeltaShape& s)
      : bf16(s.bf16_products ? deltanet_kernels().product_bf16 : nullptr) {}
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    if (bf16 != nullptr) return bf16(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc, scratch);
    gemm_f32_eigen(ta ? Transpose::Yes : Transpose::No, tb ? Transpose::Yes : Transpose::No, M, N,
                   K, A, lda, B, ldb, beta, C, ldc);
  }
};

template <>
struct Products<double> {
  explicit Products(const GatedDeltaShape&) {}
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const double* A, int64_t lda,
                  const double* B, int64_t ldb, double beta, double* C, int64_t ldc) const {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double sum = 0;
        for (int64_t p = 0; p < K; ++p)
          sum += (ta ? A[p * lda + i] : A[i * lda + p]) * (tb ? B[j * ldb + p] : B[p * ldb + j]);
        C[i * ldc + j] = sum + (beta != 0 ? beta * C[i * ldc + j] : 0.0);
      }
  }
};

// A chunk's inputs gathered (q scaled) and what its forward pass computes from them and S0, as
// matrices of its n positions.
template <class T>
struct Chunk {
  int64_t n = 0, dk = 0, dv = 0;
  // G: the decay summed from the chunk's start (from a sequence's start where one begins in the
  // chunk); eG: exp(G) for the positions before the chunk's first sequence start, which read S0,
  // 0 after it. seg: each position's sequence, counted from the chunk's first.
  std::vector<T> q, k, v, beta, G, eG;
  std::vector<int64_t> seg;
  std::vector<T> E;         // n x n: exp(G_i - G_j) for j <= i, 0 above
  std::vector<T> kk;        // n x n: k_i.k_j
  std::vector<T> X;         // n x n, strictly lower: beta_i exp(G_i - G_j) k_i.k_j
  std::vector<T> Tinv;      // n x n: (I + X)^-1, lower
  std::vector<T> Ru, Rw;    // beta V (n x dv), beta exp(G) K (n x dk)
  std::vector<T> Ut, W, U;  // T Ru, T Rw, Ut - W S0
  std::vector<T> A;         // n x n, lower with diagonal: exp(G_i - G_j) q_i.k_j
  std::vector<T> Khat;      // n x dk: exp(G_n - G_j) k_j
  Products<T> mm;

  Chunk(const GatedDeltaShape& s, int64_t C, int64_t dk_, int64_t dv_)
      : dk(dk_),
        dv(dv_),
        q(C * dk_),
        k(C * dk_),
        v(C * dv_),
        beta(C),
        G(C),
        eG(C),
        seg(C),
        E(C * C),
        kk(C * C),
        X(C * C),
        Tinv(C * C),
        Ru(C * dv_),
        Rw(C * dk_),
        Ut(C * dv_),
        W(C * dk_),
        U(C * dv_),
        A(C * C),
        Khat(C * dk_),
        mm(s) {}

  void gather(const HeadRows<T>& h, T scale, const T* qp, const T* kp, const T* vp, const T* g,
              const T* bp, int64_t t0, int64_t len) {
    n = len;
    T sum = 0;
    int64_t id = 0;
    bool reads_s0 = true;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      if (h.starts(t)) {
        // A sequence begins: its decays sum from here, and it reads no state before it.
        sum = 0;
        reads_s0 = false;
        if (i > 0) ++id;
      }
      seg[i] = id;
      for (int64_t a = 0; a < dk; ++a) {
        q[i * dk + a] = scale * qp[h.qk_at(t) + a];
        k[i * dk + a] = kp[h.qk_at(t) + a];
      }
      std::copy_n(vp + h.v_at(t), dv, v.data() + i * dv);
      sum += g[h.gate_at(t)];
      G[i] = sum;
      eG[i] = reads_s0 ? std::exp(sum) : T(0);
      beta[i] = bp[h.gate_at(t)];
    }
  }

  // The decays between positions (each exponent once), X, (I + X)^-1, U~, W, U = U~ - W S0, A
  // and K^.
  void solve(const T* S0) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        E[i * n + j] = j <= i && seg[i] == seg[j] ? std::exp(G[i] - G[j]) : T(0);
    mm(false, true, n, n, dk, k.data(), dk, k.data(), dk, T(0), kk.data(), n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        X[i * n + j] = j < i ? beta[i] * E[i * n + j] * kk[i * n + j] : T(0);
    // Row i of (I + X)^-1: e_i less the rows before it weighted by X's row i.
    std::fill_n(Tinv.begin(), n * n, T(0));
    for (int64_t i = 0; i < n; ++i) {
      T* row = &Tinv[i * n];
      row[i] = 1;
      for (int64_t j = 0; j < i; ++j) axpy(-X[i * n + j], &Tinv[j * n], row, j + 1);
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < dv; ++c) Ru[i * dv + c] = beta[i] * v[i * dv + c];
      for (int64_t a = 0; a < dk; ++a) Rw[i * dk + a] = beta[i] * eG[i] * k[i * dk + a];
    }
    mm(false, false, n, dv, n, Tinv.data(), n, Ru.data(), dv, T(0), Ut.data(), dv);
    mm(false, false, n, dk, n, Tinv.data(), n, Rw.data(), dk, T(0), W.data(), dk);
    mm(false, false, n, dv, dk, W.data(), dk, S0, dv, T(0), U.data(), dv);
    for (int64_t x = 0; x < n * dv; ++x) U[x] = Ut[x] - U[x];
    mm(false, true, n, n, dk, q.data(), dk, k.data(), dk, T(0), A.data(), n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) A[i * n + j] = E[i * n + j] * A[i * n + j];
    for (int64_t j = 0; j < n; ++j) {
      const T e = E[(n - 1) * n + j];
      for (int64_t a = 0; a < dk; ++a) Khat[j * dk + a] = e * k[j * dk + a];
    }
  }

  // The chunk's out rows (from `out`, `out_row` apart) and the state after it, from S0.
  void output(T* out, int64_t out_row, const T* S0, T* S_end) {
    mm(false, false, n, dv, dk, q.data(), dk, S0, dv, T(0), out, out_row);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < dv; ++c) out[i * out_row + c] *= eG[i];
    mm(false, false, n, dv, n, A.data(), n, U.data(), dv, T(1), out, out_row);
    const T e = eG[n - 1];
    for (int64_t x = 0; x < dk * dv; ++x) S_end[x] = e * S0[x];
    mm(true, false, dk, dv, n, Khat.data(), dk, U.data(), dv, T(1), S_end, dv);
  }
};

}  // namespace

template <class T>
void gated_delta_recurrent(const GatedDeltaShape& s, T scale, const T* q, const T* k, const T* v,
                           const T* g, const T* beta, T* state, T* out) {
  const int64_t dk = s.key_dim, dv = s.value_dim, S = dk * dv;
#pragma omp parallel
  {
    std::vector<T> local(S), kv(dv), qs(dk);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < s.batch * s.value_heads; ++bh) {
      const int64_t b = bh / s.value_heads, hv = bh % s.value_heads;
      const HeadRows<T> h{s, b, hv, hv % s.key_heads};
      T* st = state != nullptr ? state + bh * S : local.data();
      if (state == nullptr) std::fill(local.begin(), local.end(), T(0));
      for (int64_t t = 0; t < s.length; ++t) {
        if (h.starts(t)) std::fill(st, st + S, T(0));
        const T* kt = k + h.qk_at(t);
        const T* vt = v + h.v_at(t);
        const T decay = std::exp(g[h.gate_at(t)]);
        for (int64_t x = 0; x < S; ++x) st[x] *= decay;
        matvec_t(st, kt, kv.data(), dk, dv);
        const T b_t = beta[h.gate_at(t)];
        for (int64_t c = 0; c < dv; ++c) kv[c] = b_t * (vt[c] - kv[c]);
        for (int64_t a = 0; a < dk; ++a) axpy(kt[a], kv.data(), st + a * dv, dv);
        for (int64_t a = 0; a < dk; ++a) qs[a] = scale * q[h.qk_at(t) + a];
        matvec_t(st, qs.data(), out + h.out_at(t), dk, dv);
      }
    }
  }
}

template <class T>
void gated_delta_chunked_forward(const GatedDeltaShape& s, T scale, const T* q, const T* k,
                                 const T* v, const T* g, const T* beta, const T* initial, T* states,
                                 T* out) {
  const int64_t S = s.key_dim * s.value_dim;
  const int64_t out_row = s.value_heads * s.value_dim;
#pragma omp parallel
  {
    Chunk<T> ch(s, s.chunk, s.key_dim, s.value_dim);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < s.batch * s.value_heads; ++bh) {
      const int64_t b = bh / s.value_heads, hv = bh % s.value_heads;
      const HeadRows<T> h{s, b, hv, hv % s.key_heads};
      T* first = states + h.state_at(0);
      if (initial != nullptr)
        std::copy_n(initial + bh * S, S, first);
      else
        std::fill_n(first, S, T(0));
      for (int64_t c = 0; c < s.chunks(); ++c) {
        const int64_t t0 = c * s.chunk;
        ch.gather(h, scale, q, k, v, g, beta, t0, std::min(s.chunk, s.length - t0));
        const T* S0 = states + h.state_at(c);
        ch.solve(S0);
        ch.output(out + h.out_at(t0), out_row, S0, states + h.state_at(c + 1));
      }
    }
  }
}

template <class T>
void gated_delta_chunked_backward(const GatedDeltaShape& s, T scale, const T* q, const T* k,
                                  const T* v, const T* g, const T* beta, const T* states,
                                  const T* dout, const T* dfinal, T* dq, T* dk, T* dv, T* dg,
                                  T* dbeta, T* dinitial) {
  const int64_t Dk = s.key_dim, Dv = s.value_dim, S = Dk * Dv, C = s.chunk;
  const int64_t per_key = s.value_heads / s.key_heads;
  const int64_t out_row = s.value_heads * Dv;
  // One work item a sequence and key head: it alone writes that key head's dq and dk, summed over
  // the value heads that read it.
#pragma omp parallel
  {
    Chunk<T> ch(s, C, Dk, Dv);
    // The decay's gradient gathers terms that cancel in pairs (each added at one position and
    // taken at another): summed in double, so that its sum over the chunk keeps the float
    // terms' own precision.
    std::vector<double> dG(C);
    std::vector<T> dS(S), dS0(S), tmpS(S), dU(C * Dv), D(C * C), dQ(C * Dk), dK(C * Dk), P(C * Dk),
        Y(C * Dk), eQ(C * Dk), dW(C * Dk), dRU(C * Dv), dRW(C * Dk), dX(C * C), M(C * C), db(C);
#pragma omp for schedule(static)
    for (int64_t bk = 0; bk < s.batch * s.key_heads; ++bk) {
      const int64_t b = bk / s.key_heads, hk = bk % s.key_heads;
      for (int64_t t = 0; t < s.length; ++t) {
        const int64_t at = (b * s.length + t) * s.qk_row() + hk * Dk;
        std::fill_n(dq + at, Dk, T(0));
        std::fill_n(dk + at, Dk, T(0));
      }
      for (int64_t r = 0; r < per_key; ++r) {
        const int64_t hv = hk + r * s.key_heads;
        const int64_t bh = b * s.value_heads + hv;
        const HeadRows<T> h{s, b, hv, hk};
        if (dfinal != nullptr)
          std::copy_n(dfinal + bh * S, S, dS.data());
        else
          std::fill(dS.begin(), dS.end(), T(0));
        for (int64_t c = s.chunks() - 1; c >= 0; --c) {
          const int64_t t0 = c * C, n = std::min(C, s.length - t0);
          ch.gather(h, scale, q, k, v, g, beta, t0, n);
          const T* S0 = states + h.state_at(c);
          ch.solve(S0);
          const T* dO = dout + h.out_at(t0);
          const T* eG = ch.eG.data();
          std::fill_n(dG.begin(), n, 0.0);
          // Through O = exp(G) Q S0 + A U and S_end = exp(G_n) S0 + K^T U:
          // dU = A^T dO + K^ dS; dA = dO U^T.
          ch.mm(true, false, n, Dv, n, ch.A.data(), n, dO, out_row, T(0), dU.data(), Dv);
          ch.mm(false, false, n, Dv, Dk, ch.Khat.data(), Dk, dS.data(), Dv, T(1), dU.data(), Dv);
          ch.mm(false, true, n, n, Dv, dO, out_row, ch.U.data(), Dv, T(0), D.data(), n);
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) {
              T& d = D[i * n + j];
              if (j > i) {
                d = 0;
                continue;
              }
              const T gij = d * ch.A[i * n + j];
              dG[i] += gij;
              dG[j] -= gij;
              d *= ch.E[i * n + j];
            }
          // dQ = D K + exp(G) dO S0^T; dK = D^T Q + exp(G_n - G) U dS^T.
          ch.mm(false, false, n, Dk, n, D.data(), n, ch.k.data(), Dk, T(0), dQ.data(), Dk);
          ch.mm(false, true, n, Dk, Dv, dO, out_row, S0, Dv, T(0), P.data(), Dk);
          ch.mm(true, false, n, Dk, n, D.data(), n, ch.q.data(), Dk, T(0), dK.data(), Dk);
          ch.mm(false, true, n, Dk, Dv, ch.U.data(), Dv, dS.data(), Dv, T(0), Y.data(), Dk);
          for (int64_t i = 0; i < n; ++i) {
            axpy(eG[i], &P[i * Dk], &dQ[i * Dk], Dk);
            dG[i] += eG[i] * dot(&ch.q[i * Dk], &P[i * Dk], Dk);
            const T e = ch.E[(n - 1) * n + i];
            axpy(e, &Y[i * Dk], &dK[i * Dk], Dk);
            const T term = dot(&ch.Khat[i * Dk], &Y[i * Dk], Dk);
            dG[n - 1] += term;
            dG[i] -= term;
            for (int64_t a = 0; a < Dk; ++a) eQ[i * Dk + a] = eG[i] * ch.q[i * Dk + a];
          }
          // dS0 = exp(G_n) dS + (exp(G) Q)^T dO - W^T dU.
          const T en = eG[n - 1];
          dG[n - 1] += en * dot(S0, dS.data(), S);
          for (int64_t x = 0; x < S; ++x) dS0[x] = en * dS[x];
          ch.mm(true, false, Dk, Dv, n, eQ.data(), Dk, dO, out_row, T(1), dS0.data(), Dv);
          ch.mm(true, false, Dk, Dv, n, ch.W.data(), Dk, dU.data(), Dv, T(0), tmpS.data(), Dv);
          for (int64_t x = 0; x < S; ++x) dS0[x] -= tmpS[x];
          // Through U = U~ - W S0 (dW = -dU S0^T) and [U~ W] = (I + X)^-1 [Ru Rw]: the right-hand
          // sides' gradients (I + X)^-T [dU dW], and dX = -[dRu dRw] [U~ W]^T.
          ch.mm(false, true, n, Dk, Dv, dU.data(), Dv, S0, Dv, T(0), dW.data(), Dk);
          for (int64_t x = 0; x < n * Dk; ++x) dW[x] = -dW[x];
          ch.mm(true, false, n, Dv, n, ch.Tinv.data(), n, dU.data(), Dv, T(0), dRU.data(), Dv);
          ch.mm(true, false, n, Dk, n, ch.Tinv.data(), n, dW.data(), Dk, T(0), dRW.data(), Dk);
          ch.mm(false, true, n, n, Dv, dRU.data(), Dv, ch.Ut.data(), Dv, T(0), dX.data(), n);
          ch.mm(false, true, n, n, Dk, dRW.data(), Dk, ch.W.data(), Dk, T(1), dX.data(), n);
          // X_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i), M_ij its gradient by k_i.k_j.
          for (int64_t i = 0; i < n; ++i) {
            db[i] = 0;
            for (int64_t j = 0; j < n; ++j) {
              if (j >= i) {
                M[i * n + j] = 0;
                continue;
              }
              const T dx = -dX[i * n + j];
              const T e = ch.E[i * n + j];
              db[i] += dx * e * ch.kk[i * n + j];
              const T hij = dx * ch.X[i * n + j];
              dG[i] += hij;
              dG[j] -= hij;
              M[i * n + j] = dx * ch.beta[i] * e;
            }
          }
          ch.mm(false, false, n, Dk, n, M.data(), n, ch.k.data(), Dk, T(1), dK.data(), Dk);
          ch.mm(true, false, n, Dk, n, M.data(), n, ch.k.data(), Dk, T(1), dK.data(), Dk);
          // Ru = beta V, Rw = beta exp(G) K.
          for (int64_t i = 0; i < n; ++i) {
            const T* ru = &dRU[i * Dv];
            const T* rw = &dRW[i * Dk];
            const T bi = ch.beta[i];
            T* dvi = dv + h.v_at(t0 + i);
            for (int64_t c2 = 0; c2 < Dv; ++c2) dvi[c2] = bi * ru[c2];
            const T kw = dot(&ch.k[i * Dk], rw, Dk);
            dbeta[h.gate_at(t0 + i)] = db[i] + dot(&ch.v[i * Dv], ru, Dv) + eG[i] * kw;
            axpy(bi * eG[i], rw, &dK[i * Dk], Dk);
            dG[i] += bi * eG[i] * kw;
          }
          // G_i = g_1 + ... + g_i (from its sequence's start): dg_j = sum over i >= j of its
          // sequence of dG_i.
          double sum = 0;
          for (int64_t i = n - 1; i >= 0; --i) {
            sum += dG[i];
            dg[h.gate_at(t0 + i)] = static_cast<T>(sum);
            if (h.starts(t0 + i)) sum = 0;
          }
          for (int64_t i = 0; i < n; ++i) {
            const int64_t at = h.qk_at(t0 + i);
            axpy(scale, &dQ[i * Dk], dq + at, Dk);
            axpy(T(1), &dK[i * Dk], dk + at, Dk);
          }
          dS.swap(dS0);
        }
        if (dinitial != nullptr) std::copy_n(dS.data(), S, dinitial + bh * S);
      }
    }
  }
}

#define CPUTRAIN_GATED_DELTA(T)                                                                   \
  template void gated_delta_recurrent<T>(const GatedDeltaShape&, T, const T*, const T*, const T*, \
                                         const T*, const T*, T*, T*);                             \
  template void gated_delta_chunked_forward<T>(const GatedDeltaShape&, T, const T*, const T*,     \
                                               const T*, const T*, const T*, const T*, T*, T*);   \
  template void gated_delta_chunked_backward<T>(const GatedDeltaShape&, T, const T*, const T*,    \
                                                const T*, const T*, const T*, const T*, const T*, \
                                                const T*, T*, T*, T*, T*, T*, T*);
CPUTRAIN_GATED_DELTA(float)
CPUTRAIN_GATED_DELTA(double)
#undef CPUTRAIN_GATED_DELTA

}  // namespace cputrain::kernels
