#include "kernels/deltanet/gated_delta.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

// y (rows) = M (rows x cols) x, M row-major.
template <class T>
void matvec(const T* m, const T* x, T* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) y[r] = dot(m + r * cols, x, cols);
}

// y (cols) = M^T x, M (rows x cols) row-major.
template <class T>
void matvec_t(const T* m, const T* x, T* y, int64_t rows, int64_t cols) {
  std::fill(y, y + cols, T(0));
  for (int64_t r = 0; r < rows; ++r) axpy(x[r], m + r * cols, y, cols);
}

// A chunk's inputs gathered (q scaled) and what its forward pass computes from them and S0.
template <class T>
struct Chunk {
  int64_t n = 0, dk = 0, dv = 0;
  std::vector<T> q, k, v, beta, G;  // G: the decay summed from the chunk's start
  std::vector<T> X;                 // n x n, strictly lower: beta_i exp(G_i - G_j) k_i.k_j
  std::vector<T> kk;                // n x n, strictly lower: k_i.k_j
  std::vector<T> Ut, W, U;          // n x dv, n x dk, n x dv
  std::vector<T> A;                 // n x n, lower with diagonal: exp(G_i - G_j) q_i.k_j
  std::vector<T> tmp;               // dk or dv

  Chunk(int64_t chunk, int64_t dk_, int64_t dv_)
      : dk(dk_),
        dv(dv_),
        q(chunk * dk_),
        k(chunk * dk_),
        v(chunk * dv_),
        beta(chunk),
        G(chunk),
        X(chunk * chunk),
        kk(chunk * chunk),
        Ut(chunk * dv_),
        W(chunk * dk_),
        U(chunk * dv_),
        A(chunk * chunk),
        tmp(std::max(dk_, dv_)) {}

