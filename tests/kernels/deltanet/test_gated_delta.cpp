// The gated delta rule's chunked form against its recurrent form, in double precision and in
// float, across chunk edges, sequences shorter than a chunk and strided rows, and packed rows
// against each sequence alone; its backward pass against central differences of the chunked
// forward pass, for every input; the bf16 products against rounded operands, and the chunked
// form on them against double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/deltanet/deltanet_isa.h"
#include "kernels/deltanet/gated_delta.h"

namespace cputrain::kernels {
namespace {

// Inputs of one call, drawn as Qwen3.5's layer draws them: q and k of unit length, g <= 0,
// beta in (0, 1).
template <class T>
struct Inputs {
  GatedDeltaShape s;
  std::vector<T> q, k, v, g, beta, initial;
  T scale;

  Inputs(const GatedDeltaShape& shape, uint32_t seed, bool with_initial) : s(shape) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    const int64_t rows = s.batch * s.length;
    q.assign(rows * s.qk_row(), T(0));
    k.assign(rows * s.qk_row(), T(0));
    v.assign(rows * s.v_row(), T(0));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < s.key_heads; ++h)
        for (T* x : {&q[r * s.qk_row() + h * s.key_dim], &k[r * s.qk_row() + h * s.key_dim]}) {
          double norm = 0;
          for (int64_t a = 0; a < s.key_dim; ++a) {
            x[a] = static_cast<T>(normal(rng));
            norm += double(x[a]) * x[a];
          }
          for (int64_t a = 0; a < s.key_dim; ++a) x[a] = static_cast<T>(x[a] / std::sqrt(norm));
        }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < s.value_heads * s.value_dim; ++c)
        v[r * s.v_row() + c] = static_cast<T>(normal(rng));
    g.resize(rows * s.value_heads);
    beta.resize(rows * s.value_heads);
    for (T& x : g) x = static_cast<T>(-0.02 - 0.6 * uniform(rng));
    for (T& x : beta) x = static_cast<T>(0.05 + 0.9 * uniform(rng));
    if (with_initial) {
      initial.resize(s.state_elements());
      for (T& x : initial) x = static_cast<T>(0.5 * normal(rng));
    }
    scale = static_cast<T>(1.0 / std::sqrt(double(s.key_dim)));
  }
  const T* init() const { return initial.empty() ? nullptr : initial.data(); }
  int64_t out_elements() const { return s.batch * s.length * s.value_heads * s.value_dim; }
};

template <class T>
struct Result {
  std::vector<T> out, final_state, states;
};

template <class T>
Result<T> recurrent(const Inputs<T>& in) {
  Result<T> r;
  r.out.assign(in.out_elements(), T(0));
  r.final_state = in.initial.empty() ? std::vector<T>(in.s.state_elements(), T(0)) : in.initial;
  gated_delta_recurrent<T>(in.s, in.scale, in.q.data(), in.k.data(), in.v.data(), in.g.data(),
                           in.beta.data(), r.final_state.data(), r.out.data());
  return r;
}

template <class T>
Result<T> chunked(const Inputs<T>& in) {
  Result<T> r;
  r.out.assign(in.out_elements(), T(0));
  r.states.assign(in.s.saved_state_elements(), T(0));
  gated_delta_chunked_forward<T>(in.s, in.scale, in.q.data(), in.k.data(), in.v.data(), in.g.data(),
                                 in.beta.data(), in.init(), r.states.data(), r.out.data());
  const GatedDeltaShape& s = in.s;
  const int64_t S = s.key_dim * s.value_dim;
  for (int64_t bh = 0; bh < s.batch * s.value_heads; ++bh) {
    const T* last = r.states.data() + (bh * (s.chunks() + 1) + s.chunks()) * S;
    r.final_state.insert(r.final_state.end(), last, last + S);
  }
  return r;
}

template <class A, class B>
double max_relative(const std::vector<A>& got, const std::vector<B>& want) {
  double scale = 1e-30, diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::abs(double(want[i])));
    diff = std::max(diff, std::abs(double(got[i]) - double(want[i])));
  }
  return diff / scale;
}

