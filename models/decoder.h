// The decoder of DESIGN.md, with the parts its architecture's description gives
// (models/architecture.h): token embedding (optionally scaled by sqrt(d_model)); per block
// pre-norm RMSNorm (its gains optionally held less 1) or LayerNorm with a bias, causal
// grouped-query attention (q, k, v optionally with biases; q and k optionally with per-head
// RMSNorm) with RoPE (optionally scaled, optionally left out of some layers), a second norm and a
// SwiGLU, GeGLU or GELU MLP, each with a residual, or attention and the MLP in parallel from the
// one norm (Phi-2); final norm; an LM head of its own (optionally with a bias) or tied to the
// embedding. Parameter names follow
// Meta's Llama checkpoints (tok_embeddings, layers.N.attention.wq, ...); tensor_names.h maps them
// to each format's.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/core/ops.h"
#include "engine/train/parameters.h"
#include "models/lora.h"
#include "models/model_config.h"

namespace cputrain {

class Communicator;
class IoQueue;
struct Architecture;

// How a model is built, beside its shape.
struct ModelOptions {
  // F32 or BF16 (set_compute_dtype). Known at construction, a BF16 model keeps its frozen GEMM
  // weights as bf16 alone (engine/train/parameters.h).
  DType compute_dtype = DType::F32;
  // Adapters on the blocks' projections (models/lora.h), none by default.
  LoraConfig lora;
  // Which parameters train, by name (DecoderModel::declare_parameters lists them); where unset,
  // all, or with adapters the adapters alone.
  std::function<bool(const std::string& name)> trainable;
  // Frozen weights read in place from a mapped model file (ParameterSet::map_in_place): where a
  // parameter's values are in the file and as what (InPlaceWeight). A BF16 one is read in place
  // by a BF16 model, as the GEMM weight's bf16 copy, and by either as a table read only row by
  // row (an untied embedding, Gemma 4's per-layer table: each row widened as it is looked up); a
  // quantised one by either, as a GEMM weight or the embedding table. `mapped_owner` keeps the file
  // mapped. While measuring, the data may be null.
  std::function<InPlaceWeight(const ParameterInfo& parameter)> in_place;
  std::shared_ptr<const void> mapped_owner;
  // --offload: the FP32 masters of a bf16 model's trained matrices, and AdamW's m and v, in state
  // files in `offload_dir` (ParameterSet::set_offload); while measuring the folder may be null.
  bool offload = false;
  std::shared_ptr<const OffloadDir> offload_dir;
  // A rank of a data-parallel job whose trainer shards AdamW (ZeRO-1): in bf16, the GEMM weights'
  // FP32 masters are held for this rank's shard alone (ParameterSet::set_shard).
  const Communicator* shard = nullptr;
};

class DecoderModel {
 public:
  explicit DecoderModel(const ModelConfig& config, const ModelOptions& options = {});

  // Declares the model's parameters into `params` without allocating them: their names,
  // shapes, decay and bf16-copy flags, as the model holds them (the memory budget sizes them so).
  // An adapter's follow its projection's: ".lora_a" (rank, in), ".lora_b" (out, rank).
  static void declare_parameters(const ModelConfig& config, ParameterSet& params,
                                 const LoraConfig& lora = {});

  const ModelConfig& config() const { return config_; }
  ParameterSet& parameters() { return params_; }
  const ParameterSet& parameters() const { return params_; }

  // Normal(0, 0.02) for matrices, 0.02 / sqrt(2 n_layers) for the output projections (wo, w2),
  // ones for norm gains, zeros for biases; deterministic in seed. Adapters as init_adapters.
  void init_weights(uint64_t seed);
  // The adapters alone, as PEFT begins them: A uniform in +-1/sqrt(in) (Kaiming's uniform with
  // a = sqrt(5)), B zero, so the model computes what its base does; deterministic in seed.
  void init_adapters(uint64_t seed);
  const LoraConfig& lora() const { return lora_; }
  // The seed of the adapters' dropout masks for the next forward pass (each layer and projection
  // draws its own from it); a fine-tune sets it per step and micro-batch, so a resumed run draws
  // the masks the uninterrupted one did.
  void set_dropout_seed(uint64_t seed) { dropout_seed_ = seed; }

