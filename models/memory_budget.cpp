#include "models/memory_budget.h"

#include <algorithm>
#include <vector>

#include "engine/block_cache.h"
#include "engine/ops.h"
#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "models/llama.h"

namespace cputrain {
namespace {

using kernels::Transpose;

int64_t rounded(int64_t bytes) { return (bytes + 63) / 64 * 64; }  // as memory_allocate

// Live and peak bytes per category, with reference-counted entries: an entry is freed when its
// last holder lets go, as a tensor's storage is. Alongside, the allocator's block cache
// (engine/block_cache.h) on the same sequence, by size alone: what live + kept bytes reach is
// what the process holds.
class Ledger {
 public:
  int alloc(MemoryCategory c, int64_t bytes) {
    entries_.push_back({c, rounded(bytes), 1});
    const int64_t n = entries_.back().bytes;
    char block;
    if (n >= Cache::kMinBytes)
      cache_.take(n, live_total_, peak_total_, &block, [](char, int64_t) {});
    change(c, n);
    return static_cast<int>(entries_.size()) - 1;
  }
  int retain(int id) {
    ++entries_[id].refs;
    return id;
  }
  void release(int id) {
    if (id < 0) return;
    if (--entries_[id].refs == 0) {
      const int64_t n = entries_[id].bytes;
      change(entries_[id].category, -n);
      if (n >= Cache::kMinBytes) cache_.put(char{}, n, live_total_, peak_total_);
      held_most_ = std::max(held_most_, live_total_ + cache_.cached());
    }
  }
  void change(MemoryCategory c, int64_t bytes) {
    const int i = static_cast<int>(c);
    live_[i] += bytes;
    live_total_ += bytes;
    peak_[i] = std::max(peak_[i], live_[i]);
    peak_total_ = std::max(peak_total_, live_total_);
    held_most_ = std::max(held_most_, live_total_ + cache_.cached());
  }
  const std::array<int64_t, kMemoryCategoryCount>& peak() const { return peak_; }
  int64_t peak_total() const { return peak_total_; }
  // The most live + cached bytes since restart_held().
  int64_t held_most() const { return held_most_; }
  void restart_held() { held_most_ = live_total_ + cache_.cached(); }

 private:
  using Cache = BlockCache<char>;  // sizes only: a kept block is nothing but its size
  struct Entry {
    MemoryCategory category;
    int64_t bytes;
    int refs;
  };
  std::vector<Entry> entries_;
  std::array<int64_t, kMemoryCategoryCount> live_{}, peak_{};
  int64_t live_total_ = 0, peak_total_ = 0, held_most_ = 0;
  Cache cache_;
};

// An activation Variable: its FP32 value and, once taken, its bf16 rounding.
struct Var {
  int value = -1;
  int bf16 = -1;
  int64_t elems = 0;
};

// What one block's ops keep on the tape for backward (ids into the ledger).
struct BlockTape {
  int n1_x = -1, n1_rstd = -1, wq_x = -1, wk_x = -1, wv_x = -1, att_q = -1, att_k = -1;
  int att_v = -1, att_y = -1, att_lse = -1, wo_x = -1, n2_x = -1, n2_rstd = -1, w1_x = -1;
  int w3_x = -1, sw_gate = -1, sw_up = -1, w2_x = -1;
};

// Replays the allocations of LlamaModel::loss and backward (models/llama.cpp, engine/ops.cpp,
// engine/autograd.cpp) for one micro-batch of n tokens (batch x ctx in training).
class StepReplay {
 public:
  StepReplay(Ledger& ledger, const LlamaConfig& c, const BudgetOptions& o, int64_t n)
      : L_(ledger),
        bf16_(o.dtype == DType::BF16),
        n_(n),
        C_(c.d_model),
        F_(c.ffn),
        V_(c.vocab),
        heads_(c.n_heads),
        layers_(c.n_layers),
        checkpoint_(o.checkpoint) {}

