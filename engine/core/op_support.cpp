#include "engine/core/op_support.h"

#include <algorithm>
#include <array>
#include <optional>
#include <stdexcept>

#include "engine/core/hash.h"
#include "engine/core/memory.h"
#include "engine/core/profiler.h"
#include "kernels/cpu/bf16.h"
#include "kernels/ops/vector_add.h"
#include "kernels/quant/quant.h"

namespace cputrain::op_support {

Tensor new_activation(const Shape& shape, DType dtype) {
  return Tensor::empty(shape, dtype, MemoryCategory::Activations);
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

bool bf16_mode() {
  return compute_dtype() == DType::BF16;
}

bool computing() {
  return !measuring();
}

const Tensor& fp32_value(const Variable& x) {
  require(x.value().dtype() == DType::F32, "an op on FP32 values given a bf16-only activation");
  return x.value();
}

Tensor to_bf16(const Tensor& t) {
  Tensor b = Tensor::empty(t.shape(), DType::BF16, MemoryCategory::Workspace);
  profiler::Scope scope("to bf16", profiler::Pass::Enclosing);
  if (computing()) kernels::fp32_to_bf16_array(b.bf16(), t.f32(), t.numel());
  return b;
}

Tensor weight_operand(const Variable& w, bool bf16) {
  if (dtype_quantized(w.value().dtype())) return w.value();
  return bf16 ? w.bf16_value() : w.value();
}

double gemm_flops(int64_t M, int64_t N, int64_t K) {
  return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
}

void measure_gemm(bool bf16, kernels::Transpose ta, kernels::Transpose tb, int64_t M, int64_t N,
                  int64_t K, int thread) {
  std::optional<kernels::GemmSerialScope> serial;  // a parallel pass's thread: its own plan
  if (thread >= 0) serial.emplace();
  const std::array<size_t, 4> need = kernels::gemm_buffer_bytes(bf16, ta, tb, M, N, K);
  serial.reset();
  for (const int buffer : {2, 3, 0, 1})
    if (need[buffer] > 0)
      measure_buffer(buffer, need[buffer], MemoryCategory::Workspace, std::max(thread, 0));
}

void measure_quant_gemm(bool bf16, bool forward, int64_t M, int64_t N, int64_t K, int thread) {
  if (forward && M <= kernels::kQuantRowsM) return;
  measure_buffer(kernels::kGemmQuantPanel, kernels::quant_panel_bytes(bf16, N, K),
                 MemoryCategory::Workspace, std::max(thread, 0));
  const int64_t n = std::min(N, kernels::quant_panel_rows(K));
  if (forward)
    measure_gemm(bf16, kernels::Transpose::No, kernels::Transpose::Yes, M, n, K, thread);
  else
    measure_gemm(bf16, kernels::Transpose::No, kernels::Transpose::No, M, K, n, thread);
}

Tensor saved(const Variable& x) {
  return bf16_mode() ? x.bf16_value() : x.value();
}

KernelGrads kernel_grads(std::initializer_list<GradSlot> slots) {
  KernelGrads k;
  for (auto a = slots.begin(); a != slots.end(); ++a) {
    if (*a->cell && (*a->cell)->tensor().defined()) k.accumulate = true;
    for (auto b = slots.begin(); b != a; ++b)
      if (*a->cell && *a->cell == *b->cell) k.accumulate = true;
  }
  for (const GradSlot& slot : slots) {
    const GradRef& cell = *slot.cell;
    float beta = 0.0f;
    if (!cell)
      k.grads.push_back(k.accumulate
                            ? Tensor::zeros(slot.shape, DType::F32, MemoryCategory::Workspace)
                            : Tensor::empty(slot.shape, DType::F32, MemoryCategory::Workspace));
    else
      k.grads.push_back(k.accumulate ? cell->get_or_zeros() : cell->get_for_accumulate(&beta));
  }
  return k;
}

Tensor summed_gradient(const GradRef& cell, const Shape& shape) {
  return cell ? cell->get_or_zeros() : Tensor::zeros(shape, DType::F32, MemoryCategory::Workspace);
}

OverwrittenGradient::OverwrittenGradient(const GradRef& cell, const Shape& shape) {
  float beta = 0.0f;
  if (cell) {
    const Tensor& held = cell->get_for_accumulate(&beta);
    if (beta == 0.0f) {
      target_ = held;
      return;
    }
    cell_ = held;
  }
  target_ = Tensor::empty(shape, DType::F32, MemoryCategory::Workspace);
}

void OverwrittenGradient::add_to_cell() const {
  if (cell_.defined() && computing())
    kernels::vector_accumulate(cell_.f32(), target_.f32(), target_.numel());
}

Tensor as_f32(const Tensor& t, MemoryCategory category) {
  if (t.dtype() == DType::F32) return t;
  Tensor f = Tensor::empty(t.shape(), DType::F32, category);
  profiler::Scope scope("to fp32", profiler::Pass::Enclosing);
  if (computing()) kernels::bf16_to_fp32_array(f.f32(), t.bf16(), t.numel());
  return f;
}

// s u in the compute precision: what the products take of a small FP32 (M x r) tensor.
Tensor scaled_operand(const Tensor& u, float s, bool bf16, MemoryCategory category) {
  Tensor out = Tensor::empty(u.shape(), bf16 ? DType::BF16 : DType::F32, category);
  if (!computing()) return out;
  const int64_t n = u.numel();
  if (bf16) {
    for (int64_t i = 0; i < n; ++i) out.bf16()[i] = kernels::fp32_to_bf16(s * u.f32()[i]);
  } else {
    kernels::vector_scale(out.f32(), u.f32(), s, n);
  }
  return out;
}

uint32_t dropout_threshold(float p) {
  return static_cast<uint32_t>(std::min(4294967295.0, static_cast<double>(p) * 4294967296.0));
}

// x with dropout applied (the update's input), in x's precision.
Tensor dropped_out(const Tensor& x, float p, uint64_t seed) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), MemoryCategory::Workspace);
  if (!computing()) return out;
  const uint32_t threshold = dropout_threshold(p);
  const float keep = 1.0f / (1.0f - p);
  const int64_t n = x.numel();
  if (x.dtype() == DType::BF16) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      out.bf16()[i] = dropout_keeps(seed, i, threshold)
                          ? kernels::fp32_to_bf16(kernels::bf16_to_fp32(x.bf16()[i]) * keep)
                          : uint16_t{0};
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      out.f32()[i] = dropout_keeps(seed, i, threshold) ? x.f32()[i] * keep : 0.0f;
  }
  return out;
}

}  // namespace cputrain::op_support