  // F32 (the default) or BF16: the precision of loss, logits and last_logits (autograd.h,
  // ComputeDTypeGuard). BF16 gives the GEMM weights bf16 copies, kept current by AdamW (frozen
  // weights keep their FP32 masters unless the model was built for BF16).
  void set_compute_dtype(DType dtype);
  DType compute_dtype() const { return compute_dtype_; }
  // Gradient checkpointing (Checkpointing): each block (layer), or each block's MLP with its
  // norm (mlp), is a checkpoint region (autograd.h), which the backward pass recomputes one at a
  // time. Gradients are bitwise the same as without, but per layer in a model whose layers read
  // more than the layer before (Gemma 4's per-layer inputs and shared keys and values): there an
  // input several layers read sums its gradient's terms in another order.
  void set_checkpointing(Checkpointing level) { checkpointing_ = level; }
  void set_checkpointing(bool on) {
    set_checkpointing(on ? Checkpointing::Layer : Checkpointing::None);
  }
  Checkpointing checkpointing() const { return checkpointing_; }
  // For a base read in place from its mapped file (ModelOptions::in_place) that is larger
  // than the memory left to it: a thread reads each block's weights ahead of the forward and
  // backward passes, and the passes mark the blocks they are done with as the first pages to give
  // back (read_ahead). Not worth its cost where the file's pages stay in memory anyway (it walks
  // every mapped page twice a pass); nothing where no parameter is mapped. Off by default.
  void set_read_ahead(bool on);

  // inputs, targets (B, T) i32, T <= ctx -> mean cross-entropy, recorded for backward.
  Variable loss(const Tensor& inputs, const Tensor& targets);
  // inputs (B, T) -> logits (B, T, V), without recording anything.
  Tensor logits(const Tensor& inputs);
  // A fine-tuning batch: rows packed with several examples each (ops.h Packing; each example
  // attends within itself and takes RoPE positions from 0), targets below 0 carry no loss, and
  // the loss is the sum over the targets divided by `normalizer` (0: their count). The LM head
  // runs only on the positions with a target (set_head_on_every_position(true): on all of them,
  // those without a target then giving no loss and no gradient); the two give the same loss and
  // gradients bit for bit, but for the head's own weight gradient, which sums its terms in
  // another grouping.
  Variable loss(const Tensor& inputs, const Tensor& targets, std::shared_ptr<const Packing> packing,
                int64_t normalizer = 0);
  void set_head_on_every_position(bool on) { head_on_every_position_ = on; }
  // Of a batch as loss takes it: the log-probability of each target (positions with a target,
  // in order), recorded for backward (ops.h lm_head_log_probs). While measuring, as many as the
  // packing's measured_targets (0: every position).
  Variable target_log_probs(const Tensor& inputs, const Tensor& targets,
                            std::shared_ptr<const Packing> packing);
  // Off: the adapters are left out of every pass, which then computes what the base alone
  // computes, bit for bit (a preference loss's reference). On by default.
  void set_adapters_enabled(bool on) { adapters_on_ = on; }
  Tensor logits(const Tensor& inputs, std::shared_ptr<const Packing> packing);
  // inputs (B, T) -> logits of the last position only (B, V), without recording anything.
  Tensor last_logits(const Tensor& inputs);