  void run() {
    Var x = act(n_ * C_);  // embedding
    std::vector<BlockTape> tapes;
    std::vector<int> region_inputs;
    for (int64_t l = 0; l < layers_; ++l) {
      Var out;
      if (checkpoint_) {
        out = block_forward(x, false, nullptr);
        region_inputs.push_back(L_.retain(x.value));
      } else {
        tapes.emplace_back();
        out = block_forward(x, true, &tapes.back());
      }
      drop(x);
      x = out;
    }
    // Final norm, then lm_head_cross_entropy: the gradient by the logits (kept for backward),
    // one chunk of FP32 logits in bf16 mode and the per-row losses.
    int fn_x = -1, fn_rstd = -1;
    Var h = norm_forward(x, true, &fn_x, &fn_rstd);
    drop(x);
    cache(h);
    const int head_x = L_.retain(bf16_ ? h.bf16 : h.value);
    const int64_t rows = std::min(n_, lm_head_chunk_rows(V_));
    const int dl = L_.alloc(MemoryCategory::Activations, n_ * V_ * (bf16_ ? 2 : 4));
    const int chunk = bf16_ ? work(rows * V_ * 4) : -1;
    const int losses = work(n_ * 4);
    const int loss = L_.alloc(MemoryCategory::Activations, 4);
    L_.release(losses);
    L_.release(chunk);
    drop(h);

    // Backward.
    const int dloss = work(4);
    const int dh = work(n_ * C_ * 4);
    L_.release(dl);
    L_.release(head_x);
    int dx = work(n_ * C_ * 4);
    L_.release(fn_x);
    L_.release(fn_rstd);
    L_.release(dh);
    for (int64_t l = layers_ - 1; l >= 0; --l) {
      if (!checkpoint_) {
        dx = block_backward(tapes[l], dx, true);
        continue;
      }
      // The region reruns the block on its input, recording, then runs that tape.
      Var xr{L_.retain(region_inputs[l]), -1, n_ * C_};
      BlockTape t;
      Var yr = block_forward(xr, true, &t);
      const int dy_inner = work(n_ * C_ * 4);  // backward(yr, dy) copies dy into yr's gradient
      const int dx_inner = block_backward(t, dy_inner, false);
      const int dx_outer = work(n_ * C_ * 4);  // copied into the input's gradient
      drop(yr);
      L_.release(dy_inner);
      drop(xr);
      L_.release(dx_inner);
      L_.release(region_inputs[l]);
      L_.release(dx);
      dx = dx_outer;
    }
    L_.release(dx);  // the embedding's backward
    L_.release(loss);
    L_.release(dloss);
  }

  // LlamaModel::loss under NoGradGuard (Trainer::evaluate): nothing saved, a checkpointed block
  // run as it is, and the LM head's FP32 logits a chunk of rows at a time in either dtype.
  void evaluate() {
    Var x = act(n_ * C_);  // embedding
    for (int64_t l = 0; l < layers_; ++l) {
      Var out = block_forward(x, false, nullptr);
      drop(x);
      x = out;
    }
    Var h = norm_forward(x, false, nullptr, nullptr);
    drop(x);
    cache(h);
    const int64_t rows = std::min(n_, lm_head_chunk_rows(V_));
    const int chunk = work(rows * V_ * 4);
    const int losses = work(n_ * 4);
    const int lse = work(rows * 4);
    const int loss = L_.alloc(MemoryCategory::Activations, 4);
    L_.release(lse);
    L_.release(losses);
    L_.release(chunk);
    drop(h);
    L_.release(loss);
  }