GatedDeltaShape shape(int64_t T, int64_t chunk, int64_t stride_pad = 0) {
  GatedDeltaShape s;
  s.batch = 2;
  s.length = T;
  s.key_heads = 2;
  s.value_heads = 4;
  s.key_dim = 5;
  s.value_dim = 7;
  s.chunk = chunk;
  if (stride_pad != 0) {
    s.qk_stride = s.key_heads * s.key_dim + stride_pad;
    s.v_stride = s.value_heads * s.value_dim + 2 * stride_pad;
  }
  return s;
}

TEST(GatedDelta, ChunkedEqualsRecurrentInDouble) {
  for (const int64_t chunk : {64, 4, 5})
    for (const int64_t T : {1, 3, 4, 5, 64, 70, 131})
      for (const bool init : {false, true})
        for (const int64_t pad : {0, 3}) {
          const Inputs<double> in(shape(T, chunk, pad), static_cast<uint32_t>(T * 7 + chunk), init);
          const Result<double> want = recurrent(in), got = chunked(in);
          const std::string where = "T " + std::to_string(T) + " chunk " + std::to_string(chunk) +
                                    (init ? " with" : " without") + " an initial state, pad " +
                                    std::to_string(pad);
          EXPECT_LT(max_relative(got.out, want.out), 1e-12) << where;
          EXPECT_LT(max_relative(got.final_state, want.final_state), 1e-12) << where;
        }
}

std::vector<float> narrow(const std::vector<double>& x) {
  return std::vector<float>(x.begin(), x.end());
}

// The float inputs of `in` (its shape with `s`'s bf16_products).
Inputs<float> narrowed(const Inputs<double>& in, uint32_t seed, bool bf16_products) {
  GatedDeltaShape s = in.s;
  s.bf16_products = bf16_products;
  Inputs<float> f(s, seed, !in.initial.empty());
  f.q = narrow(in.q), f.k = narrow(in.k), f.v = narrow(in.v), f.g = narrow(in.g);
  f.beta = narrow(in.beta), f.initial = narrow(in.initial);
  f.scale = static_cast<float>(in.scale);
  return f;
}

TEST(GatedDelta, FloatTracksDouble) {
  for (const int64_t T : {70, 200}) {
    const Inputs<double> in(shape(T, 64), 11, true);
    const Inputs<float> f = narrowed(in, 11, false);
    const Result<double> want = recurrent(in);
    EXPECT_LT(max_relative(chunked(f).out, want.out), 2e-5) << "T " << T;
    EXPECT_LT(max_relative(recurrent(f).out, want.out), 2e-5) << "T " << T;
    EXPECT_LT(max_relative(chunked(f).final_state, want.final_state), 2e-5) << "T " << T;
  }
}

// The chunked backward pass's gradients of q, k, v, g, beta and the initial state, from dout and
// the final state's gradient dfinal.
template <class T>
std::vector<std::vector<T>> gradients(const Inputs<T>& x, const std::vector<T>& dout,
                                      const std::vector<T>& dfinal) {
  const GatedDeltaShape& s = x.s;
  const Result<T> fwd = chunked(x);
  std::vector<std::vector<T>> g = {
      std::vector<T>(x.q.size()),    std::vector<T>(x.k.size()),
      std::vector<T>(x.v.size()),    std::vector<T>(x.g.size()),
      std::vector<T>(x.beta.size()), std::vector<T>(s.state_elements())};
  gated_delta_chunked_backward<T>(s, x.scale, x.q.data(), x.k.data(), x.v.data(), x.g.data(),
                                  x.beta.data(), fwd.states.data(), dout.data(), dfinal.data(),
                                  g[0].data(), g[1].data(), g[2].data(), g[3].data(), g[4].data(),
                                  g[5].data());
  return g;
}

const char* const kGradientNames[] = {"q", "k", "v", "g", "beta", "initial state"};

