// What the differentiable ops (ops.h and the families' op files beside it) share: activations
// allocated as such, the compute mode, the values an op reads and saves, and the gradients a
// backward kernel writes.
#pragma once

#include <initializer_list>
#include <vector>

#include "engine/core/autograd.h"
#include "engine/core/hash.h"
#include "engine/core/tensor.h"
#include "kernels/gemm/gemm.h"

namespace cputrain::op_support {

// A tensor counted as activations.
Tensor new_activation(const Shape& shape, DType dtype = DType::F32);
// std::invalid_argument(what) unless ok: a caller's mistake, not a user's.
void require(bool ok, const char* what);
// Whether ops compute in bf16 mode (compute_dtype()).
bool bf16_mode();
// Whether kernels run: not while measuring (engine/core/memory.h), where tensors have no elements
// and an op makes only its allocations.
bool computing();
// The FP32 value of an op's input. In bf16 mode an output only GEMMs consume may hold its bf16
// rounding alone (swiglu's); an op that computes on FP32 values cannot take it.
const Tensor& fp32_value(const Variable& x);
// What an op saves of an input for its backward: the value itself, or in bf16 mode its bf16
// rounding (shared with every other op that saves the same input).
Tensor saved(const Variable& x);

// The gradients one backward kernel writes (a null cell: scratch), and whether it adds onto
// them. It overwrites, so nothing needs zero-filling, where every cell is still empty and no two
// are the same (swiglu(x, x)); else the empty ones are zero-filled and it accumulates.
struct KernelGrads {
  std::vector<Tensor> grads;
  bool accumulate = false;
};
struct GradSlot {
  const GradRef* cell;
  Shape shape;  // of the scratch where the cell is null
};
KernelGrads kernel_grads(std::initializer_list<GradSlot> slots);

// A gradient for a kernel that adds into it: the cell's (zeros on first use), or zeroed scratch
// of `shape` where nothing wants it.
Tensor summed_gradient(const GradRef& cell, const Shape& shape);

// Where a kernel that overwrites its output writes the gradient of `cell` (of `shape`): the
// cell's own tensor where it holds nothing yet, else (or where nothing wants it) scratch, which
// add_to_cell() then adds into the cell's.
class OverwrittenGradient {
 public:
  OverwrittenGradient(const GradRef& cell, const Shape& shape);
  float* data() const { return target_.f32(); }
  void add_to_cell() const;

 private:
  Tensor target_, cell_;
};

// The bf16 rounding of an FP32 tensor, as workspace.
Tensor to_bf16(const Tensor& t);
// What an op multiplies of a weight: in bf16 mode its bf16 rounding (the parameter's copy), else
// its FP32 value; a quantised weight as it is held, either way (its products dequantise it panel
// by panel, to bf16 or FP32 as x is).
Tensor weight_operand(const Variable& w, bool bf16);
// 2 M N K.
double gemm_flops(int64_t M, int64_t N, int64_t K);
// While measuring, the allocations a GEMM of these sizes makes without computing it: its buffers
// grow to what the product needs (kernels::gemm_buffer_bytes), in the order it takes them (the
// widenings of bf16 operands first, then the packed panels of B and of A). `thread` -1: the
// product runs on the thread that runs the step, on all threads; t >= 0: it runs inside a
// parallel pass on that pass's thread t alone, with that thread's buffers
// (kernels::GemmSerialScope).
void measure_gemm(bool bf16, kernels::Transpose ta, kernels::Transpose tb, int64_t M, int64_t N,
                  int64_t K, int thread = -1);

// While measuring, the allocations of a product with a quantised W (kernels/quant/quant.h): the
// dequantised panel of W, then the GEMM's buffers for its product with the first panel (the
// largest). The few-row forward (decoding) allocates none of them. Forward: Y (M, N) = X W^T;
// else dX (M, K) = dY W, W (N, K).
// `thread` as for measure_gemm.
void measure_quant_gemm(bool bf16, bool forward, int64_t M, int64_t N, int64_t K, int thread = -1);

// A saved tensor as FP32, for kernels that compute in FP32: itself, or its widening from bf16,
// counted as `category`.
Tensor as_f32(const Tensor& t, MemoryCategory category = MemoryCategory::Workspace);

// s u in the compute precision (bf16 in bf16 mode, else FP32): what the products take of a
// small FP32 tensor (a low-rank adapter's (M x r) intermediate), counted as `category`.
Tensor scaled_operand(const Tensor& u, float s, bool bf16, MemoryCategory category);

// PEFT's lora_dropout: element i of an adapter's input is kept (and scaled by 1 / (1 - p)) where
// a hash of (seed, i) is at or above p of its range, so a backward pass draws the mask again.
uint32_t dropout_threshold(float p);
inline bool dropout_keeps(uint64_t seed, int64_t i, uint32_t threshold) {
  return static_cast<uint32_t>(splitmix64(seed + static_cast<uint64_t>(i)) >> 32) >= threshold;
}
// x with dropout p applied, in x's precision, as workspace.
Tensor dropped_out(const Tensor& x, float p, uint64_t seed);

}  // namespace cputrain::op_support
