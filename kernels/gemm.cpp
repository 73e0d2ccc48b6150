// The GEMM's dispatch: the backend gemm_f32, gemm_bf16 and gemm_bf16_rounded run on (chosen once,
// the fastest available or CPUTRAIN_GEMM; gemm_set_backend changes it), bf16 operands widened to
// FP32 where the backend has no bf16 instructions, and the backends' names. The implementations
// are in files of their own (gemm_isa.h); the buffers in gemm_buffers.cpp.
#include "kernels/gemm.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cpu_features.h"
#include "kernels/gemm_isa.h"
#include "kernels/gemm_plan.h"
#include "kernels/workspace.h"

namespace cputrain::kernels {
namespace {

constexpr GemmBackend kAllBackends[] = {GemmBackend::Reference, GemmBackend::Eigen,
                                        GemmBackend::Avx512, GemmBackend::Amx, GemmBackend::Onednn};

bool amx_usable() {
  static const bool usable = cpu_features().amx_bf16 && gemm_bf16_amx_self_test();
  return usable;
}

std::atomic<GemmBackend>& backend_slot() {
  static std::atomic<GemmBackend> slot{gemm_default_backend()};
  return slot;
}

}  // namespace

void gemm_f32(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
              int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  switch (gemm_backend()) {
    case GemmBackend::Reference:
      return gemm_f32_reference(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    case GemmBackend::Eigen:
      return gemm_f32_eigen(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    case GemmBackend::Avx512:
    case GemmBackend::Amx:
      return gemm_f32_avx512(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    case GemmBackend::Onednn:
      return gemm_f32_onednn(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  }
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
  switch (backend) {
    case GemmBackend::Amx:
      return amx_usable();
    case GemmBackend::Avx512:
      return cpu_features().avx512_bf16;
    case GemmBackend::Onednn:
      return onednn_bf16_supported();
    default:
      return false;
  }
}

void gemm_bf16(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const uint16_t* A,
               int64_t lda, const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const GemmBackend backend = gemm_backend();
  if (backend == GemmBackend::Reference)
    return gemm_bf16_reference(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  if (gemm_bf16_native(backend)) {
    if (backend == GemmBackend::Amx)
      return gemm_bf16_amx(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    if (backend == GemmBackend::Avx512)
      return gemm_bf16_avx512(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    return gemm_bf16_onednn(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  }
  // No bf16 instructions: widen both operands to FP32 and run the backend's FP32 GEMM. The
  // product of two bf16 values is exact in FP32, so this is the same arithmetic: bf16 inputs,
  // FP32 accumulation.
  if (M == 0 || N == 0) return;
  if (K == 0) return detail::scale_c(C, M, N, ldc, beta);
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
  const float* a = widen(A, at ? K : M, at ? M : K, lda, 2);
  const float* b = widen(B, bt ? N : K, bt ? K : N, ldb, 3);
  gemm_f32(ta, tb, M, N, K, a, at ? M : K, b, bt ? K : N, beta, C, ldc);
}

bool gemm_bf16_rounded_direct(int64_t K) {
  const GemmBackend backend = gemm_backend();
  if (backend == GemmBackend::Amx) return K <= gemm_bf16_amx_block_k();
  return backend == GemmBackend::Avx512 && gemm_bf16_native(GemmBackend::Avx512) &&
         K <= gemm_bf16_avx512_block_k();
}

void gemm_bf16_rounded(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                       const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, uint16_t* C,
                       int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (gemm_bf16_rounded_direct(K)) {
    if (gemm_backend() == GemmBackend::Amx)
      return gemm_bf16_rounded_amx(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    return gemm_bf16_rounded_avx512(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
  }
  const WorkspaceAllocator allocator = workspace_allocator();
  const size_t bytes = static_cast<size_t>(M * N) * sizeof(float);
  const auto release = [&](float* p) { allocator.free(p, bytes); };
  const std::unique_ptr<float, decltype(release)> scratch(
      static_cast<float*>(allocator.allocate(bytes)), release);
  gemm_bf16(ta, tb, M, N, K, A, lda, B, ldb, 0.0f, scratch.get(), N);
  if (ldc == N) return fp32_to_bf16_array(C, scratch.get(), M * N);
  for (int64_t i = 0; i < M; ++i) fp32_to_bf16_array(C + i * ldc, scratch.get() + i * N, N);
}

bool gemm_backend_available(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::Avx512:
      return cpu_features().avx512;
    case GemmBackend::Amx:
      return amx_usable();
    default:
      return true;
  }
}

GemmBackend gemm_default_backend() {
  const char* env = std::getenv("CPUTRAIN_GEMM");
  if (env != nullptr && *env != '\0') {
    GemmBackend backend;
    if (!gemm_backend_from_name(env, &backend) || !gemm_backend_available(backend))
      throw std::invalid_argument(std::string("CPUTRAIN_GEMM=") + env +
                                  ": not a GEMM backend this CPU runs (" +
                                  gemm_available_backends() + ")");
    return backend;
  }
  if (amx_usable()) return GemmBackend::Amx;
  return cpu_features().avx512 ? GemmBackend::Avx512 : GemmBackend::Eigen;
}

void gemm_set_backend(GemmBackend backend) {
  if (!gemm_backend_available(backend))
    throw std::invalid_argument(std::string("GEMM backend ") +
                                std::string(gemm_backend_name(backend)) +
                                " needs a CPU feature this machine lacks");
  backend_slot().store(backend);
}

GemmBackend gemm_backend() {
  return backend_slot().load(std::memory_order_relaxed);
}

std::string_view gemm_backend_name(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::Reference:
      return "reference";
    case GemmBackend::Eigen:
      return "eigen";
    case GemmBackend::Avx512:
      return "avx512";
    case GemmBackend::Amx:
      return "amx";
    case GemmBackend::Onednn:
      return "onednn";
  }
  return "unknown";
}

bool gemm_backend_from_name(std::string_view name, GemmBackend* backend) {
  for (GemmBackend b : kAllBackends) {
    if (name == gemm_backend_name(b)) {
      *backend = b;
      return true;
    }
  }
  return false;
}

std::string gemm_available_backends() {
  std::string names;
  for (GemmBackend b : kAllBackends) {
    if (!gemm_backend_available(b)) continue;
    if (!names.empty()) names += ", ";
    names += gemm_backend_name(b);
  }
  return names;
}

}  // namespace cputrain::kernels
