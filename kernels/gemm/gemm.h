// General matrix multiply on row-major FP32 matrices, behind a runtime dispatch table.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cputrain::kernels {

enum class Transpose : bool { No = false, Yes = true };

// C[M,N] = op(A)[M,K] * op(B)[K,N] + beta * C, all row-major.
//   op(A) = A   : A stored (M, K), lda >= K      op(A) = A^T : A stored (K, M), lda >= M
//   op(B) = B   : B stored (K, N), ldb >= N      op(B) = B^T : B stored (N, K), ldb >= K
//   C stored (M, N), ldc >= N. beta 0 overwrites C (C may hold garbage, even NaN); beta 1
//   accumulates.
// The three products of training a linear layer Y = X W^T, with X (M, K) and W (N, K):
//   forward   Y  = X W^T      gemm_f32(No,  Yes, M, N, K, X, K, W, K, 0, Y, N)
//   input     dX = dY W       gemm_f32(No,  No,  M, K, N, dY, N, W, K, 0 or 1, dX, K)
//   weight    dW += dY^T X    gemm_f32(Yes, No,  N, K, M, dY, N, X, K, 1, dW, K)
void gemm_f32(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// C[M,N] = op(A) op(B) + beta C with A and B in bf16 (uint16_t, see bf16.h), products summed in
// FP32; the same layout contract as gemm_f32.
void gemm_bf16(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);

// C[M,N] = op(A) op(B) rounded to bf16 (fp32_to_bf16), on bf16 A and B: bitwise what gemm_bf16
// with beta 0 followed by rounding gives. Where gemm_bf16_rounded_direct, the FP32 products are
// rounded by the kernel (in registers, or from its AMX tiles), with no FP32 C of M x N;
// elsewhere through an FP32 scratch of M x N taken from the workspace allocator for the call.
void gemm_bf16_rounded(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                       const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, uint16_t* C,
                       int64_t ldc);
// Whether gemm_bf16_rounded needs no scratch for an inner dimension of K on the selected backend
// (the AVX-512 BF16 or the AMX kernel, K within its one K block).
bool gemm_bf16_rounded_direct(int64_t K);

// A rank-r update added to a product's C: C += U op(V), U (M x r) stored (M, r) with leading
// dimension ldu, op(V) (r x N) from V stored (N, r) where tv is Yes (a LoRA adapter's B, in the
// forward) or (r, N) where it is No (its A, in dX), leading dimension ldv; all bf16.
struct LowRankUpdate {
  const uint16_t* u;
  int64_t ldu;
  const uint16_t* v;
  int64_t ldv;
  Transpose tv;
  int64_t r;
};

// gemm_bf16 (op(A) op(B) + beta C) and then C += U op(V): bitwise gemm_bf16(ta, tb, M, N, K, A,
// lda, B, ldb, beta, C, ldc) followed by gemm_bf16(No, tv, M, N, r, u, ldu, v, ldv, 1, C, ldc).
// Where gemm_bf16_low_rank_fused, the backend adds the update to each tile of C right after the
// tile's last K block, while the tile is in L1, instead of in a second pass over C; elsewhere
// the two products run one after the other.
void gemm_bf16_low_rank(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                        float* C, int64_t ldc, const LowRankUpdate& update);
// Whether gemm_bf16_low_rank adds the update inside the product on the selected backend (the
// AVX-512 BF16 kernel's blocked path, A not transposed, r up to its K block).
bool gemm_bf16_low_rank_fused(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                              int64_t r);
// Bytes of buffer 2 that gemm_bf16_low_rank takes, where fused, for the update's packed operands
// (beside the product's buffers, gemm_buffer_bytes); 0 where it is not fused.
size_t gemm_low_rank_buffer_bytes(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                                  int64_t r);

// op(B) packed once for several products that read the same B with A not transposed, such as an
// LM head's logits computed a chunk of rows at a time: the first product packs op(B) into `data`
// as it goes, and the ones after it read it there instead of packing it again. The caller owns
// `data` (gemm_bf16_kept_b_bytes, 64-byte aligned) and gives every product the same tb, N, K, B
// and ldb; packed_nc is the kernel's, 0 until the first product.
struct KeptB {
  void* data;
  int64_t packed_nc = 0;
};
// Bytes a KeptB needs for products that read op(B) (K x N) where gemm_bf16_keeps_b; 0 where the
// selected backend keeps none (all but the AVX-512 BF16 kernel).
size_t gemm_bf16_kept_b_bytes(int64_t N, int64_t K);
// Whether gemm_bf16_kept packs into or reads a KeptB for an M x N x K product (A not transposed)
// on the selected backend: the AVX-512 BF16 kernel's blocked path.
bool gemm_bf16_keeps_b(Transpose tb, int64_t M, int64_t N, int64_t K);
// gemm_bf16(No, tb, ...) with op(B) kept in `kept` where gemm_bf16_keeps_b, bitwise the same;
// elsewhere gemm_bf16 itself, `kept` untouched.
void gemm_bf16_kept(Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                    const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc, KeptB& kept);

// The implementations behind gemm_f32 and gemm_bf16. Each has the exact contract above.
//   Reference  triple loop in double (the ground truth for tests)
//   Eigen      Eigen's FP32 GEMM (BF16: widened to FP32, see gemm_bf16_native); a product of at
//              most 16 rows of A over a B of 2^18 elements or more, oneDNN's sgemm (Eigen packs
//              all of B for each product, which a few rows, as in decoding, cannot repay)
//   Avx512     our blocked AVX-512 kernels (BF16 needs AVX512_BF16; without it, widened)
//   Amx        BF16 on AMX tiles (FP32: the AVX-512 kernel); available only where the CPU has
//              AMX and it passed a self-test against the AVX-512 BF16 kernel at first use
//   Onednn     oneDNN's sgemm and bf16 matmul (where oneDNN has none for this CPU, widened)
enum class GemmBackend { Reference, Eigen, Avx512, Amx, Onednn };

// Straightforward triple loop with double accumulation: the ground truth for tests.
void gemm_f32_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                        int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                        int64_t ldc);
void gemm_bf16_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                         const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                         float* C, int64_t ldc);
void gemm_f32_eigen(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Whether this CPU runs the backend's FP32 path.
bool gemm_backend_available(GemmBackend backend);
// Whether the backend's BF16 path uses bf16 instructions on this CPU. Where it does not
// (Eigen; AVX-512 without AVX512_BF16; oneDNN without its bf16 kernels), gemm_bf16 widens the
// operands to FP32 and runs the FP32 GEMM: the same results (bf16 products are exact in FP32),
// at FP32's rate. The reference backend computes in double.
bool gemm_bf16_native(GemmBackend backend);
// Whether the selected backend's bf16 product without bf16 instructions widens its operands as it
// packs them (the AVX-512 blocked path; not whole FP32 copies in buffers 2 and 3).
bool gemm_bf16_widens_in_packing();
// The fastest available; the environment variable CPUTRAIN_GEMM (a backend name) overrides it.
GemmBackend gemm_default_backend();
// Selects the implementation gemm_f32 and gemm_bf16 call; throws std::invalid_argument for a
// backend this CPU cannot run.
void gemm_set_backend(GemmBackend backend);
GemmBackend gemm_backend();
std::string_view gemm_backend_name(GemmBackend backend);
// Parses "reference", "eigen", "avx512", "amx" or "onednn"; returns false for anything else.
bool gemm_backend_from_name(std::string_view name, GemmBackend* backend);
// The names of every backend this CPU can run, e.g. "reference, eigen, avx512, onednn".
std::string gemm_available_backends();
// Each calling thread's buffers: four for the GEMM (below), and the quantised products'
// dequantised panel of W (kernels/quant/quant.h).
constexpr int kGemmBuffers = 5;
constexpr int kGemmQuantPanel = 4;
// Bytes held by GEMM buffers (kept between calls, one set per calling thread).
size_t gemm_workspace_bytes();
// Frees the calling thread's GEMM buffers; the next product allocates what it needs again.
void gemm_release_buffers();
// Bytes each of the calling thread's four GEMM buffers needs for one product of these sizes on
// the selected backend: [0] and [1] packed panels of our blocked kernels, [2] and [3] the FP32
// widenings of bf16 operands where the backend has no bf16 instructions. Each buffer grows to
// the largest need it meets and stays; their sum is what gemm_workspace_bytes reports.
std::array<size_t, 4> gemm_buffer_bytes(bool bf16, Transpose ta, Transpose tb, int64_t M, int64_t N,
                                        int64_t K);

// A product called inside an OpenMP parallel region runs on its calling thread alone, with that
// thread's buffers (so do a mixture's expert products, one expert a thread). While a
// GemmSerialScope lives, products and gemm_buffer_bytes on the thread that made it plan for one
// thread too: the budget sizes a worker thread's buffers with it.
class GemmSerialScope {
 public:
  GemmSerialScope();
  ~GemmSerialScope();
  GemmSerialScope(const GemmSerialScope&) = delete;
  GemmSerialScope& operator=(const GemmSerialScope&) = delete;

 private:
  bool was_;
};
// Whether the calling thread's products run on it alone (a parallel region or a GemmSerialScope).
bool gemm_serial();

}  // namespace cputrain::kernels