  // Incremental decoding: the keys (after RoPE) and values of every layer for the positions
  // decoded so far, so each new token costs one pass over the cache instead of the whole
  // sequence again. A sliding-window layer's cache holds 2 x its window of rows (or ctx, if
  // fewer): the positions from first[l] on, in order; before it would overflow, the last
  // window - 1 positions move to its start. Other layers hold every position from 0.
  // A Gated DeltaNet layer's state between decoding calls: the convolutions' last inputs of q,
  // k and v ((1, channels, taps - 1) each) and the delta rule's state (1, Hv, dk, dv).
  struct LinearState {
    Tensor conv_q, conv_k, conv_v, delta;
  };
  // The caches of `batch` sequences decoded together, all at the same position: each layer's
  // keys and values (batch * rows, kv_dim), sequence b's rows from b * rows; the DeltaNet
  // states (batch, ...).
  struct KvCache {
    std::vector<Tensor> keys, values;  // per layer; empty in a DeltaNet or shared-KV layer
    std::vector<int64_t> first;        // per layer, the position of row 0 (every sequence's)
    std::vector<LinearState> linear;   // per layer; empty in an attention layer
    int64_t length = 0;
    int64_t batch = 1;
  };
  KvCache new_kv_cache(int64_t batch = 1) const;
  // A cache of `batch` sequences, each a copy of `one`'s single sequence (a prompt filled once
  // for several continuations).
  KvCache repeat_kv_cache(const KvCache& one, int64_t batch) const;
  // Keeps the sequences `keep` (increasing indices) of the cache, in that order: the batch of
  // the sequences still going.
  static void keep_sequences(KvCache& cache, const std::vector<int64_t>& keep);
  // Runs `tokens` through the model: of each of the cache's sequences, m tokens (tokens holds
  // sequence b's at b * m; m >= 1; positions cache.length ..; cache.length + m <= ctx). Appends
  // their keys and values to the cache and returns the logits (batch, V) of each sequence's last
  // one: what last_logits gives for each whole sequence so far. Each projection is one GEMM over
  // the batch's rows. Records nothing.
  Tensor decode(const std::vector<int32_t>& tokens, KvCache& cache);

