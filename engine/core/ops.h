// Differentiable ops on Variables. Each computes its forward with a kernel from kernels/ and,
// when a gradient is needed, records its backward right there (see autograd.h).
// Activations are (B, T, C) row-major; attention views (B, T, C) as (B, T, H, C / H).
#pragma once

#include <memory>
#include <vector>

#include "engine/core/autograd.h"
#include "kernels/attention/attention.h"

namespace cputrain {

// table (V, C), tokens (B, T) i32 -> (B, T, C): each token's row times scale (Gemma's sqrt(C)).
Variable embedding(const Variable& table, const Tensor& tokens, float scale = 1.0f);
// x (..., K), w (N, K), b (N) or undefined -> x w^T + b (..., N). In bf16 mode the products take
// the bf16 roundings of x and w, and b's gradient sums the rounding of the output's gradient,
// as the weight's does.
Variable linear(const Variable& x, const Variable& w, const Variable& b = Variable());
// linear, for an output only GEMMs and attention read: in bf16 mode its value is its bf16
// rounding alone (rounded in the GEMM's registers where gemm_bf16_rounded_direct and there is
// no bias), the same bits as linear's output rounded; ops on FP32 values refuse it. In fp32
// mode, linear.
Variable linear_rounded(const Variable& x, const Variable& w, const Variable& b = Variable());
// A projection with a low-rank adapter, x W^T + b + scale (x A^T) B^T, with a (r, K) and
// bm (N, r): linear's product, and the update accumulated into it by one more (no elementwise
// pass over the output). In bf16 mode the products take bf16 roundings, as linear's do.
// With dropout p > 0 (PEFT's lora_dropout) the update takes x with each element zeroed with
// probability p and the others scaled by 1 / (1 - p): the mask a hash of (dropout_seed, element)
// draws, so the backward draws it again rather than keeping it.
Variable lora_linear(const Variable& x, const Variable& w, const Variable& b, const Variable& a,
                     const Variable& bm, float scale, float dropout = 0.0f,
                     uint64_t dropout_seed = 0);
// x (..., C), w (C) -> x / sqrt(mean(x^2) + eps) * (w + offset): offset 0, or 1 for weights
// held as Gemma's Hugging Face files hold them. In bf16 mode its value is its bf16 rounding
// alone (a GEMM's input).
Variable rmsnorm(const Variable& x, const Variable& w, float eps, float offset = 0.0f);
// add(a, b) and rmsnorm of the sum in one pass over the rows (a residual into the next norm):
// the sum (FP32) and its norm, each with the values and gradients of the two ops apart.
struct SumAndNorm {
  Variable sum;
  Variable normed;
};
SumAndNorm add_rmsnorm(const Variable& a, const Variable& b, const Variable& w, float eps,
                       float offset = 0.0f);
// x (..., H * D), w (D) -> each of the H heads of D normalised as rmsnorm does, FP32 in either
// compute mode (Qwen3's norms of q and k, whose output RoPE takes).
Variable head_rmsnorm(const Variable& x, const Variable& w, float eps, float offset = 0.0f);
// x (..., C), w and b (C) -> (x - mean) / sqrt(var + eps) * w + b over the last dimension
// (LayerNorm with a bias, Phi-2's); in bf16 mode its bf16 rounding alone, as rmsnorm's.
Variable layernorm(const Variable& x, const Variable& w, const Variable& b, float eps);
// x (B, T, H * D) seen as (B, T, H, D); table from kernels::rope_table with at least T rows;
// pairs (x[2j], x[2j+1]), or with half_split (x[j], x[j + D/2]) (kernels/ops/rope.h). With
// `per_row`, table holds B such tables of T rows, one per row of x (packed rows, whose
// sequences each begin at position 0). With rot_dims R < D, only each head's first R elements
// rotate (pairs within them; the table's rows hold R/2 angles) and the rest pass (partial rotary).
Variable rope(const Variable& x, const Tensor& table, int64_t n_heads, bool half_split,
              bool per_row = false, int64_t rot_dims = 0);
// Rows of a (B, T) batch that each hold several sequences one after another: per row, the
// lengths of its sequences in order, summing to T.
struct Packing {
  std::vector<std::vector<int64_t>> lengths;
  // While measuring (the memory budget), how many of the batch's positions have a target: the
  // most any batch of the run has (0: every position).
  int64_t measured_targets = 0;
};
// q (B, T, H * D), k and v (B, T, KVH * D) -> causal softmax(q k^T / sqrt(D)) v per query head,
// (B, T, H * D); query head h attends with key/value head h / (H / KVH) (grouped-query
// attention; KVH = H is multi-head). With `packing`, each query attends only within its own
// sequence, as if that sequence were a row of its own.
// `options` (kernels/attention/attention.h): a scale of the scores other than 1/sqrt(D),
// soft-capping, a sliding window (none where it is no shorter than T), in either mode.
// `sinks` (H), where defined: each head's attention sink (AttentionOptions::sinks), FP32, which
// takes its gradient, -sum over the head's rows of exp(sink - lse) (dout . out).
Variable attention(const Variable& q, const Variable& k, const Variable& v, int64_t n_heads,
                   int64_t n_kv_heads, std::shared_ptr<const Packing> packing = nullptr,
                   kernels::AttentionOptions options = {}, const Variable& sinks = Variable());
// silu(gate) * up, elementwise. In bf16 mode its value is its bf16 rounding only (what a GEMM
// takes of it; ops on FP32 values refuse it), and it rounds gate and up for its backward in the
// same pass.
Variable swiglu(const Variable& gate, const Variable& up);
// gelu(gate) * up with GELU's tanh approximation (kernels/ops/swiglu.h), as swiglu (Gemma's MLP).
Variable geglu(const Variable& gate, const Variable& up);
// gelu(x) alone, tanh approximation, as swiglu's output (Phi-2's MLP).
Variable gelu(const Variable& x);
// a + b, equal shapes.
Variable add(const Variable& a, const Variable& b);
// x * s, elementwise, for a constant s.
Variable scale(const Variable& x, float s);
// x * w[0] for a parameter w of one element (Gemma 4's layer output scale); w's gradient the
// sum of x * dy.
Variable scale_by(const Variable& x, const Variable& w);
// Columns [start, start + width) of x (..., K) -> (..., width); backward writes their gradient
// into those columns of x's (zeros into the others where it is the first to write).
Variable column_slice(const Variable& x, int64_t start, int64_t width);
// What attention computes on for x, in FP32: x's value, or in bf16 mode its bf16 rounding
// widened (the value the ops save and share).
Tensor attention_input(const Variable& x);
// Rows `rows` of x (..., K), ascending and distinct, -> (n, K) in x's value's dtype (FP32, or in
// bf16 mode a GEMM input's rounding). Backward writes their gradient back to those rows of x's
// and zeros to the others: the gradient of a loss that reads x's other rows nowhere. While
// measuring only the count of `rows` is read.
Variable gather_rows(const Variable& x, std::vector<int64_t> rows);
// logits (..., V), targets i32 with numel = rows of logits -> mean cross-entropy, shape (1).
Variable cross_entropy(const Variable& logits, const Tensor& targets);
// cross_entropy(linear(x, w), targets) without the FP32 logits ever existing whole: chunk_rows
// rows at a time (0: lm_head_chunk_rows) it computes their logits and loss and, with grad, the
// loss's gradient by them for an output gradient of 1, (softmax - one-hot) / rows, kept for
// backward in the compute precision (bf16 in bf16 mode, as linear rounds its output gradient).
// Backward scales it by the output gradient and runs linear's two products.
// A target below 0 is no target: its row has no loss and no gradient, and the loss is the sum
// over the others divided by `normalizer` (0: their count; a fine-tune that accumulates
// micro-batches gives the count of the whole step's targets, so that every target weighs the
// same).
// With b (V) defined, the logits are x w^T + b (Phi-2's head) and b's gradient sums the rows of
// the logits' gradient. With softcap > 0 the loss is of softcap * tanh(logits / softcap) (Gemma
// 2's final soft-capping), its gradient through the tanh.
Variable lm_head_cross_entropy(const Variable& x, const Variable& w, const Tensor& targets,
                               int64_t chunk_rows = 0, int64_t normalizer = 0,
                               const Variable& b = Variable(), float softcap = 0.0f);
// The log-probability of each row's target under softmax(x w^T (+ b), soft-capped as above),
// shape (rows of x): lm_head_cross_entropy's losses negated, row by row, with its chunks and
// memory. A row without a target (below 0) gives 0 and no gradient. Backward scales each row's
// gradient by the logits by its own output gradient (a preference loss weighs each sequence's
// tokens by what its sum does to the loss).
Variable lm_head_log_probs(const Variable& x, const Variable& w, const Tensor& targets,
                           int64_t chunk_rows = 0, const Variable& b = Variable(),
                           float softcap = 0.0f);
// Rows per chunk of lm_head_cross_entropy for a vocabulary of V: about 32 MiB of FP32 logits,
// and at least 512 rows, enough that packing the weight again for each chunk costs little next
// to the product (a 150k vocabulary's weight is over 250 MB); at least 256 where the weight is
// `kept`, packed once for all chunks (bf16 mode where the GEMM keeps it,
// kernels::gemm_bf16_kept_b_bytes), which then holds a packed copy of the weight beside them.
int64_t lm_head_chunk_rows(int64_t V, bool kept = false);

}  // namespace cputrain
