#include "kernels/gemm.h"

#include <Eigen/Core>
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
#include "kernels/gemm_driver.h"
#include "kernels/gemm_isa.h"
#include "kernels/workspace.h"

namespace cputrain::kernels {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMap = Eigen::Map<const RowMajor, Eigen::Unaligned, Eigen::OuterStride<>>;
using MutMap = Eigen::Map<RowMajor, Eigen::Unaligned, Eigen::OuterStride<>>;

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

std::atomic<size_t> workspace_bytes{0};

// Double-precision triple loop over elements read through `load`.
template <typename T, typename Load>
void reference_product(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const T* A,
                       int64_t lda, const T* B, int64_t ldb, float beta, float* C, int64_t ldc,
                       Load load) {
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double sum = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = load(at ? A[k * lda + i] : A[i * lda + k]);
        const double b = load(bt ? B[j * ldb + k] : B[k * ldb + j]);
        sum += a * b;
      }
      float& c = C[i * ldc + j];
      c = beta == 0.0f ? static_cast<float>(sum)
                       : static_cast<float>(sum + static_cast<double>(beta) * c);
    }
  }
}

}  // namespace

namespace detail {

std::atomic<int64_t> fused_rows_shared{0};
std::atomic<int64_t> fused_rows_a_shared{0};

namespace {

// Each buffer remembers the allocator it came from, in case another is installed later.
struct Buffer {
  float* data = nullptr;
  size_t bytes = 0;
  WorkspaceFree release = nullptr;
  void reset() {
    if (data != nullptr) {
      release(data, bytes);
      workspace_bytes -= bytes;
    }
    data = nullptr;
    bytes = 0;
  }
  ~Buffer() { reset(); }
};

Buffer* thread_buffers() {
  thread_local Buffer buffers[4];
  return buffers;
}

}  // namespace

float* gemm_pack_buffer(size_t floats, int which) {
  Buffer& b = thread_buffers()[which];
  if (b.bytes < floats * sizeof(float)) {
    b.reset();
    const WorkspaceAllocator allocator = workspace_allocator();
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    b.data = static_cast<float*>(allocator.allocate(bytes));
    b.bytes = bytes;
    b.release = allocator.free;
    workspace_bytes += bytes;
  }
  return b.data;
}

}  // namespace detail

void gemm_f32_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                        int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                        int64_t ldc) {
  reference_product(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc,
                    [](float x) { return static_cast<double>(x); });
}

void gemm_bf16_reference(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                         const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                         float* C, int64_t ldc) {
  reference_product(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc,
                    [](uint16_t x) { return static_cast<double>(bf16_to_fp32(x)); });
}

void gemm_f32_eigen(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                    int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return detail::scale_c(C, M, N, ldc, beta);
  MutMap c(C, M, N, Eigen::OuterStride<>(ldc));
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
  // op(A) and op(B) as expressions over row-major maps of the stored matrices.
  const ConstMap a(A, at ? K : M, at ? M : K, Eigen::OuterStride<>(lda));
  const ConstMap b(B, bt ? N : K, bt ? K : N, Eigen::OuterStride<>(ldb));
  auto run = [&](const auto& opa, const auto& opb) {
    if (beta == 0.0f) {
      c.noalias() = opa * opb;
    } else {
      if (beta != 1.0f) c *= beta;
      c.noalias() += opa * opb;
    }
  };
  if (!at && !bt) run(a, b);
  if (!at && bt) run(a, b.transpose());
  if (at && !bt) run(a.transpose(), b);
  if (at && bt) run(a.transpose(), b.transpose());
}

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

namespace {
std::atomic<bool> fused_on{true};
std::atomic<bool> direct_on{true};
// Two: the rows of C a thread computes on the fused path do not stay in L2 from one K block to
// the next (its packed B and the A read past them take it), so each K block reads and writes
// them from L3 or memory; two blocks as one halve that. (On Zen 4, alternating call by call on
// the mega weight gradients, FP32 and bf16: level with 1 in calm runs, 1.4-9% faster in spells
// where another tenant loads the memory; 4 was up to 8.7% slower on 1536 x 512 x 4096, whose
// B, then 2 MiB a thread, is read again for each of its 110 rows.)
std::atomic<int> fused_k_blocks{2};
}  // namespace

void gemm_set_fused(bool on) {
  fused_on.store(on);
}

bool gemm_fused() {
  return fused_on.load(std::memory_order_relaxed);
}

void gemm_set_direct(bool on) {
  direct_on.store(on);
}

bool gemm_direct() {
  return direct_on.load(std::memory_order_relaxed);
}

void gemm_set_fused_k_blocks(int blocks) {
  if (blocks < 1 || blocks > 16)
    throw std::invalid_argument("gemm_set_fused_k_blocks: " + std::to_string(blocks) +
                                " is not a count of K blocks from 1 to 16");
  fused_k_blocks.store(blocks);
}

int gemm_fused_k_blocks() {
  return fused_k_blocks.load(std::memory_order_relaxed);
}

int64_t gemm_fused_rows_shared() {
  return detail::fused_rows_shared.load(std::memory_order_relaxed);
}

int64_t gemm_fused_rows_a_shared() {
  return detail::fused_rows_a_shared.load(std::memory_order_relaxed);
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

size_t gemm_workspace_bytes() {
  return workspace_bytes.load();
}

void gemm_release_buffers() {
  for (int i = 0; i < 4; ++i) detail::thread_buffers()[i].reset();
}

std::array<size_t, 4> gemm_buffer_bytes(bool bf16, Transpose ta, Transpose tb, int64_t M, int64_t N,
                                        int64_t K) {
  std::array<size_t, 4> bytes{};
  if (M <= 0 || N <= 0 || K <= 0) return bytes;
  auto rounded = [](int64_t floats) {
    return (static_cast<size_t>(floats) * sizeof(float) + 63) / 64 * 64;
  };
  const GemmBackend backend = gemm_backend();
  std::array<int64_t, 2> packs{};
  if (bf16 && backend != GemmBackend::Reference && !gemm_bf16_native(backend)) {
    const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
    bytes[2] = rounded((at ? K : M) * (at ? M : K));
    bytes[3] = rounded((bt ? N : K) * (bt ? K : N));
    bf16 = false;  // then the FP32 GEMM runs
  }
  if (bf16 && backend == GemmBackend::Amx) packs = gemm_bf16_amx_pack_floats(ta, tb, M, N, K);
  if (bf16 && backend == GemmBackend::Avx512) packs = gemm_bf16_avx512_pack_floats(ta, tb, M, N, K);
  if (!bf16 && (backend == GemmBackend::Avx512 || backend == GemmBackend::Amx))
    packs = gemm_f32_avx512_pack_floats(ta, tb, M, N, K);
  if (packs[0] > 0) bytes[0] = rounded(packs[0]);
  if (packs[1] > 0) bytes[1] = rounded(packs[1]);
  return bytes;
}

}  // namespace cputrain::kernels