 private:
  Var act(int64_t elems) { return Var{L_.alloc(MemoryCategory::Activations, elems * 4), -1, elems}; }
  // The output of an op that in bf16 mode writes only its bf16 rounding (rmsnorm, rope, swiglu,
  // attention with bf16 products).
  Var rounded_act(int64_t elems) {
    return bf16_ ? Var{-1, L_.alloc(MemoryCategory::Activations, elems * 2), elems} : act(elems);
  }
  int work(int64_t bytes) { return L_.alloc(MemoryCategory::Workspace, bytes); }
  void drop(Var& v) {
    L_.release(v.value);
    L_.release(v.bf16);
    v = Var{};
  }
  // Variable::bf16_value of an op output: converted once, kept with the variable.
  void cache(Var& v) {
    if (bf16_ && v.bf16 < 0) v.bf16 = L_.alloc(MemoryCategory::Activations, v.elems * 2);
  }
  // What an op saves of an input (ops.cpp, saved()): the value, or its cached bf16 rounding.
  int saved(Var& v) {
    cache(v);
    return L_.retain(bf16_ ? v.bf16 : v.value);
  }
  // A linear layer's backward: dy rounded to bf16 (bf16 mode, unless its producer wrote only the
  // rounding), then the input's gradient.
  int linear_backward(int64_t dy_elems, int64_t dx_elems, bool dy_rounded, int existing_dx = -1) {
    const int dyb = bf16_ && !dy_rounded ? work(dy_elems * 2) : -1;
    const int dx = existing_dx >= 0 ? existing_dx : work(dx_elems * 4);
    L_.release(dyb);
    return dx;
  }

  // rmsnorm: its output and FP32 reciprocal norms; with grad it saves its input and those.
  Var norm_forward(Var& x, bool grad, int* saved_x, int* saved_rstd) {
    Var y = rounded_act(n_ * C_);
    const int rstd = L_.alloc(MemoryCategory::Activations, n_ * 4);
    if (grad) {
      *saved_x = saved(x);
      *saved_rstd = rstd;
    } else {
      L_.release(rstd);
    }
    return y;
  }
  // linear: its output, then its input's bf16 rounding for the GEMM; with grad it saves that
  // input (or its rounding).
  Var linear_forward(Var& x, int64_t out_elems, bool grad, int* saved_x) {
    Var y = act(out_elems);
    cache(x);
    if (grad) *saved_x = L_.retain(bf16_ ? x.bf16 : x.value);
    return y;
  }

  // linear_rounded: in bf16 mode only the output's rounding, through an FP32 scratch where the
  // GEMM cannot round in its registers (kernels::gemm_bf16_rounded_direct).
  Var linear_rounded_forward(Var& x, int64_t out_elems, bool grad, int* saved_x) {
    if (!bf16_) return linear_forward(x, out_elems, grad, saved_x);
    Var y = rounded_act(out_elems);
    cache(x);
    if (!kernels::gemm_bf16_rounded_direct(C_)) L_.release(work(out_elems * 4));
    if (grad) *saved_x = L_.retain(x.bf16);
    return y;
  }

  // LlamaModel::block_forward.
  Var block_forward(Var& x, bool grad, BlockTape* t) {
    const int64_t nc = n_ * C_, nf = n_ * F_;
    BlockTape unused;
    if (t == nullptr) t = &unused;
    Var a;
    {
      Var q, k, v;
      {
        Var h = norm_forward(x, grad, &t->n1_x, &t->n1_rstd);
        Var pre = linear_forward(h, nc, grad, &t->wq_x);
        q = rounded_act(nc);  // rope
        drop(pre);
        pre = linear_forward(h, nc, grad, &t->wk_x);
        k = rounded_act(nc);
        drop(pre);
        v = linear_rounded_forward(h, nc, grad, &t->wv_x);
        drop(h);
      }
      // attention: output (with bf16 products, only its rounding) and log-sum-exp, then q, k, v
      // as saved (bf16 widened for the kernel where it has no bf16 products)
      Var y = bf16_ && kernels::attention_bf16_native() ? rounded_act(nc) : act(nc);
      const int lse = L_.alloc(MemoryCategory::Activations, n_ * heads_ * 4);
      cache(q);
      cache(k);
      cache(v);
      if (bf16_ && !kernels::attention_bf16_native()) {
        const int widened[3] = {work(nc * 4), work(nc * 4), work(nc * 4)};
        for (int id : widened) L_.release(id);
      }
      if (grad) {
        t->att_q = L_.retain(bf16_ ? q.bf16 : q.value);
        t->att_k = L_.retain(bf16_ ? k.bf16 : k.value);
        t->att_v = L_.retain(bf16_ ? v.bf16 : v.value);
        t->att_y = saved(y);
        t->att_lse = lse;
      } else {
        L_.release(lse);
      }
      Var wo = linear_forward(y, nc, grad, &t->wo_x);
      a = act(nc);  // add(x, wo)
      drop(wo);
      drop(y);
      drop(v);
      drop(k);
      drop(q);
    }
    Var f;
    {
      Var g = norm_forward(a, grad, &t->n2_x, &t->n2_rstd);
      Var gate = linear_forward(g, nf, grad, &t->w1_x);
      Var up = linear_forward(g, nf, grad, &t->w3_x);
      f = rounded_act(nf);  // swiglu, with the roundings of gate and up saved below
      if (grad) {
        t->sw_gate = saved(gate);
        t->sw_up = saved(up);
      }
      drop(up);
      drop(gate);
      drop(g);
    }
    Var w2 = linear_forward(f, nc, grad, &t->w2_x);
    Var out = act(nc);  // add(a, w2)
    drop(w2);
    drop(f);
    drop(a);
    return out;
  }