// Normal draws for dout and the final state's gradient of `in`.
void draw_output_gradients(const Inputs<double>& in, std::vector<double>* dout,
                           std::vector<double>* dfinal) {
  std::mt19937 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  dout->resize(in.out_elements());
  dfinal->resize(in.s.state_elements());
  for (double& x : *dout) x = normal(rng);
  for (double& x : *dfinal) x = normal(rng);
}

// The float backward (its products on the FP32 GEMM) against the double one, at head sizes whose
// products the GEMM runs on several threads: 3 chunks of 64, the last partial.
TEST(GatedDelta, FloatGradientsTrackDouble) {
  GatedDeltaShape s = shape(150, 64, 0);
  s.key_dim = 48;
  s.value_dim = 40;
  const Inputs<double> in(s, 13, true);
  const Inputs<float> f = narrowed(in, 13, false);
  std::vector<double> dout, dfinal;
  draw_output_gradients(in, &dout, &dfinal);
  const auto want = gradients(in, dout, dfinal);
  const auto got = gradients(f, narrow(dout), narrow(dfinal));
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_LT(max_relative(got[i], want[i]), 5e-5) << kGradientNames[i];
}

// Each table's bf16 products (deltanet_isa.h) against products in double of the operands rounded
// to bf16, over sizes with partial pairs, partial vectors and partial AMX tiles, every
// transposition, overwriting (C full of NaN) and accumulating.
TEST(GatedDelta, Bf16ProductsEqualRoundedOperandsInFp32) {
  std::vector<std::pair<const char*, const DeltanetKernels*>> tables;
  if (cpu_features().avx512_bf16)
    tables.emplace_back("avx512_bf16", &deltanet_kernels_avx512_bf16());
  if (cpu_features().amx_bf16) tables.emplace_back("amx", &deltanet_kernels_amx());
  if (tables.empty()) GTEST_SKIP() << "this CPU has no bf16 products";
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  PairsScratch scratch;
  for (const auto& [name, table] : tables)
    for (const int64_t M : {1, 5, 16, 33, 64})
      for (const int64_t N : {1, 7, 16, 40, 128})
        for (const int64_t K : {1, 2, 17, 64, 131})
          for (const bool ta : {false, true})
            for (const bool tb : {false, true})
              for (const float beta : {0.0f, 1.0f}) {
                const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 2;
                std::vector<float> A((ta ? K : M) * lda), B((tb ? N : K) * ldb), C(M * ldc);
                for (float& x : A) x = normal(rng);
                for (float& x : B) x = normal(rng);
                for (float& x : C) x = beta != 0 ? normal(rng) : std::nanf("");
                const std::vector<float> C0 = C;
                table->product_bf16(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, beta, C.data(),
                                    ldc, scratch);
                const auto rounded = [](float x) { return double(bf16_to_fp32(fp32_to_bf16(x))); };
                for (int64_t i = 0; i < M; ++i)
                  for (int64_t j = 0; j < N; ++j) {
                    double sum = beta != 0 ? double(C0[i * ldc + j]) : 0.0, size = 0;
                    for (int64_t p = 0; p < K; ++p) {
                      const double term = rounded(ta ? A[p * lda + i] : A[i * lda + p]) *
                                          rounded(tb ? B[j * ldb + p] : B[p * ldb + j]);
                      sum += term;
                      size += std::abs(term);
                    }
                    ASSERT_NEAR(C[i * ldc + j], sum, 1e-6 * (size + 1.0))
                        << name << " M " << M << " N " << N << " K " << K << " ta " << ta << " tb "
                        << tb << " beta " << beta << " at " << i << ", " << j;
                  }
                for (int64_t i = 0; i < M; ++i)  // the padding between C's rows untouched
                  for (int64_t j = N; j < ldc; ++j)
                    ASSERT_TRUE(std::isnan(C[i * ldc + j]) ? std::isnan(C0[i * ldc + j])
                                                           : C[i * ldc + j] == C0[i * ldc + j]);
              }
}

