// What tests and comparisons of the GEMM paths reach into, not an interface to compute with: the
// switches that send our blocked kernels down one path or another (every path gives the same
// results bit for bit) and the queries and counters that say which path a product takes.
#pragma once

#include <cstdint>

#include "kernels/gemm/gemm.h"

namespace cputrain::kernels {

// Whether our blocked kernels take their fused or direct path for weight-gradient products (A
// transposed, B not; kernels/gemm/gemm_plan.h) where it suits the shape: on by default; off, they
// run the blocked path, with the same results bit for bit. For tests and comparisons.
void gemm_set_fused(bool on);
bool gemm_fused();
// Whether FP32 weight gradients take the direct path where it suits the shape (on by default);
// off, those take the fused path, with the same results bit for bit. For tests and comparisons;
// gemm_set_fused(false) turns both off.
void gemm_set_direct(bool on);
bool gemm_direct();
// Whether the AVX-512 BF16 kernel takes its path for products of at most 32 columns with A not
// transposed (kernels/gemm/gemm_bf16_avx512.cpp) where it would run the blocked path: on by
// default; off, the blocked path, with the same results bit for bit. For tests and comparisons.
void gemm_set_skinny(bool on);
bool gemm_skinny_enabled();
// Whether the AVX-512 BF16 kernel takes that path for an M x N x K product, with
// gemm_skinny_enabled() as it is now.
bool gemm_bf16_avx512_takes_skinny(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K);
// Whether gemm_bf16_low_rank adds its update inside the AVX-512 BF16 kernel's product where it
// can (on by default); off, it runs the two products one after the other, with the same results
// bit for bit. For tests and comparisons.
void gemm_set_low_rank(bool on);
bool gemm_low_rank_enabled();
// Whether the AVX-512 BF16 kernel adds a rank-r update inside an M x N x K product, with
// gemm_low_rank_enabled() as it is now.
bool gemm_bf16_avx512_takes_low_rank(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                                     int64_t r);
// Whether gemm_bf16_kept keeps op(B) on the AVX-512 BF16 kernel where it can (on by default);
// off, each product packs B itself, with the same results bit for bit. For tests and comparisons.
void gemm_set_kept_b(bool on);
bool gemm_kept_b_enabled();
// K blocks of 512 the fused path takes as one where no tuning says otherwise (2 by default;
// kernels/gemm/gemm_test_hooks.cpp says why; kernels/gemm/gemm_tuning.h): any count gives the same
// results bit for bit. For tests and comparisons (gemm_alternate
// --fused-k-blocks); throws std::invalid_argument below 1 or above 16.
void gemm_set_fused_k_blocks(int blocks);
int gemm_fused_k_blocks();
// Whether the AVX-512 kernels take their fused path for an M x N x K product (FP32 C) on the
// calling thread's OpenMP thread count, with gemm_fused() as it is now.
bool gemm_f32_avx512_takes_fused(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K);
bool gemm_bf16_avx512_takes_fused(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K);
// Whether the FP32 AVX-512 kernels take their direct path for an M x N x K product of
// contiguous operands that start cache lines on the calling thread's OpenMP thread count, with
// gemm_fused() and gemm_direct() as they are now.
bool gemm_f32_avx512_takes_direct(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K);
// The same for the operands A and B, lda and ldb apart (the direct path wants rows that are not
// a multiple of 4 KiB apart and that start cache lines).
bool gemm_f32_avx512_takes_direct(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                                  const float* A, int64_t lda, const float* B, int64_t ldb);
// Rows of C the fused path has computed so far in this process on a thread other than the one
// whose columns they are (the rows of its last K block it had not reached; gemm_fused.h).
int64_t gemm_fused_rows_shared();
// Rows of C the fused path has computed so far in this process from the shared copy of their
// packed A, not packing it (where A is packed once for all threads; gemm_fused.h).
int64_t gemm_fused_rows_a_shared();

}  // namespace cputrain::kernels
