// The GEMM implementations behind the dispatch in gemm.cpp, one per ISA or library; each has
// the contract of gemm_f32 / gemm_bf16 in gemm.h and may only be called where
// gemm_backend_available says so. Their table, with the ISA each needs, is in gemm.cpp.
#pragma once

#include <array>
#include <cstdint>

#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_test_hooks.h"

namespace cputrain::kernels {

namespace detail {
// C = beta C (beta 0 overwrites with zeros): the whole product when K is 0.
inline void scale_c(float* C, int64_t M, int64_t N, int64_t ldc, float beta) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
}
}  // namespace detail

void gemm_f32_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void gemm_bf16_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                      const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                      float* C, int64_t ldc);
// y[n] = x . W[n, :] (+ beta y[n]) for n < N, x of K bf16 values and W rows of K (stride ldw):
// gemm_bf16(No, Yes, 1, N, K, x, K, W, ldw, beta, y, N) for one row, the case of decoding, where
// packing the matrix would only add to the memory traffic; needs AVX512_BF16.
void gemv_bf16_avx512(int64_t N, int64_t K, const uint16_t* x, const uint16_t* W, int64_t ldw,
                      float beta, float* y);
// The same in FP32 (AVX-512F).
void gemv_f32_avx512(int64_t N, int64_t K, const float* x, const float* W, int64_t ldw, float beta,
                     float* y);
// gemm_bf16_low_rank on the AVX-512 BF16 kernel, the update added in its blocked driver; only
// where gemm_bf16_avx512_takes_low_rank (else it throws std::logic_error).
void gemm_bf16_low_rank_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                               const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                               float beta, float* C, int64_t ldc, const LowRankUpdate& update);
// Floats of buffer 2 it takes for the update's packed operands.
int64_t gemm_bf16_avx512_low_rank_floats(int64_t M, int64_t N, int64_t r);
// gemm_bf16(No, tb, ...) on the AVX-512 BF16 kernel with op(B) kept in `kept` (packed by the
// first product, read by the next); only where gemm_bf16_avx512_keeps_b (else it throws
// std::logic_error).
void gemm_bf16_kept_avx512(Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                           int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C,
                           int64_t ldc, KeptB& kept);
bool gemm_bf16_avx512_keeps_b(Transpose tb, int64_t M, int64_t N, int64_t K);
// Floats of the kept op(B) (K x N) it takes.
int64_t gemm_bf16_avx512_kept_b_floats(int64_t N, int64_t K);
// gemm_bf16_rounded on the AVX-512 BF16 kernel; K <= gemm_bf16_avx512_block_k().
void gemm_bf16_rounded_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                              const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                              uint16_t* C, int64_t ldc);
int64_t gemm_bf16_avx512_block_k();
void gemm_bf16_amx(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
                   int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);
// gemm_bf16_rounded on the AMX kernel; K <= gemm_bf16_amx_block_k().
void gemm_bf16_rounded_amx(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                           const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                           uint16_t* C, int64_t ldc);
int64_t gemm_bf16_amx_block_k();
// The AMX kernel against the AVX-512 BF16 kernel on a few shapes with tails in every dimension,
// every transpose combination and both betas (a warning on stderr where they disagree). Only
// where cpu_features().amx_bf16 is set; the GEMM runs it once, before it first selects AMX.
bool gemm_bf16_amx_self_test();
// bf16 operands through the FP32 AVX-512 kernel, widened to FP32 as they are packed: the bf16
// product where the CPU has no bf16 instructions (AVX-512 without AVX512_BF16).
void gemm_bf16_widened_avx512(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                              const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                              float beta, float* C, int64_t ldc);
// Floats the blocked kernels take of packing buffers 0 and 1 for an M x N x K product.
std::array<int64_t, 2> gemm_f32_avx512_pack_floats(Transpose ta, Transpose tb, int64_t M, int64_t N,
                                                   int64_t K);
std::array<int64_t, 2> gemm_bf16_avx512_pack_floats(Transpose ta, Transpose tb, int64_t M,
                                                    int64_t N, int64_t K);
std::array<int64_t, 2> gemm_bf16_amx_pack_floats(Transpose ta, Transpose tb, int64_t M, int64_t N,
                                                 int64_t K);
std::array<int64_t, 2> gemm_bf16_widened_avx512_pack_floats(Transpose ta, Transpose tb, int64_t M,
                                                            int64_t N, int64_t K);
// Floats of packing buffers 0 and 1 the selected backend's FP32 product (bf16 false) or bf16
// product (with bf16 instructions, or widened in its packing) takes for an M x N x K product
// (gemm.cpp).
std::array<int64_t, 2> gemm_pack_floats(bool bf16, Transpose ta, Transpose tb, int64_t M, int64_t N,
                                        int64_t K);
void gemm_f32_onednn(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// Whether oneDNN has a bf16 matmul for this CPU (its bf16 kernels need AVX-512 or AMX).
bool onednn_bf16_supported();
void gemm_bf16_onednn(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                      const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                      float* C, int64_t ldc);

}  // namespace cputrain::kernels