// The chunked form with its products on bf16 against double, forward and every gradient, at
// Qwen3.5's head sizes (dk = dv = 128) over 3 chunks of 64, the last partial, with an initial
// state: within what rounding the products' operands to bf16 costs.
TEST(GatedDelta, Bf16ProductsTrackDouble) {
  if (deltanet_kernels().product_bf16 == nullptr) GTEST_SKIP() << "no bf16 products chosen";
  GatedDeltaShape s = shape(150, 64, 0);
  s.batch = 1;
  s.key_dim = 128;
  s.value_dim = 128;
  const Inputs<double> in(s, 17, true);
  const Inputs<float> f = narrowed(in, 17, true), f32 = narrowed(in, 17, false);
  const Result<double> want = chunked(in);
  const Result<float> got = chunked(f), got32 = chunked(f32);
  // Rounding to bf16 (a relative 2^-9) shows: these are not the FP32 products.
  EXPECT_GT(max_relative(got.out, want.out), 100 * max_relative(got32.out, want.out));
  EXPECT_LT(max_relative(got.out, want.out), 1e-2);
  EXPECT_LT(max_relative(got.final_state, want.final_state), 1e-2);
  std::vector<double> dout, dfinal;
  draw_output_gradients(in, &dout, &dfinal);
  const auto gw = gradients(in, dout, dfinal);
  const auto gg = gradients(f, narrow(dout), narrow(dfinal));
  for (size_t i = 0; i < gw.size(); ++i)
    EXPECT_LT(max_relative(gg[i], gw[i]), 1e-2) << kGradientNames[i];
}

// L = sum(w_out * out) + sum(w_state * final state), its gradient by the backward pass against
// central differences, every element of every input.
void check_gradients(const GatedDeltaShape& s, bool with_initial, bool with_dfinal) {
  Inputs<double> in(s, 5, with_initial);
  std::mt19937 rng(9);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> w_out(in.out_elements()), w_state(s.state_elements());
  for (double& x : w_out) x = normal(rng);
  for (double& x : w_state) x = with_dfinal ? normal(rng) : 0.0;
  if (!with_initial) in.initial.clear();
  const auto loss = [&](const Inputs<double>& x) {
    const Result<double> r = chunked(x);
    double l = 0;
    for (size_t i = 0; i < r.out.size(); ++i) l += w_out[i] * r.out[i];
    for (size_t i = 0; i < r.final_state.size(); ++i) l += w_state[i] * r.final_state[i];
    return l;
  };
  const Result<double> fwd = chunked(in);
  std::vector<double> dq(in.q.size(), 7.0), dk(in.k.size(), 7.0), dv(in.v.size(), 7.0),
      dg(in.g.size()), dbeta(in.beta.size()), dinit(s.state_elements());
  gated_delta_chunked_backward<double>(
      s, in.scale, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
      fwd.states.data(), w_out.data(), with_dfinal ? w_state.data() : nullptr, dq.data(), dk.data(),
      dv.data(), dg.data(), dbeta.data(), with_initial ? dinit.data() : nullptr);
  const auto check = [&](std::vector<double> Inputs<double>::*field,
                         const std::vector<double>& grad, const char* name, int64_t row,
                         int64_t used) {
    Inputs<double> x = in;
    std::vector<double>& data = x.*field;
    for (size_t i = 0; i < data.size(); ++i) {
      if (row != 0 && static_cast<int64_t>(i % row) >= used) continue;  // padding between rows
      const double h = 1e-5, keep = data[i];
      data[i] = keep + h;
      const double up = loss(x);
      data[i] = keep - h;
      const double down = loss(x);
      data[i] = keep;
      const double numeric = (up - down) / (2 * h);
      ASSERT_NEAR(grad[i], numeric, 1e-6 * std::max(1.0, std::abs(numeric)))
          << name << "[" << i << "] of T " << s.length << " chunk " << s.chunk;
    }
  };
  check(&Inputs<double>::q, dq, "q", s.qk_row(), s.key_heads * s.key_dim);
  check(&Inputs<double>::k, dk, "k", s.qk_row(), s.key_heads * s.key_dim);
  check(&Inputs<double>::v, dv, "v", s.v_row(), s.value_heads * s.value_dim);
  check(&Inputs<double>::g, dg, "g", 0, 0);
  check(&Inputs<double>::beta, dbeta, "beta", 0, 0);
  if (with_initial) check(&Inputs<double>::initial, dinit, "initial state", 0, 0);
}

