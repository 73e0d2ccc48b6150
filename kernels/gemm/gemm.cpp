// The GEMM's dispatch: a table of the backends (kernels/cpu/dispatch.h), the one gemm_f32,
// gemm_bf16 and gemm_bf16_rounded run on (chosen once, the fastest available or CPUTRAIN_GEMM;
// gemm_set_backend changes it), bf16 operands widened to FP32 where the backend has no bf16
// instructions, and the backends' names. The implementations are in files of their own
// (gemm_isa.h); the buffers in gemm_buffers.cpp.
#include "kernels/gemm/gemm.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/workspace.h"
#include "kernels/gemm/gemm_isa.h"
#include "kernels/gemm/gemm_plan.h"

namespace cputrain::kernels {
namespace {

using GemmF32 = void (*)(Transpose, Transpose, int64_t, int64_t, int64_t, const float*, int64_t,
                         const float*, int64_t, float, float*, int64_t);
using GemmBf16 = void (*)(Transpose, Transpose, int64_t, int64_t, int64_t, const uint16_t*, int64_t,
                          const uint16_t*, int64_t, float, float*, int64_t);
using GemmRounded = void (*)(Transpose, Transpose, int64_t, int64_t, int64_t, const uint16_t*,
                             int64_t, const uint16_t*, int64_t, uint16_t*, int64_t);
using PackFloats = std::array<int64_t, 2> (*)(Transpose, Transpose, int64_t, int64_t, int64_t);

struct GemmKernels {
  GemmBackend backend;
  GemmF32 f32;
  // The backend's own bf16 product, or null (gemm_bf16 widens the operands and runs f32).
  GemmBf16 bf16;
  // Whether `bf16` uses bf16 instructions on this CPU; where it returns false, gemm_bf16 widens.
  // Null: `bf16` is always taken and is not bf16 instructions (the reference, in double).
  bool (*bf16_instructions)();
  // The bf16 product rounded to bf16 in the kernel, for K up to rounded_block_k(), or null.
  GemmRounded rounded;
  int64_t (*rounded_block_k)();
  // Floats of packing buffers 0 and 1 the FP32 and the bf16 products take, or null: none.
  PackFloats f32_pack, bf16_pack;
  // Where `bf16` is not taken: the bf16 product widening its operands as it packs them, and
  // its buffers; null: whole operands widened into buffers 2 and 3, then `f32`.
  GemmBf16 widened = nullptr;
  PackFloats widened_pack = nullptr;
};

bool always() {
  return true;
}
bool avx512_bf16_usable() {
  return isa_usable(Isa::Avx512Bf16);
}
bool amx_passes_self_test() {
  static const bool passed = gemm_bf16_amx_self_test();
  return passed;
}

// The backends, fastest first. The reference and oneDNN are taken only when forced.
using GemmRow = KernelChoice<GemmKernels>;
const GemmRow kGemm[] = {
    {{"amx", Isa::Amx, true, amx_passes_self_test},
     {GemmBackend::Amx, gemm_f32_avx512, gemm_bf16_amx, always, gemm_bf16_rounded_amx,
      gemm_bf16_amx_block_k, gemm_f32_avx512_pack_floats, gemm_bf16_amx_pack_floats}},
    {{"avx512", Isa::Avx512},
     {GemmBackend::Avx512, gemm_f32_avx512, gemm_bf16_avx512, avx512_bf16_usable,
      gemm_bf16_rounded_avx512, gemm_bf16_avx512_block_k, gemm_f32_avx512_pack_floats,
      gemm_bf16_avx512_pack_floats, gemm_bf16_widened_avx512,
      gemm_bf16_widened_avx512_pack_floats}},
    {{"eigen", Isa::Avx2},
     {GemmBackend::Eigen, gemm_f32_eigen, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr}},
    {{"onednn", Isa::Avx2, false},
     {GemmBackend::Onednn, gemm_f32_onednn, gemm_bf16_onednn, onednn_bf16_supported, nullptr,
      nullptr, nullptr, nullptr}},
    {{"reference", Isa::Avx2, false},
     {GemmBackend::Reference, gemm_f32_reference, gemm_bf16_reference, nullptr, nullptr, nullptr,
      nullptr, nullptr}},
};

const GemmRow& row_of(GemmBackend backend) {
  for (const GemmRow& r : kGemm)
    if (r.entry.backend == backend) return r;
  throw std::invalid_argument("not a GEMM backend");
}

std::atomic<const GemmKernels*>& selected_slot() {
  static std::atomic<const GemmKernels*> slot{&row_of(gemm_default_backend()).entry};
  return slot;
}

const GemmKernels& selected() {
  return *selected_slot().load(std::memory_order_relaxed);
}

// Eigen packs the whole of B for each product: a few rows of A over a large B (decoding a batch
// of sequences, a row each) read it several times over, where oneDNN's sgemm streams it once.
constexpr int64_t kFewRows = 16;
bool few_rows_through_onednn(int64_t M, int64_t N, int64_t K) {
  return M <= kFewRows && N * K >= (int64_t{1} << 18) && selected().backend == GemmBackend::Eigen;
}

bool native(const GemmKernels& k) {
  return k.bf16 != nullptr && k.bf16_instructions != nullptr && k.bf16_instructions();
}

}  // namespace

void gemm_f32(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (few_rows_through_onednn(M, N, K))
    return gemm_f32_onednn(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  selected().f32(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

namespace {

// A stored rows x cols bf16 matrix (leading dimension ld) as a dense FP32 copy in the
// calling thread's buffer `which`.
const float* widen(const uint16_t* x, int64_t rows, int64_t cols, int64_t ld, int which) {
  float* out = detail::gemm_pack_buffer(static_cast<size_t>(rows * cols), which);
  if (ld == cols) {
    bf16_to_fp32_array(out, x, rows * cols);
    return out;
  }
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = bf16_to_fp32(x[r * ld + c]);
  return out;
}

}  // namespace

bool gemm_bf16_native(GemmBackend backend) {
  return native(row_of(backend).entry);
}

void gemm_bf16(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const GemmKernels& k = selected();
  if (k.bf16 != nullptr && (k.bf16_instructions == nullptr || k.bf16_instructions()))
    return k.bf16(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  // No bf16 instructions: the FP32 kernel over operands widened to FP32, as it packs them where
  // the backend can, else whole. The product of two bf16 values is exact in FP32, so this is the
  // same arithmetic: bf16 inputs, FP32 accumulation.
  if (k.widened != nullptr) return k.widened(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) return detail::scale_c(C, M, N, ldc, beta);
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
  const float* a = widen(A, at ? K : M, at ? M : K, lda, 2);
  const float* b = widen(B, bt ? N : K, bt ? K : N, ldb, 3);
  gemm_f32(ta, tb, M, N, K, a, at ? M : K, b, bt ? K : N, beta, C, ldc);
}

bool gemm_bf16_rounded_direct(int64_t K) {
  const GemmKernels& k = selected();
  return k.rounded != nullptr && native(k) && K <= k.rounded_block_k();
}

void gemm_bf16_rounded(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                       const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, uint16_t* C,
                       int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (gemm_bf16_rounded_direct(K))
    return selected().rounded(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
  const WorkspaceAllocator allocator = workspace_allocator();
  const size_t bytes = static_cast<size_t>(M * N) * sizeof(float);
  const auto release = [&](float* p) { allocator.free(p, bytes); };
  const std::unique_ptr<float, decltype(release)> scratch(
      static_cast<float*>(allocator.allocate(bytes)), release);
  gemm_bf16(ta, tb, M, N, K, A, lda, B, ldb, 0.0f, scratch.get(), N);
  if (ldc == N) return fp32_to_bf16_array(C, scratch.get(), M * N);
  for (int64_t i = 0; i < M; ++i) fp32_to_bf16_array(C + i * ldc, scratch.get() + i * N, N);
}

bool gemm_bf16_low_rank_fused(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                              int64_t r) {
  const GemmKernels& k = selected();
  return k.backend == GemmBackend::Avx512 && native(k) &&
         gemm_bf16_avx512_takes_low_rank(ta, tb, M, N, K, r);
}

void gemm_bf16_low_rank(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                        const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                        float* C, int64_t ldc, const LowRankUpdate& update) {
  if (gemm_bf16_low_rank_fused(ta, tb, M, N, K, update.r))
    return gemm_bf16_low_rank_avx512(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc, update);
  gemm_bf16(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  gemm_bf16(Transpose::No, update.tv, M, N, update.r, update.u, update.ldu, update.v, update.ldv,
            1.0f, C, ldc);
}

bool gemm_bf16_keeps_b(Transpose tb, int64_t M, int64_t N, int64_t K) {
  const GemmKernels& k = selected();
  return k.backend == GemmBackend::Avx512 && native(k) && gemm_bf16_avx512_keeps_b(tb, M, N, K);
}

size_t gemm_bf16_kept_b_bytes(int64_t N, int64_t K) {
  const GemmKernels& k = selected();
  if (k.backend != GemmBackend::Avx512 || !native(k) || N <= 0 || K <= 0) return 0;
  return static_cast<size_t>(gemm_bf16_avx512_kept_b_floats(N, K)) * sizeof(float);
}

void gemm_bf16_kept(Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                    const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc,
                    KeptB& kept) {
  if (gemm_bf16_keeps_b(tb, M, N, K))
    return gemm_bf16_kept_avx512(tb, M, N, K, A, lda, B, ldb, beta, C, ldc, kept);
  gemm_bf16(Transpose::No, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

std::array<int64_t, 2> gemm_pack_floats(bool bf16, Transpose ta, Transpose tb, int64_t M, int64_t N,
                                        int64_t K) {
  const GemmKernels& k = selected();
  const PackFloats pack = !bf16 ? k.f32_pack : native(k) ? k.bf16_pack : k.widened_pack;
  if (pack == nullptr) return {};
  return pack(ta, tb, M, N, K);
}

bool gemm_bf16_widens_in_packing() {
  const GemmKernels& k = selected();
  return !native(k) && k.widened != nullptr;
}

bool gemm_backend_available(GemmBackend backend) {
  return kernel_row_usable(row_of(backend).row);
}

GemmBackend gemm_default_backend() {
  return choose_kernel("gemm", kGemm).entry.backend;
}

void gemm_set_backend(GemmBackend backend) {
  if (!gemm_backend_available(backend))
    throw std::invalid_argument(std::string("GEMM backend ") +
                                std::string(gemm_backend_name(backend)) +
                                " needs a CPU feature this machine lacks");
  selected_slot().store(&row_of(backend).entry);
}

GemmBackend gemm_backend() {
  return selected().backend;
}

std::string_view gemm_backend_name(GemmBackend backend) {
  return row_of(backend).row.name;
}

bool gemm_backend_from_name(std::string_view name, GemmBackend* backend) {
  for (const GemmRow& r : kGemm) {
    if (name == r.row.name) {
      *backend = r.entry.backend;
      return true;
    }
  }
  return false;
}

std::string gemm_available_backends() {
  return usable_kernel_rows(kernel_rows(kGemm));
}

}  // namespace cputrain::kernels
