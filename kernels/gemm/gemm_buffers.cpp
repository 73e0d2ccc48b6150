// The GEMM's buffers: each calling thread keeps five (packed panels of B and of A, the FP32
// widenings of bf16 operands, and the quantised products' dequantised panel,
// kernels/quant/quant.h), grown to the largest need met and kept from call to call, from the
// workspace allocator (kernels/cpu/workspace.h).
#include <omp.h>

#include <array>
#include <atomic>
#include <cstdint>

#include "kernels/cpu/workspace.h"
#include "kernels/gemm/gemm_isa.h"
#include "kernels/gemm/gemm_plan.h"

namespace cputrain::kernels {
namespace {

std::atomic<size_t> workspace_bytes{0};

}  // namespace

namespace detail {

namespace {

// The bytes a buffer of `floats` takes: whole 64-byte lines.
size_t buffer_bytes(size_t floats) {
  return (floats * sizeof(float) + 63) / 64 * 64;
}

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
  thread_local Buffer buffers[kGemmBuffers];
  return buffers;
}

}  // namespace

float* gemm_pack_buffer(size_t floats, int which) {
  Buffer& b = thread_buffers()[which];
  if (b.bytes < floats * sizeof(float)) {
    b.reset();
    const WorkspaceAllocator allocator = workspace_allocator();
    const size_t bytes = buffer_bytes(floats);
    b.data = static_cast<float*>(allocator.allocate(bytes));
    b.bytes = bytes;
    b.release = allocator.free;
    workspace_bytes += bytes;
  }
  return b.data;
}

}  // namespace detail

size_t gemm_workspace_bytes() {
  return workspace_bytes.load();
}

void gemm_release_buffers() {
  for (int i = 0; i < kGemmBuffers; ++i) detail::thread_buffers()[i].reset();
}

namespace {
thread_local bool serial_scope = false;
}  // namespace

GemmSerialScope::GemmSerialScope() : was_(serial_scope) {
  serial_scope = true;
}

GemmSerialScope::~GemmSerialScope() {
  serial_scope = was_;
}

bool gemm_serial() {
  return serial_scope || omp_in_parallel() != 0;
}

std::array<size_t, 4> gemm_buffer_bytes(bool bf16, Transpose ta, Transpose tb, int64_t M, int64_t N,
                                        int64_t K) {
  std::array<size_t, 4> bytes{};
  if (M <= 0 || N <= 0 || K <= 0) return bytes;
  auto rounded = [](int64_t floats) { return detail::buffer_bytes(static_cast<size_t>(floats)); };
  if (bf16 && gemm_backend() != GemmBackend::Reference && !gemm_bf16_native(gemm_backend()) &&
      !gemm_bf16_widens_in_packing()) {
    const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
    bytes[2] = rounded((at ? K : M) * (at ? M : K));
    bytes[3] = rounded((bt ? N : K) * (bt ? K : N));
    bf16 = false;  // then the FP32 GEMM runs
  }
  const std::array<int64_t, 2> packs = gemm_pack_floats(bf16, ta, tb, M, N, K);
  if (packs[0] > 0) bytes[0] = rounded(packs[0]);
  if (packs[1] > 0) bytes[1] = rounded(packs[1]);
  return bytes;
}

size_t gemm_low_rank_buffer_bytes(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                                  int64_t r) {
  if (!gemm_bf16_low_rank_fused(ta, tb, M, N, K, r)) return 0;
  return detail::buffer_bytes(static_cast<size_t>(gemm_bf16_avx512_low_rank_floats(M, N, r)));
}

}  // namespace cputrain::kernels