// Each position's index within its sequence, for rows of sequences of `lengths` (each row's
// summing to T).
std::vector<int32_t> positions_of(const std::vector<std::vector<int64_t>>& lengths) {
  std::vector<int32_t> out;
  for (const std::vector<int64_t>& row : lengths)
    for (const int64_t n : row)
      for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(i));
  return out;
}

// Packed rows: each sequence as a row of its own would compute it (its own call, from a zero
// state), the chunked form as the recurrent one, with sequences starting at a chunk's first
// position, within a chunk, two in one chunk, and one of a single position.
TEST(GatedDelta, PackedRowsComputeEachSequenceAlone) {
  for (const int64_t chunk : {4, 5, 64}) {
    const std::vector<std::vector<int64_t>> lengths = {{4, 7, 1, 2, 6}, {3, 17}};
    GatedDeltaShape s = shape(20, chunk, 2);
    const std::vector<int32_t> positions = positions_of(lengths);
    s.positions = positions.data();
    const Inputs<double> in(s, static_cast<uint32_t>(chunk), false);
    const Result<double> got = chunked(in), rec = recurrent(in);
    EXPECT_LT(max_relative(got.out, rec.out), 1e-12) << "chunk " << chunk;
    // Each sequence alone: a batch of one row of its length.
    for (int64_t b = 0; b < s.batch; ++b) {
      int64_t t0 = 0;
      for (const int64_t n : lengths[static_cast<size_t>(b)]) {
        GatedDeltaShape one = shape(n, chunk, 2);
        one.batch = 1;
        Inputs<double> alone(one, 1, false);
        const auto rows = [&](const std::vector<double>& from, std::vector<double>& to,
                              int64_t row) {
          std::copy_n(from.begin() + (b * s.length + t0) * row, n * row, to.begin());
        };
        rows(in.q, alone.q, s.qk_row());
        rows(in.k, alone.k, s.qk_row());
        rows(in.v, alone.v, s.v_row());
        rows(in.g, alone.g, s.value_heads);
        rows(in.beta, alone.beta, s.value_heads);
        const Result<double> want = recurrent(alone);
        const int64_t width = s.value_heads * s.value_dim;
        const std::vector<double> part(got.out.begin() + (b * s.length + t0) * width,
                                       got.out.begin() + (b * s.length + t0 + n) * width);
        EXPECT_LT(max_relative(part, want.out), 1e-12)
            << "chunk " << chunk << " row " << b << " from " << t0;
        t0 += n;
      }
    }
  }
}

TEST(GatedDelta, GradientsMatchCentralDifferences) {
  GatedDeltaShape s = shape(11, 4, 2);  // chunks of 4, 4 and 3
  s.batch = 1;
  s.key_dim = 3;
  s.value_dim = 2;
  check_gradients(s, true, true);
  check_gradients(s, false, false);
  s.length = 3;  // shorter than a chunk
  check_gradients(s, true, true);
  s.length = 9;
  s.chunk = 64;
  s.key_heads = s.value_heads = 3;
  check_gradients(s, true, false);
  // Packed rows: sequences starting at a chunk's first position, within a chunk, two in one.
  s = shape(13, 4, 2);
  s.batch = 1;
  s.key_dim = 3;
  s.value_dim = 2;
  const std::vector<int32_t> positions = positions_of({{4, 2, 1, 6}});
  s.positions = positions.data();
  check_gradients(s, false, true);
}

}  // namespace
}  // namespace cputrain::kernels
