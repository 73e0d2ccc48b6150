// oneDNN behind the GEMM interface: dnnl_sgemm for FP32 (row-major, as ours), and a cached
// matmul primitive for BF16 inputs with FP32 output. A comparison for the benchmarks and a
// second path on hardware our kernels are not verified on.
#include <cstdlib>
#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "kernels/gemm/gemm_isa.h"

namespace cputrain::kernels {
namespace {

using dnnl::memory;

struct Bf16Key {
  bool ta, tb;
  int64_t M, N, K, lda, ldb, ldc;
  float beta;
  bool operator<(const Bf16Key& o) const {
    return std::tie(ta, tb, M, N, K, lda, ldb, ldc, beta) <
           std::tie(o.ta, o.tb, o.M, o.N, o.K, o.lda, o.ldb, o.ldc, o.beta);
  }
};

struct Bf16Matmul {
  memory::desc a, b, c, scratchpad;
  dnnl::matmul primitive;
};

// oneDNN 2.6's AMX matmul died on SIGILL (tilezero with no tile configuration) on the Xeon with
// AMX we ran on (family 6 model 207), also in a program of its own with the tile data permission
// granted; so oneDNN is kept to AVX512_CORE_BF16 unless the user names an ISA
// (ONEDNN_MAX_CPU_ISA). Must run before oneDNN generates any code.
void limit_isa() {
  static const bool done = [] {
    if (!std::getenv("ONEDNN_MAX_CPU_ISA") && !std::getenv("DNNL_MAX_CPU_ISA"))
      dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16);
    return true;
  }();
  (void)done;
}

dnnl::engine& cpu_engine() {
  limit_isa();
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

}  // namespace

bool onednn_bf16_supported() {
  static const bool supported = [] {
    try {
      const memory::desc a({2, 2}, memory::data_type::bf16, memory::dims{2, 1});
      const memory::desc c({2, 2}, memory::data_type::f32, memory::dims{2, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, c), cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;  // this oneDNN has no bf16 matmul for this CPU
    }
  }();
  return supported;
}

void gemm_f32_onednn(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return detail::scale_c(C, M, N, ldc, beta);
  limit_isa();
  const dnnl_status_t status =
      dnnl_sgemm(ta == Transpose::Yes ? 'T' : 'N', tb == Transpose::Yes ? 'T' : 'N', M, N, K, 1.0f,
                 A, lda, B, ldb, beta, C, ldc);
  if (status != dnnl_success) throw std::runtime_error("dnnl_sgemm failed");
}

void gemm_bf16_onednn(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                      const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float beta,
                      float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return detail::scale_c(C, M, N, ldc, beta);
  static std::mutex mutex;
  static std::map<Bf16Key, Bf16Matmul> cache;
  const Bf16Key key{ta == Transpose::Yes, tb == Transpose::Yes, M, N, K, lda, ldb, ldc, beta};
  Bf16Matmul* mm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it == cache.end()) {
      Bf16Matmul m;
      m.a = memory::desc({M, K}, memory::data_type::bf16,
                         key.ta ? memory::dims{1, lda} : memory::dims{lda, 1});
      m.b = memory::desc({K, N}, memory::data_type::bf16,
                         key.tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
      m.c = memory::desc({M, N}, memory::data_type::f32, memory::dims{ldc, 1});
      // The caller's scratchpad: a primitive executes on any thread, also on several at once
      // inside a parallel pass, which the library's shared scratchpad does not allow.
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      if (beta != 0.0f) {
        dnnl::post_ops ops;
        ops.append_sum(beta);
        attr.set_post_ops(ops);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(m.a, m.b, m.c), attr, cpu_engine());
      m.scratchpad = pd.scratchpad_desc();
      m.primitive = dnnl::matmul(pd);
      it = cache.emplace(key, std::move(m)).first;
    }
    mm = &it->second;
  }
  thread_local dnnl::stream stream(cpu_engine());
  memory a(mm->a, cpu_engine(), const_cast<uint16_t*>(A));
  memory b(mm->b, cpu_engine(), const_cast<uint16_t*>(B));
  memory c(mm->c, cpu_engine(), C);
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < mm->scratchpad.get_size()) scratch.resize(mm->scratchpad.get_size());
  memory pad(mm->scratchpad, cpu_engine(), scratch.data());
  mm->primitive.execute(
      stream,
      {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, pad}});
  stream.wait();
}

}  // namespace cputrain::kernels