 private:
  struct Block {
    int attention_norm, wq, wk, wv, wo;
    int ffn_norm = -1;     // -1 in a parallel block
    int w1 = -1;           // -1 without a gate
    int w3 = -1, w2 = -1;  // -1 in a mixture of experts
    // A mixture of experts' router (E, C) and experts (E, F, C; E, C, F), in the MLP's place;
    // -1 in a dense block. The gate and up in one (E, 2 F, C) where the file holds them so
    // (ModelConfig::experts_gate_up_fused): experts_w1 that, experts_w3 -1.
    int router = -1, experts_w1 = -1, experts_w3 = -1, experts_w2 = -1;
    // gpt-oss's router bias (E) and expert biases (E, F; E, F; E, C); -1 without.
    int router_bias = -1, experts_b1 = -1, experts_b3 = -1, experts_b2 = -1;
    int sinks = -1;  // attention's sinks (H); -1 without
    // Experts beside a dense MLP (ModelConfig::expert_ffn): the router's input scale (C), each
    // expert's output scale (E), the experts' norm before and after and the dense MLP's after
    // (C each); -1 without.
    int router_scale = -1, expert_scale = -1, moe_norm = -1, post_moe_norm = -1, post_mlp_norm = -1;
    // The shared expert's gate, up and down projections and its gate's projection (1, C); -1
    // without.
    int shared_w1 = -1, shared_w3 = -1, shared_w2 = -1, shared_gate = -1;
    int bq = -1, bk = -1, bv = -1;                     // the q, k, v biases; -1 without
    int bo = -1, b3 = -1, b2 = -1;                     // the o, up and down biases; -1 without
    int attention_norm_bias = -1, ffn_norm_bias = -1;  // LayerNorm's; -1 without
    int post_attention_norm = -1, post_ffw_norm = -1;  // -1 without
    int q_norm = -1, k_norm = -1;                      // the per-head norms of q and k; -1 without
    int wg = -1;                                       // attention's output gate; -1 without
    // A Gated DeltaNet layer's parts beside wq, wk, wv and wo (its q, k, v and out projections);
    // -1 in an attention layer.
    int wz = -1, wa = -1, wb = -1, conv_q = -1, conv_k = -1, conv_v = -1;
    int dt_bias = -1, a_log = -1, linear_norm = -1;
    bool linear = false;
    int64_t layer = 0;
    // The layer whose keys and values it attends with (ModelConfig::kv_layer): its own, or a
    // shared-KV layer's source, whose wk and wv it then has none of.
    int64_t kv_from = 0;
    bool kv_source = false;  // a later layer's kv_from
    // Gemma 4's per-layer input's gate (P, C), projection (C, P) and norm (C), and the layer's
    // output scale (1); -1 without.
    int pl_gate = -1, pl_proj = -1, pl_norm = -1, layer_scale = -1;
    // Each projection's adapter (by Projection), -1 without; a gated attention's gate takes q's
    // A and a B of its own (q_proj holds both). In a mixture of experts gate, up and down's are
    // in expert_lora_a / _b (A (E, r, in), B (E, out, r); gate, up, down), and shared_lora_a / _b
    // the shared expert's (its gate, up and down).
    std::array<int, kProjectionCount> lora_a = unadapted();
    std::array<int, kProjectionCount> lora_b = unadapted();
    int lora_b_gate = -1;
    std::array<int, 3> expert_lora_a{-1, -1, -1}, expert_lora_b{-1, -1, -1};
    std::array<int, 3> shared_lora_a{-1, -1, -1}, shared_lora_b{-1, -1, -1};
    static std::array<int, kProjectionCount> unadapted() {
      std::array<int, kProjectionCount> a;
      a.fill(-1);
      return a;
    }
  };
  struct Layout {
    int tok_embeddings = 0;
    // Per-layer embeddings: the table (V, L P), the projection of the embedding (L P, C) and
    // its norm (P); -1 without.
    int pl_table = -1, pl_model_proj = -1, pl_proj_norm = -1;
    std::vector<Block> blocks;
    int norm = 0;
    int norm_bias = -1;
    int output = 0;
    int output_bias = -1;
  };
  static Layout declare(const ModelConfig& config, const LoraConfig& lora, ParameterSet& params);
  // (B, T, C) hidden states after the final norm; with `packing`, of packed rows.
  Variable hidden(const Tensor& inputs, std::shared_ptr<const Packing> packing = nullptr);
  // Attention of q, k, v (after RoPE): the whole-sequence op in training and evaluation, the
  // KV cache in decoding.
  // `sinks`: the layer's attention sinks (H), undefined without.
  using Attend =
      std::function<Variable(const Variable& q, const Variable& k, const Variable& v,
                             const kernels::AttentionOptions& options, const Variable& sinks)>;
  // The RoPE angles of the positions: the global layers', and the windowed layers' (the same
  // tensor where they share a base).
  struct RopeTables {
    Tensor global, windowed;
    // Packed rows: each position's index within its sequence (B, T, I32), where Gated DeltaNet
    // layers start each sequence's state and convolution afresh; undefined otherwise.
    Tensor positions;
  };
  // One block on x, whose positions take their RoPE angles from the rows of its layer's table.
  // With `per_row`, a table holds one of T rows for each row of x (ops.h rope).
  // `extra`: the block's per-layer input (B, T, P) where the model has them, then for a
  // shared-KV layer in training the input of its kv_from layer, whose keys and values it
  // computes again from it (the same values that layer attends with); in decoding it reads them
  // from the cache instead.
  Variable block_forward(const Block& block, const Variable& x, const RopeTables& tables,
                         bool per_row, const Attend& attend, LinearState* state = nullptr,
                         const std::vector<Variable>& extra = {});
  // Each layer's per-layer input (B, T, P) of the batch's tokens and embeddings x.
  std::vector<Variable> per_layer_inputs(const Tensor& inputs, const Variable& x);
  // A Gated DeltaNet layer's mixing of the normed input h (packed rows: `positions`, as
  // RopeTables holds them); decoding from and into `state`.
  Variable linear_attention(const Block& block, const Variable& h, const Tensor& positions,
                            LinearState* state);
  // A block's MLP on x, normed first unless `normed`, the post-MLP norm included: the dense
  // MLP, the experts, or (Gemma 4 26B-A4B) both side by side.
  Variable mlp_forward(const Block& block, const Variable& x, bool normed) const;
  // The dense MLP on its norm's output g, the down projection included.
  Variable dense_mlp(const Block& block, Variable g) const;
  // The experts (and a shared expert) on their norm's output g, routed by the router's input r.
  Variable experts_forward(const Block& block, const Variable& g, const Variable& r) const;
  // The logits (B, V) of the last of the T positions of each sequence in h (B, T, d_model).
  Tensor last_position_logits(const Tensor& h, int64_t B, int64_t T);
  const Variable& p(int index) const { return params_.var(index); }
  // Where the base is read in place from its mapped file: starts bringing the pages of block
  // `index`'s weights (of the LM head's for index == the block count) into memory on the
  // read-ahead thread (populate_mapped), while the caller computes with the block before
  // (forward) or after (backward); with `release`, marks them as the first to give back once a
  // pass is done with them (release_mapped). Nothing for an index past the head, or where no
  // parameter is mapped.
  void read_ahead(size_t index, bool release = false) const;
  // What the token embeddings are multiplied by: sqrt(d_model) where the architecture scales
  // them, else 1.
  float embedding_scale() const;
  // The architecture's norm of x: RMSNorm with the gains `weight`, or LayerNorm with them and
  // the bias `bias_index`.
  Variable norm(const Variable& x, int weight, int bias_index) const;
  // Logits soft-capped in place where the model caps them (ModelConfig::final_softcap).
  Tensor capped(Tensor logits) const;
  // The parameter at index, or an undefined Variable for -1 (no bias).
  Variable bias(int index) const;
  // x W^T (+ bias) of the block's projection `which`, plus its adapter's update where it has one
  // (`lora_b`: a B other than the projection's own, the gate's, which shares q's A); `rounded` as
  // linear_rounded where it has none.
  Variable project(const Block& block, Projection which, int weight, int bias_index,
                   const Variable& x, bool rounded = false, int lora_b = -1) const;
  // The same with the adapter (lora_a, lora_b), -1 without, its dropout mask the one of
  // `mask`, a slot of the block's (Projection, then one each for the shared expert's three).
  Variable adapted(const Block& block, size_t mask, int weight, int bias_index, int lora_a,
                   int lora_b, const Variable& x, bool rounded) const;
  // The seed of dropout mask `mask` of a block (a projection's, or the shared expert's).
  uint64_t dropout_seed(const Block& block, size_t mask) const;