  // The block's tape run in reverse from dout, the gradient of its output; returns the
  // gradient of its input. release_dout: whether the block's add is the last holder of dout.
  // In bf16 mode the gradient of a linear layer's output is written as its rounding alone by
  // its only contribution where the kernel can (add, swiglu, rope; not attention's dv).
  int block_backward(const BlockTape& t, int dout, bool release_dout) {
    const int64_t nc = n_ * C_, nf = n_ * F_;
    const int64_t g = bf16_ ? 2 : 4;  // bytes per element of such a gradient
    const int da = work(nc * 4);
    int dy = work(nc * g);  // add(a, w2): both gradients, w2's output's rounded
    if (release_dout) L_.release(dout);
    const int df = linear_backward(nc, nf, true);  // w2
    L_.release(t.w2_x);
    L_.release(dy);
    const int dgate = work(nf * g), dup = work(nf * g);  // swiglu (reads bf16 as saved)
    L_.release(t.sw_gate);
    L_.release(t.sw_up);
    L_.release(df);
    const int dg = linear_backward(nf, nc, true);  // w3, recorded last
    L_.release(t.w3_x);
    L_.release(dup);
    linear_backward(nf, nc, true, dg);  // w1
    L_.release(t.w1_x);
    L_.release(dgate);
    L_.release(t.n2_x);
    L_.release(t.n2_rstd);
    L_.release(dg);
    const int dx = work(nc * 4);  // add(x, wo): both gradients
    dy = work(nc * g);
    L_.release(da);
    const int dattn = linear_backward(nc, nc, true);  // wo
    L_.release(t.wo_x);
    L_.release(dy);
    const int dq = work(nc * 4), dk = work(nc * 4), dv = work(nc * 4);  // attention
    if (bf16_ && !kernels::attention_bf16_native()) {
      const int widened[4] = {work(nc * 4), work(nc * 4), work(nc * 4), work(nc * 4)};
      for (int id : widened) L_.release(id);
    }
    for (int id : {t.att_q, t.att_k, t.att_v, t.att_y, t.att_lse, dattn}) L_.release(id);
    const int dh = linear_backward(nc, nc, false);  // wv
    L_.release(t.wv_x);
    L_.release(dv);
    const int dk_pre = work(nc * g);  // rope k
    L_.release(dk);
    linear_backward(nc, nc, true, dh);  // wk
    L_.release(t.wk_x);
    L_.release(dk_pre);
    const int dq_pre = work(nc * g);  // rope q
    L_.release(dq);
    linear_backward(nc, nc, true, dh);  // wq
    L_.release(t.wq_x);
    L_.release(dq_pre);
    L_.release(t.n1_x);
    L_.release(t.n1_rstd);
    L_.release(dh);
    return dx;
  }