  void gather(const HeadRows<T>& h, T scale, const T* qp, const T* kp, const T* vp, const T* g,
              const T* bp, int64_t t0, int64_t len) {
    n = len;
    T sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      for (int64_t a = 0; a < dk; ++a) {
        q[i * dk + a] = scale * qp[h.qk_at(t) + a];
        k[i * dk + a] = kp[h.qk_at(t) + a];
      }
      std::copy_n(vp + h.v_at(t), dv, v.data() + i * dv);
      sum += g[h.gate_at(t)];
      G[i] = sum;
      beta[i] = bp[h.gate_at(t)];
    }
  }

  // X, U~, W, U = U~ - W S0 and A.
  void solve(const T* S0) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < i; ++j) {
        kk[i * n + j] = dot(&k[i * dk], &k[j * dk], dk);
        X[i * n + j] = beta[i] * std::exp(G[i] - G[j]) * kk[i * n + j];
      }
    for (int64_t i = 0; i < n; ++i) {
      T* ut = &Ut[i * dv];
      T* w = &W[i * dk];
      for (int64_t c = 0; c < dv; ++c) ut[c] = beta[i] * v[i * dv + c];
      const T e = beta[i] * std::exp(G[i]);
      for (int64_t a = 0; a < dk; ++a) w[a] = e * k[i * dk + a];
      for (int64_t j = 0; j < i; ++j) {
        axpy(-X[i * n + j], &Ut[j * dv], ut, dv);
        axpy(-X[i * n + j], &W[j * dk], w, dk);
      }
      T* u = &U[i * dv];
      matvec_t(S0, w, u, dk, dv);
      for (int64_t c = 0; c < dv; ++c) u[c] = ut[c] - u[c];
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j)
        A[i * n + j] = std::exp(G[i] - G[j]) * dot(&q[i * dk], &k[j * dk], dk);
  }

  // out rows (n x dv, with out_at) and the state after the chunk from S0.
  void output(const HeadRows<T>& h, int64_t t0, const T* S0, T* out, T* S_end) {
    for (int64_t i = 0; i < n; ++i) {
      T* o = out + h.out_at(t0 + i);
      matvec_t(S0, &q[i * dk], o, dk, dv);
      const T e = std::exp(G[i]);
      for (int64_t c = 0; c < dv; ++c) o[c] *= e;
      for (int64_t j = 0; j <= i; ++j) axpy(A[i * n + j], &U[j * dv], o, dv);
    }
    const T last = G[n - 1];
    const T e = std::exp(last);
    for (int64_t x = 0; x < dk * dv; ++x) S_end[x] = e * S0[x];
    for (int64_t j = 0; j < n; ++j) {
      const T ej = std::exp(last - G[j]);
      for (int64_t a = 0; a < dk; ++a) axpy(ej * k[j * dk + a], &U[j * dv], S_end + a * dv, dv);
    }
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
#pragma omp parallel
  {
    Chunk<T> ch(s.chunk, s.key_dim, s.value_dim);
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
        ch.output(h, t0, S0, out, states + h.state_at(c + 1));
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
  // One work item a sequence and key head: it alone writes that key head's dq and dk, summed over
  // the value heads that read it.
#pragma omp parallel
  {
    Chunk<T> ch(C, Dk, Dv);
    std::vector<T> dS(S), dS0(S), dU(C * Dv), dA(C * C), dQ(C * Dk), dK(C * Dk), dG(C), dRU(C * Dv),
        dRW(C * Dk), dX(C * C), s0do(Dk), sdu(Dk), kds(Dv);
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
          const T* G = ch.G.data();
          const T Gn = G[n - 1];
          std::fill_n(dQ.begin(), n * Dk, T(0));
          std::fill_n(dK.begin(), n * Dk, T(0));
          std::fill_n(dG.begin(), n, T(0));
          // Through O = exp(G) Q S0 + A U and S_end = exp(G_n) S0 + sum_j exp(G_n - G_j) k_j u_j^T.
          for (int64_t j = 0; j < n; ++j) {
            T* du = &dU[j * Dv];
            const T ej = std::exp(Gn - G[j]);
            matvec_t(dS.data(), &ch.k[j * Dk], kds.data(), Dk, Dv);
            for (int64_t c2 = 0; c2 < Dv; ++c2) du[c2] = ej * kds[c2];
            for (int64_t i = j; i < n; ++i) axpy(ch.A[i * n + j], dout + h.out_at(t0 + i), du, Dv);
            // dK_j from S_end, and the decay's share.
            matvec(dS.data(), &ch.U[j * Dv], sdu.data(), Dk, Dv);
            axpy(ej, sdu.data(), &dK[j * Dk], Dk);
            const T term = ej * dot(&ch.k[j * Dk], sdu.data(), Dk);
            dG[n - 1] += term;
            dG[j] -= term;
          }
          for (int64_t i = 0; i < n; ++i) {
            const T* doi = dout + h.out_at(t0 + i);
            for (int64_t j = 0; j <= i; ++j) {
              const T da = dot(doi, &ch.U[j * Dv], Dv);
              const T e = std::exp(G[i] - G[j]);
              axpy(da * e, &ch.k[j * Dk], &dQ[i * Dk], Dk);
              axpy(da * e, &ch.q[i * Dk], &dK[j * Dk], Dk);
              const T gij = da * ch.A[i * n + j];
              dG[i] += gij;
              dG[j] -= gij;
            }
            matvec(S0, doi, s0do.data(), Dk, Dv);
            const T ei = std::exp(G[i]);
            axpy(ei, s0do.data(), &dQ[i * Dk], Dk);
            dG[i] += ei * dot(&ch.q[i * Dk], s0do.data(), Dk);
          }
          // dS0 = sum_i exp(G_i) q_i do_i^T + exp(G_n) dS - sum_i w_i du_i^T.
          const T en = std::exp(Gn);
          dG[n - 1] += en * dot(S0, dS.data(), S);
          for (int64_t x = 0; x < S; ++x) dS0[x] = en * dS[x];
          for (int64_t i = 0; i < n; ++i) {
            const T* doi = dout + h.out_at(t0 + i);
            const T ei = std::exp(G[i]);
            for (int64_t a = 0; a < Dk; ++a) {
              axpy(ei * ch.q[i * Dk + a], doi, &dS0[a * Dv], Dv);
              axpy(-ch.W[i * Dk + a], &dU[i * Dv], &dS0[a * Dv], Dv);
            }
          }
          // Through U = U~ - W S0 and (I + X) [U~ W] = [beta V, beta exp(G) K]: the right-hand
          // sides' gradients by back substitution with (I + X)^T.
          for (int64_t i = n - 1; i >= 0; --i) {
            T* ru = &dRU[i * Dv];
            T* rw = &dRW[i * Dk];
            std::copy_n(&dU[i * Dv], Dv, ru);
            matvec(S0, &dU[i * Dv], rw, Dk, Dv);
            for (int64_t a = 0; a < Dk; ++a) rw[a] = -rw[a];
            for (int64_t j = i + 1; j < n; ++j) {
              axpy(-ch.X[j * n + i], &dRU[j * Dv], ru, Dv);
              axpy(-ch.X[j * n + i], &dRW[j * Dk], rw, Dk);
            }
          }
          for (int64_t i = 0; i < n; ++i) {
            const T* ru = &dRU[i * Dv];
            const T* rw = &dRW[i * Dk];
            const T bi = ch.beta[i], ei = std::exp(G[i]);
            T* dvi = dv + h.v_at(t0 + i);
            for (int64_t c2 = 0; c2 < Dv; ++c2) dvi[c2] = bi * ru[c2];
            const T kw = dot(&ch.k[i * Dk], rw, Dk);
            T db = dot(&ch.v[i * Dv], ru, Dv) + ei * kw;
            axpy(bi * ei, rw, &dK[i * Dk], Dk);
            dG[i] += bi * ei * kw;
            for (int64_t j = 0; j < i; ++j) {
              const T dx = -(dot(ru, &ch.Ut[j * Dv], Dv) + dot(rw, &ch.W[j * Dk], Dk));
              const T e = std::exp(G[i] - G[j]);
              db += dx * e * ch.kk[i * n + j];
              const T hij = dx * ch.X[i * n + j];
              dG[i] += hij;
              dG[j] -= hij;
              axpy(dx * bi * e, &ch.k[j * Dk], &dK[i * Dk], Dk);
              axpy(dx * bi * e, &ch.k[i * Dk], &dK[j * Dk], Dk);
            }
            dbeta[h.gate_at(t0 + i)] = db;
          }
          // G_i = g_1 + ... + g_i: dg_j = sum over i >= j of dG_i.
          T sum = 0;
          for (int64_t i = n - 1; i >= 0; --i) {
            sum += dG[i];
            dg[h.gate_at(t0 + i)] = sum;
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