  ModelConfig config_;
  const Architecture* arch_;  // config_'s description
  LoraConfig lora_;
  uint64_t dropout_seed_ = 0;
  ParameterSet params_;
  int tok_embeddings_ = 0;
  int pl_table_ = -1, pl_model_proj_ = -1, pl_proj_norm_ = -1;
  // The gains of 1 of Gemma 4's v norm: of the global layers' heads, of the windowed ones'.
  Tensor v_gain_, v_gain_swa_;
  std::vector<Block> blocks_;
  int norm_ = 0;
  int norm_bias_ = -1;
  int output_ = 0;  // tok_embeddings_ where the embeddings are tied
  int output_bias_ = -1;
  Tensor rope_table_;      // (ctx, R/2, 2): R the rotated dimensions
  Tensor rope_table_swa_;  // the windowed layers': rope_table_ where they share its base
  DType compute_dtype_ = DType::F32;
  Checkpointing checkpointing_ = Checkpointing::None;
  bool head_on_every_position_ = false;
  bool adapters_on_ = true;
  // The thread that reads mapped weights ahead (set_read_ahead); null when off.
  std::shared_ptr<IoQueue> read_ahead_queue_;
  // final_from_[i]: once block i's backward is done (i == the block count: the head's), every
  // gradient from this offset on is final (ParameterSet::gradients_final_from); -1 where the
  // layout puts another's gradient in that range.
  std::vector<int64_t> final_from_;
};

}  // namespace cputrain