  Ledger& L_;
  const bool bf16_;
  const int64_t n_, C_, F_, V_, heads_, layers_;
  const bool checkpoint_;
};

// The four GEMM buffers at the largest size any of the step's products asks.
int64_t gemm_buffers(const LlamaConfig& c, const BudgetOptions& o) {
  const int64_t n = o.batch * o.ctx, C = c.d_model, F = c.ffn, V = c.vocab;
  const bool bf16 = o.dtype == DType::BF16;
  std::array<size_t, 4> most{};
  const int64_t layers[][2] = {{C, C}, {F, C}, {C, F}, {V, C}};  // (out, in)
  // The LM head's forward runs on chunks of rows (lm_head_cross_entropy).
  const int64_t head_rows = std::min(n, lm_head_chunk_rows(V));
  for (size_t i = 0; i < most.size(); ++i)
    most[i] = std::max(most[i], kernels::gemm_buffer_bytes(bf16, Transpose::No, Transpose::Yes,
                                                           head_rows, V, C)[i]);
  for (const auto& w : layers) {
    const int64_t out = w[0], in = w[1];
    for (const auto& need :
         {kernels::gemm_buffer_bytes(bf16, Transpose::No, Transpose::Yes, n, out, in),
          kernels::gemm_buffer_bytes(bf16, Transpose::No, Transpose::No, n, in, out),
          kernels::gemm_buffer_bytes(bf16, Transpose::Yes, Transpose::No, out, in, n)}) {
      for (size_t i = 0; i < most.size(); ++i) most[i] = std::max(most[i], need[i]);
    }
  }
  int64_t total = 0;
  for (size_t b : most) total += static_cast<int64_t>(b);
  return total;
}

}  // namespace

MemoryBudget memory_budget(const LlamaConfig& c, const BudgetOptions& o) {
  Ledger ledger;
  // The model's parameter table, declared but not allocated.
  ParameterSet params;
  LlamaModel::declare_parameters(c, params);
  const int64_t elems = params.numel(), copies = params.bf16_copy_numel();
  ledger.alloc(MemoryCategory::Weights, elems * 4);
  ledger.alloc(MemoryCategory::Gradients, elems * 4);
  ledger.alloc(MemoryCategory::OptimizerState, elems * 4);  // m
  ledger.alloc(MemoryCategory::OptimizerState, elems * 4);  // v
  if (o.dtype == DType::BF16) ledger.alloc(MemoryCategory::Bf16Weights, copies * 2);
  // Held for the whole run: the RoPE table (ctx x head_dim), the trainer's token buffers,
  // and the GEMM buffers at their steady size.
  ledger.alloc(MemoryCategory::Workspace, c.ctx * c.head_dim() * 4);
  ledger.alloc(MemoryCategory::Workspace, o.batch * o.ctx * 4);
  ledger.alloc(MemoryCategory::Workspace, o.batch * o.ctx * 4);
  const int64_t gemm = gemm_buffers(c, o);
  ledger.change(MemoryCategory::Workspace, gemm);

  // Steps repeat the same allocations; the block cache settles within a few, so the third is
  // what every later step holds. Where the run evaluates, a validation pass follows each step
  // (evaluate_loss: its token buffers, then micro-batches of batch windows, the last of what
  // is left): the blocks of its sizes take the place of some of the step's in the cache.
  const int64_t n = o.batch * o.ctx;
  const auto step = [&] {
    StepReplay(ledger, c, o, n).run();
    if (o.eval_windows <= 0) return;
    const int in = ledger.alloc(MemoryCategory::Workspace, n * 4);
    const int tgt = ledger.alloc(MemoryCategory::Workspace, n * 4);
    for (int64_t first = 0; first < o.eval_windows; first += o.batch)
      StepReplay(ledger, c, o, std::min(o.batch, o.eval_windows - first) * o.ctx).evaluate();
    ledger.release(tgt);
    ledger.release(in);
  };
  step();
  step();
  ledger.restart_held();
  step();

  MemoryBudget b;
  b.peak_bytes = ledger.peak();
  b.step_peak_bytes = ledger.peak_total();
  b.cache_headroom_bytes = std::max<int64_t>(0, ledger.held_most() - ledger.peak_total());
  b.gemm_buffer_bytes = gemm;
  b.corpus_bytes = o.corpus_tokens * 4;
  b.runtime_bytes = kRuntimeBytes;
  return b;
}

}  // namespace cputrain
