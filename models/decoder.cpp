#include "models/decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "engine/core/deltanet_ops.h"
#include "engine/core/hash.h"
#include "engine/core/moe_ops.h"
#include "engine/core/ops.h"
#include "engine/io/mapped_file.h"
#include "engine/io/offload.h"
#include "kernels/attention/attention.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/rope.h"
#include "models/architecture.h"
#include "models/lora.h"

namespace cputrain {

DecoderModel::Layout DecoderModel::declare(const ModelConfig& config, const LoraConfig& lora,
                                           ParameterSet& params) {
  const int64_t V = config.vocab, C = config.d_model;
  const Architecture& arch = architecture_of(config);
  const bool layer_norm = arch.norm == Norm::LayerNorm, dense = arch.dense_biases;
  // A bias of `n` named `name`, or -1 where `present` is false.
  const auto bias_of = [&params](bool present, const std::string& name, int64_t n) {
    return present ? params.add(name, Shape{n}, false) : -1;
  };
  Layout layout;
  // Tied: the embedding is also the LM head's weight, a GEMM operand (bf16 copy).
  layout.tok_embeddings =
      params.add("tok_embeddings.weight", Shape{V, C}, true, config.tie_embeddings);
  const int64_t P = config.per_layer_dim;
  if (P > 0) {
    // Looked up row by row, as the embedding.
    layout.pl_table =
        params.add("per_layer.embeddings.weight", Shape{V, config.n_layers * P}, true);
    layout.pl_model_proj =
        params.add("per_layer.model_proj.weight", Shape{config.n_layers * P, C}, true, true);
    layout.pl_proj_norm = params.add("per_layer.proj_norm.weight", Shape{P}, false);
  }
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    const int64_t F = config.ffn_width(i);
    const int64_t Q = config.q_dim(i), KV = config.kv_dim(i), D = config.head_size(i);
    Block b;
    b.layer = i;
    b.kv_from = config.kv_layer(i);
    const bool own_kv = b.kv_from == i;
    b.attention_norm = params.add(l + "attention_norm.weight", Shape{C}, false);
    b.attention_norm_bias = bias_of(layer_norm, l + "attention_norm.bias", C);
    b.linear = config.linear_layer(i);
    if (b.linear) {
      // Gated DeltaNet in attention's place (engine/core/deltanet_ops.h).
      const int64_t LQ = config.linear_qk_dim(), LV = config.linear_v_dim();
      const int64_t Hv = config.linear_value_heads, K = config.linear_conv;
      const std::string d = l + "linear.";
      b.wq = params.add(d + "wq.weight", Shape{LQ, C}, true, true);
      b.wk = params.add(d + "wk.weight", Shape{LQ, C}, true, true);
      b.wv = params.add(d + "wv.weight", Shape{LV, C}, true, true);
      b.wz = params.add(d + "wz.weight", Shape{LV, C}, true, true);
      b.wb = params.add(d + "wb.weight", Shape{Hv, C}, true, true);
      b.wa = params.add(d + "wa.weight", Shape{Hv, C}, true, true);
      b.conv_q = params.add(d + "conv_q.weight", Shape{LQ, K}, true);
      b.conv_k = params.add(d + "conv_k.weight", Shape{LQ, K}, true);
      b.conv_v = params.add(d + "conv_v.weight", Shape{LV, K}, true);
      b.dt_bias = params.add(d + "dt_bias.weight", Shape{Hv}, false);
      b.a_log = params.add(d + "a_log.weight", Shape{Hv}, false);
      b.linear_norm = params.add(d + "gain.weight", Shape{config.linear_value_dim}, false);
      b.wo = params.add(d + "wo.weight", Shape{C, LV}, true, true);
    } else {
      b.wq = params.add(l + "attention.wq.weight", Shape{Q, C}, true, true);
      b.wk = own_kv ? params.add(l + "attention.wk.weight", Shape{KV, C}, true, true) : -1;
      b.wv = config.own_v(i) ? params.add(l + "attention.wv.weight", Shape{KV, C}, true, true) : -1;
      if (config.attn_output_gate)
        b.wg = params.add(l + "attention.wg.weight", Shape{Q, C}, true, true);
      if (config.qkv_bias) {
        b.bq = params.add(l + "attention.wq.bias", Shape{Q}, false);
        b.bk = own_kv ? params.add(l + "attention.wk.bias", Shape{KV}, false) : -1;
        b.bv = config.own_v(i) ? params.add(l + "attention.wv.bias", Shape{KV}, false) : -1;
      }
      if (config.qk_norm) {
        b.q_norm = params.add(l + "attention.q_norm.weight", Shape{D}, false);
        b.k_norm = own_kv ? params.add(l + "attention.k_norm.weight", Shape{D}, false) : -1;
      }
      b.wo = params.add(l + "attention.wo.weight", Shape{C, Q}, true, true);
      b.bo = bias_of(dense || arch.attn_out_bias, l + "attention.wo.bias", C);
      if (arch.attn_sinks)
        b.sinks = params.add(l + "attention.sinks.weight", Shape{config.n_heads}, false);
    }
    if (arch.post_norms)
      b.post_attention_norm = params.add(l + "post_attention_norm.weight", Shape{C}, false);
    if (!arch.parallel_block) {
      b.ffn_norm = params.add(l + "ffn_norm.weight", Shape{C}, false);
      b.ffn_norm_bias = bias_of(layer_norm, l + "ffn_norm.bias", C);
    }
    if (config.moe()) {
      const int64_t E = config.n_experts, Fe = config.expert_width();
      const std::string m = l + "feed_forward.";
      b.router = params.add(m + "router.weight", Shape{E, C}, true, true);
      // A GGUF file's gate and up in one tensor (ffn_gate_up_exps) are one parameter, read in
      // place as the file holds them.
      if (config.experts_gate_up_fused) {
        b.experts_w1 = params.add(m + "experts.w13.weight", Shape{E, 2 * Fe, C}, true, true);
      } else {
        b.experts_w1 = params.add(m + "experts.w1.weight", Shape{E, Fe, C}, true, true);
        b.experts_w3 = params.add(m + "experts.w3.weight", Shape{E, Fe, C}, true, true);
      }
      b.experts_w2 = params.add(m + "experts.w2.weight", Shape{E, C, Fe}, true, true);
      if (arch.moe_biases) {
        b.router_bias = params.add(m + "router.bias", Shape{E}, false);
        b.experts_b1 = params.add(m + "experts.w1.bias", Shape{E, Fe}, false);
        b.experts_b3 = params.add(m + "experts.w3.bias", Shape{E, Fe}, false);
        b.experts_b2 = params.add(m + "experts.w2.bias", Shape{E, C}, false);
      }
      if (config.experts_beside_mlp()) {
        // Gemma 4's: the router's input scale, each expert's output scale, the experts' norm
        // before and after, and the dense MLP's norm after.
        b.router_scale = params.add(m + "router_scale.weight", Shape{C}, false);
        b.expert_scale = params.add(m + "expert_scale.weight", Shape{E}, false);
        b.moe_norm = params.add(l + "moe_norm.weight", Shape{C}, false);
        b.post_moe_norm = params.add(l + "post_moe_norm.weight", Shape{C}, false);
        b.post_mlp_norm = params.add(l + "post_mlp_norm.weight", Shape{C}, false);
      }
      if (config.shared_expert_ffn > 0) {
        const int64_t S = config.shared_expert_ffn;
        b.shared_w1 = params.add(m + "shared.w1.weight", Shape{S, C}, true, true);
        b.shared_w3 = params.add(m + "shared.w3.weight", Shape{S, C}, true, true);
        b.shared_w2 = params.add(m + "shared.w2.weight", Shape{C, S}, true, true);
        b.shared_gate = params.add(m + "shared_gate.weight", Shape{1, C}, true, true);
      }
    }
    if (!config.moe() || config.experts_beside_mlp()) {
      if (arch.mlp != Mlp::Gelu)
        b.w1 = params.add(l + "feed_forward.w1.weight", Shape{F, C}, true, true);
      b.w3 = params.add(l + "feed_forward.w3.weight", Shape{F, C}, true, true);
      b.b3 = bias_of(dense, l + "feed_forward.w3.bias", F);
      b.w2 = params.add(l + "feed_forward.w2.weight", Shape{C, F}, true, true);
      b.b2 = bias_of(dense, l + "feed_forward.w2.bias", C);
    }
    if (arch.post_norms) b.post_ffw_norm = params.add(l + "post_ffw_norm.weight", Shape{C}, false);
    if (P > 0) {
      b.pl_gate = params.add(l + "per_layer.gate.weight", Shape{P, C}, true, true);
      b.pl_proj = params.add(l + "per_layer.proj.weight", Shape{C, P}, true, true);
      b.pl_norm = params.add(l + "per_layer.norm.weight", Shape{C}, false);
    }
    if (arch.layer_output_scale)
      b.layer_scale = params.add(l + "layer_scale.weight", Shape{1}, false);
    if (lora.active()) {
      // A mixture's router; its experts' adapters (after) are one A and B of each expert.
      const int weights[kProjectionCount] = {b.wq, b.wk, b.wv, b.wo, b.w1,    b.w3,
                                             b.w2, b.wz, b.wb, b.wa, b.router};
      for (int j = 0; j < kProjectionCount; ++j) {
        // A projection the block does not have (a gate without a gated MLP) takes none.
        if (!lora.on(static_cast<Projection>(j)) || weights[j] < 0) continue;
        const ParameterInfo& w = params.infos()[static_cast<size_t>(weights[j])];
        const std::string base = w.name.substr(0, w.name.size() - std::string("weight").size());
        const auto k = static_cast<size_t>(j);
        // The parts of a fused projection share its A (models/lora.h fused_lora_a).
        const std::string a = fused_lora_a(config, base + "lora_a");
        b.lora_a[k] = params.find(a);
        if (b.lora_a[k] < 0) b.lora_a[k] = params.add(a, Shape{lora.rank, w.shape[1]}, true, true);
        b.lora_b[k] = params.add(base + "lora_b", Shape{w.shape[0], lora.rank}, true, true);
      }
      if (b.wg >= 0 && b.lora_a[static_cast<size_t>(Projection::Q)] >= 0)
        b.lora_b_gate = params.add(l + "attention.wg.lora_b", Shape{Q, lora.rank}, true, true);
      const Projection mlp[3] = {Projection::Gate, Projection::Up, Projection::Down};
      const bool fused = config.experts_gate_up_fused;
      const int experts[3] = {b.experts_w1, fused ? b.experts_w1 : b.experts_w3, b.experts_w2};
      const int shared[3] = {b.shared_w1, b.shared_w3, b.shared_w2};
      for (int j = 0; j < 3; ++j) {
        if (experts[j] < 0 || !lora.on(mlp[j])) continue;
        const auto add = [&](int weight, int& a, int& bm) {
          const ParameterInfo& w = params.infos()[static_cast<size_t>(weight)];
          std::string base = w.name.substr(0, w.name.size() - std::string("weight").size());
          const int d = w.shape.ndim();
          int64_t out = w.shape[d - 2];
          const int64_t in = w.shape[d - 1];
          // The fused gate and up take an adapter each, by the parts' names (their B of the
          // part's rows; one A, as fused_lora_a names it).
          if (is_fused_experts(base)) {
            base = fused_experts_part(base, j);
            out /= 2;
          }
          // The experts' gate and up in one tensor share an A (fused_lora_a).
          const std::string a_name = fused_lora_a(config, base + "lora_a");
          a = params.find(a_name);
          if (a < 0)
            a = params.add(a_name, d == 3 ? Shape{w.shape[0], lora.rank, in} : Shape{lora.rank, in},
                           true, true);
          bm = params.add(base + "lora_b",
                          d == 3 ? Shape{w.shape[0], out, lora.rank} : Shape{out, lora.rank}, true,
                          true);
        };
        add(experts[j], b.expert_lora_a[static_cast<size_t>(j)],
            b.expert_lora_b[static_cast<size_t>(j)]);
        if (shared[j] >= 0) add(shared[j], b.shared_lora_a[j], b.shared_lora_b[j]);
      }
    }
    if (!own_kv) layout.blocks[static_cast<size_t>(b.kv_from)].kv_source = true;
    layout.blocks.push_back(b);
  }
  layout.norm = params.add("norm.weight", Shape{C}, false);
  layout.norm_bias = bias_of(layer_norm, "norm.bias", C);
  layout.output = config.tie_embeddings ? layout.tok_embeddings
                                        : params.add("output.weight", Shape{V, C}, true, true);
  layout.output_bias = bias_of(dense, "output.bias", V);
  return layout;
}

void DecoderModel::declare_parameters(const ModelConfig& config, ParameterSet& params,
                                      const LoraConfig& lora) {
  declare(config, lora, params);
}

DecoderModel::DecoderModel(const ModelConfig& config, const ModelOptions& options)
    : config_(config), arch_(&architecture_of(config)), lora_(options.lora) {
  if (const auto problem = validate(config)) throw std::invalid_argument(problem->str());
  if (options.compute_dtype != DType::F32 && options.compute_dtype != DType::BF16)
    throw std::invalid_argument("compute dtype must be f32 or bf16");
  if (lora_.rank < 0 || (lora_.active() && !(lora_.alpha > 0.0)) || lora_.dropout < 0.0 ||
      lora_.dropout >= 1.0)
    throw std::invalid_argument("LoRA rank must be >= 0, its alpha > 0 and its dropout in [0, 1)");
  Layout layout = declare(config, lora_, params_);
  tok_embeddings_ = layout.tok_embeddings;
  pl_table_ = layout.pl_table;
  pl_model_proj_ = layout.pl_model_proj;
  pl_proj_norm_ = layout.pl_proj_norm;
  blocks_ = std::move(layout.blocks);
  norm_ = layout.norm;
  norm_bias_ = layout.norm_bias;
  output_ = layout.output;
  output_bias_ = layout.output_bias;
  for (size_t i = 0; i < params_.infos().size(); ++i) {
    const std::string& name = params_.infos()[i].name;
    if (options.trainable)
      params_.set_trainable(static_cast<int>(i), options.trainable(name));
    else if (lora_.active())
      params_.set_trainable(static_cast<int>(i), is_lora_parameter(name));
  }
  params_.set_master_read(tok_embeddings_);  // the embedding looks up its FP32 rows
  if (pl_table_ >= 0) params_.set_master_read(pl_table_);
  if (options.offload) params_.set_offload(options.offload_dir);
  params_.set_shard(options.shard);
  if (options.in_place) {
    for (size_t i = 0; i < params_.infos().size(); ++i) {
      const ParameterInfo& p = params_.infos()[i];
      const bool table = static_cast<int>(i) == tok_embeddings_ || static_cast<int>(i) == pl_table_;
      if (p.trainable || (!p.bf16_copy && !table)) continue;
      const InPlaceWeight w = options.in_place(p);
      // A table read only row by row (not a tied head): BF16 in place in either precision.
      const bool rows_only = table && !p.bf16_copy;
      if ((w.dtype == DType::BF16 &&
           ((options.compute_dtype == DType::BF16 && p.bf16_copy) || rows_only)) ||
          dtype_quantized(w.dtype))
        params_.map_in_place(static_cast<int>(i), w.data, w.dtype, options.mapped_owner);
    }
  }
  params_.allocate(options.compute_dtype);
  compute_dtype_ = options.compute_dtype;

  // Backward reaches the head, then the blocks from the top: after block i's, the gradients of
  // blocks i and above and of the head are final, the tied embedding's not until the end. Where
  // those are the gradient buffer's tail, its start is where the gradients are final.
  const auto block_params = [](const Block& b) {
    // Weights, then biases, then norms.
    std::vector<int> v = {b.wq, b.wk, b.wv, b.wo, b.w1, b.w3, b.w2};
    v.insert(v.end(), {b.bq, b.bk, b.bv, b.bo, b.b3, b.b2});
    v.insert(v.end(), {b.attention_norm, b.attention_norm_bias, b.ffn_norm, b.ffn_norm_bias,
                       b.q_norm, b.k_norm, b.post_attention_norm, b.post_ffw_norm});
    v.insert(v.end(), {b.wg, b.wz, b.wa, b.wb, b.conv_q, b.conv_k, b.conv_v, b.dt_bias, b.a_log,
                       b.linear_norm});
    v.insert(v.end(), {b.router, b.experts_w1, b.experts_w3, b.experts_w2, b.shared_w1, b.shared_w3,
                       b.shared_w2, b.shared_gate});
    v.insert(v.end(), {b.router_bias, b.experts_b1, b.experts_b3, b.experts_b2, b.sinks});
    v.insert(v.end(),
             {b.router_scale, b.expert_scale, b.moe_norm, b.post_moe_norm, b.post_mlp_norm});
    v.insert(v.end(), {b.pl_gate, b.pl_proj, b.pl_norm, b.layer_scale});
    v.insert(v.end(), b.lora_a.begin(), b.lora_a.end());
    v.insert(v.end(), b.lora_b.begin(), b.lora_b.end());
    v.push_back(b.lora_b_gate);
    v.insert(v.end(), b.expert_lora_a.begin(), b.expert_lora_a.end());
    v.insert(v.end(), b.expert_lora_b.begin(), b.expert_lora_b.end());
    v.insert(v.end(), b.shared_lora_a.begin(), b.shared_lora_a.end());
    v.insert(v.end(), b.shared_lora_b.begin(), b.shared_lora_b.end());
    return v;
  };
  std::vector<bool> done(params_.infos().size(), false);
  final_from_.assign(blocks_.size() + 1, -1);
  for (size_t stage = blocks_.size() + 1; stage-- > 0;) {
    const std::vector<int> now = stage == blocks_.size()
                                     ? std::vector<int>{norm_, norm_bias_, output_bias_,
                                                        output_ == tok_embeddings_ ? -1 : output_}
                                     : block_params(blocks_[stage]);
    for (const int index : now)
      if (index >= 0) done[static_cast<size_t>(index)] = true;
    int64_t from = params_.trainable_numel();
    for (size_t i = 0; i < done.size(); ++i)
      if (done[i] && params_.infos()[i].grad_offset >= 0)
        from = std::min(from, params_.infos()[i].grad_offset);
    bool tail = true;
    for (size_t i = 0; i < done.size(); ++i)
      if (!done[i] && params_.infos()[i].grad_offset >= from) tail = false;
    if (tail) final_from_[stage] = from;
  }

  // The rotated dimensions' angles: (ctx, R/2, 2); the windowed layers' at their own base (and
  // of their own rotated dimensions).
  const int64_t R = config.rope_dims();
  rope_table_ = Tensor::empty(Shape{config.ctx, R / 2, 2}, DType::F32, MemoryCategory::Workspace);
  if (!rope_table_.measured())
    kernels::rope_table(rope_table_.f32(), config.ctx, R, config.rope_theta,
                        config.rope_freq_factors(), config.rope_scaling.attn_factor);
  rope_table_swa_ = rope_table_;
  if (config.rope_swa_apart()) {
    const int64_t Rs = config.rope_dims_swa();
    rope_table_swa_ =
        Tensor::empty(Shape{config.ctx, Rs / 2, 2}, DType::F32, MemoryCategory::Workspace);
    if (!rope_table_swa_.measured())
      kernels::rope_table(
          rope_table_swa_.f32(), config.ctx, Rs, config.rope_swa_theta(),
          config.rope_scaling.every_layer() ? config.rope_freq_factors() : nullptr,
          config.rope_scaling.every_layer() ? config.rope_scaling.attn_factor : 1.0);
  }
  if (arch_->v_norm) {
    const auto ones = [](int64_t n) {
      Tensor t = Tensor::empty(Shape{n}, DType::F32, MemoryCategory::Workspace);
      if (!t.measured()) std::fill_n(t.f32(), n, 1.0f);
      return t;
    };
    v_gain_ = ones(config.head_size());
    v_gain_swa_ = config.head_dim_swa > 0 ? ones(config.head_dim_swa) : v_gain_;
  }
}

void DecoderModel::init_weights(uint64_t seed) {
  std::mt19937_64 rng(seed);
  // Box-Muller on 53-bit uniforms, so the init is the same with any standard library.
  auto normal = [&rng]() {
    const double u1 = (static_cast<double>(rng() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  };
  const double std_matrix = 0.02;
  const double std_residual = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layers));
  std::vector<float> w;
  for (size_t index = 0; index < params_.infos().size(); ++index) {
    const ParameterInfo& info = params_.infos()[index];
    if (is_lora_parameter(info.name)) continue;  // init_adapters
    const int64_t n = info.shape.numel();
    w.assign(static_cast<size_t>(n), 0.0f);
    if (info.name.ends_with(".bias") || info.name.ends_with("attention.sinks.weight")) {
      // zero
    } else if (info.name.ends_with("linear.a_log.weight")) {
      // Qwen3.5's: A uniform in (0, 16), held as log A: decays from none to fast.
      for (float& x : w)
        x = static_cast<float>(
            std::log(16.0 * (static_cast<double>(rng() >> 11) + 1.0) * 0x1.0p-53));
    } else if (info.name.ends_with("linear.dt_bias.weight") ||
               info.name.ends_with("linear.gain.weight")) {
      std::fill(w.begin(), w.end(), 1.0f);  // Qwen3.5's dt_bias, the gated norm's plain gains
    } else if (info.name.find("linear.conv_") != std::string::npos) {
      // PyTorch's Conv1d: uniform within 1 / sqrt(taps).
      const double bound = 1.0 / std::sqrt(static_cast<double>(info.shape[1]));
      for (float& x : w)
        x = static_cast<float>(bound * (2.0 * static_cast<double>(rng() >> 11) * 0x1.0p-53 - 1.0));
    } else if (info.shape.ndim() == 1) {
      // Gains of 1, held less 1 where the norms add it.
      std::fill(w.begin(), w.end(), 1.0f - config_.norm_offset());
    } else {
      const bool residual =
          info.name.ends_with("attention.wo.weight") || info.name.ends_with("linear.wo.weight") ||
          info.name.ends_with("feed_forward.w2.weight") ||
          info.name.ends_with("experts.w2.weight") || info.name.ends_with("shared.w2.weight");
      const double stddev = residual ? std_residual : std_matrix;
      for (float& x : w) x = static_cast<float>(stddev * normal());
    }
    params_.write_values(static_cast<int>(index), w.data());
  }
  if (lora_.active()) init_adapters(seed + 1);
}

void DecoderModel::init_adapters(uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t index = 0; index < params_.infos().size(); ++index) {
    const ParameterInfo& info = params_.infos()[index];
    if (!is_lora_parameter(info.name)) continue;
    std::vector<float> w(static_cast<size_t>(info.shape.numel()), 0.0f);
    if (info.name.ends_with(".lora_a")) {
      // Uniform on 53-bit draws, so the init is the same with any standard library.
      const double bound = 1.0 / std::sqrt(static_cast<double>(info.shape[1]));
      for (float& x : w)
        x = static_cast<float>(bound * (2.0 * static_cast<double>(rng() >> 11) * 0x1.0p-53 - 1.0));
    }
    params_.write_values(static_cast<int>(index), w.data());
  }
}

void DecoderModel::set_compute_dtype(DType dtype) {
  if (dtype != DType::F32 && dtype != DType::BF16)
    throw std::invalid_argument("compute dtype must be f32 or bf16");
  if (dtype == DType::BF16) params_.enable_bf16_copies();
  for (const ParameterInfo& info : params_.infos())
    if (dtype == DType::F32 && info.offset < 0)
      throw std::invalid_argument(
          "a model built for bf16 with frozen bf16 weights cannot compute "
          "in f32 (" +
          info.name + ")");
  compute_dtype_ = dtype;
}

Tensor DecoderModel::capped(Tensor logits) const {
  if (config_.final_softcap > 0.0f && !logits.measured())
    kernels::logit_soft_cap(logits.f32(), logits.numel(), config_.final_softcap);
  return logits;
}

float DecoderModel::embedding_scale() const {
  return arch_->scale_embeddings ? std::sqrt(static_cast<float>(config_.d_model)) : 1.0f;
}

Variable DecoderModel::bias(int index) const {
  return index >= 0 ? p(index) : Variable();
}

Variable DecoderModel::project(const Block& b, Projection which, int weight, int bias_index,
                               const Variable& x, bool rounded, int lora_b) const {
  const auto j = static_cast<size_t>(which);
  if (lora_b < 0) lora_b = b.lora_b[j];
  // The parts of a fused projection draw one mask, their input's.
  size_t group = j;
  while (group > 0 && b.lora_a[j] >= 0 && b.lora_a[group - 1] == b.lora_a[j]) --group;
  return adapted(b, group, weight, bias_index, b.lora_a[j], lora_b, x, rounded);
}

uint64_t DecoderModel::dropout_seed(const Block& b, size_t mask) const {
  const auto layer = static_cast<uint64_t>(&b - blocks_.data());
  return splitmix64(dropout_seed_ ^ splitmix64(layer * (kProjectionCount + 3) + mask + 1));
}

Variable DecoderModel::adapted(const Block& b, size_t mask, int weight, int bias_index, int lora_a,
                               int lora_b, const Variable& x, bool rounded) const {
  if (lora_a < 0 || !adapters_on_)
    return rounded ? linear_rounded(x, p(weight), bias(bias_index))
                   : linear(x, p(weight), bias(bias_index));
  // Dropout in training only, a mask of its own for each layer and projection.
  const bool dropout = lora_.dropout > 0.0 && grad_enabled();
  return lora_linear(x, p(weight), bias(bias_index), p(lora_a), p(lora_b), lora_.scale(),
                     dropout ? static_cast<float>(lora_.dropout) : 0.0f, dropout_seed(b, mask));
}

Variable DecoderModel::norm(const Variable& x, int weight, int bias_index) const {
  if (arch_->norm == Norm::LayerNorm)
    return layernorm(x, p(weight), p(bias_index), config_.norm_eps);
  return rmsnorm(x, p(weight), config_.norm_eps, config_.norm_offset());
}

Variable DecoderModel::linear_attention(const Block& b, const Variable& h, const Tensor& positions,
                                        LinearState* state) {
  const float eps = config_.norm_eps;
  const int64_t Hk = config_.linear_key_heads, Hv = config_.linear_value_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(config_.linear_key_dim));
  // q, k and v through their causal convolutions (SiLU after), q and k of unit length.
  const auto conv = [&](Projection which, int weight, int taps, Tensor* conv_state) {
    return causal_conv_silu(project(b, which, weight, -1, h), p(taps), conv_state, positions);
  };
  const Variable q =
      head_l2norm(conv(Projection::Q, b.wq, b.conv_q, state ? &state->conv_q : nullptr), Hk, eps);
  const Variable k =
      head_l2norm(conv(Projection::K, b.wk, b.conv_k, state ? &state->conv_k : nullptr), Hk, eps);
  const Variable v = conv(Projection::V, b.wv, b.conv_v, state ? &state->conv_v : nullptr);
  const Variable g =
      deltanet_decay(project(b, Projection::Alpha, b.wa, -1, h), p(b.a_log), p(b.dt_bias));
  const Variable beta = sigmoid(project(b, Projection::Beta, b.wb, -1, h));
  const Variable o = gated_delta_rule(q, k, v, g, beta, Hk, Hv, scale,
                                      state ? &state->delta : nullptr, 64, positions);
  const Variable normed =
      gated_head_rmsnorm(o, project(b, Projection::Z, b.wz, -1, h), p(b.linear_norm), Hv, eps);
  return project(b, Projection::O, b.wo, -1, normed);
}

Variable DecoderModel::block_forward(const Block& b, const Variable& x, const RopeTables& tables,
                                     bool per_row, const Attend& attend, LinearState* state,
                                     const std::vector<Variable>& extra) {
  const bool windowed = config_.windowed_layer(b.layer);
  const Tensor& rope_table = windowed ? tables.windowed : tables.global;
  kernels::AttentionOptions options;
  options.scale = arch_->unscaled_scores ? 1.0f : config_.attn_scale;
  options.softcap = config_.attn_softcap;
  if (windowed) options.window = config_.sliding_window;
  const float eps = config_.norm_eps;
  const int64_t H = config_.n_heads, KVH = config_.kv_heads(b.layer);
  const bool half_split = config_.rope_pairs == RopePairs::HalfSplit;
  const bool rotate = config_.rope_in_layer(b.layer);
  const float offset = config_.norm_offset();
  // RoPE where the layer applies it, after the head's norm where the block has one.
  const auto position = [&](const Variable& x, int norm, int64_t heads) {
    const Variable normed = norm >= 0 ? head_rmsnorm(x, p(norm), eps, offset) : x;
    return rotate ? rope(normed, rope_table, heads, half_split, per_row, config_.rope_dims(b.layer))
                  : normed;
  };
  const size_t P = b.pl_gate >= 0 ? 1 : 0;  // where the per-layer input is in `extra`
  // The MLP on x (normed first where `normed` is false); with --checkpoint mlp a checkpoint
  // region of its own, which keeps only x.
  const auto mlp = [&](const Variable& x, bool normed) {
    auto run = [this, &b, normed](const Variable& in) { return mlp_forward(b, in, normed); };
    return checkpointing_ == Checkpointing::Mlp ? checkpoint(std::move(run), x) : run(x);
  };
  // Each scope ends where its intermediates are last used, so their FP32 values are freed
  // there (the ops that need them in backward have saved them).
  Variable h = norm(x, b.attention_norm, b.attention_norm_bias);
  Variable attended;
  if (b.linear) {
    attended = linear_attention(b, h, tables.positions, state);
    h = Variable();
  } else {
    Variable q, k, v;
    q = position(project(b, Projection::Q, b.wq, b.bq, h), b.q_norm, H);
    // A shared-KV layer's keys and values: its source layer's, from that layer's input (in
    // decoding, the cache's).
    const bool shared = b.kv_from != b.layer;
    const Block& kb = blocks_[static_cast<size_t>(b.kv_from)];
    if (!shared || extra.size() > P) {
      const Variable kh = shared ? norm(extra[P], kb.attention_norm, kb.attention_norm_bias) : h;
      const Variable kp = project(kb, Projection::K, kb.wk, kb.bk, kh);
      k = position(kp, kb.k_norm, KVH);
      if (arch_->v_norm) {
        // Gemma 4's: each head normed, without a gain; k's projection where the layer has no v
        // (ModelConfig::k_as_v).
        v = head_rmsnorm(kb.wv >= 0 ? project(kb, Projection::V, kb.wv, kb.bv, kh) : kp,
                         Variable(windowed ? v_gain_swa_ : v_gain_, false), eps);
      } else {
        // Attention reads only v's rounding.
        v = project(kb, Projection::V, kb.wv, kb.bv, kh, true);
      }
    }
    // The output gate, q_proj's other half: q's adapter A, a B of its own.
    const Variable gate =
        b.wg >= 0 ? project(b, Projection::Q, b.wg, -1, h, false, b.lora_b_gate) : Variable();
    if (!arch_->parallel_block) h = Variable();  // a parallel block's MLP reads it too
    Variable heads = attend(q, k, v, options, b.sinks >= 0 ? p(b.sinks) : Variable());
    if (gate.defined()) heads = sigmoid_gated(heads, gate);
    attended = project(b, Projection::O, b.wo, b.bo, heads);
  }
  // The norms after attention and the MLP feed the residual: FP32 in either mode.
  if (b.post_attention_norm >= 0)
    attended = head_rmsnorm(attended, p(b.post_attention_norm), eps, offset);
  if (arch_->parallel_block) {
    // Attention and the MLP from the one norm, added to the residual together.
    const Variable m = mlp(h, true);
    h = Variable();
    return add(add(attended, m), x);
  }
  Variable out;
  if (arch_->norm == Norm::RmsNorm && b.ffn_norm >= 0 && b.moe_norm < 0 &&
      checkpointing_ != Checkpointing::Mlp) {
    // The residual sum and the MLP's norm of it in one pass.
    const SumAndNorm a = add_rmsnorm(x, attended, p(b.ffn_norm), eps, offset);
    attended = Variable();
    out = add(a.sum, mlp(a.normed, true));
  } else {
    const Variable a = add(x, attended);
    attended = Variable();
    out = add(a, mlp(a, false));
  }
  if (b.pl_gate >= 0) {
    // Gemma 4's per-layer input: gelu of a gate of the layer's output times the input, projected
    // back, normed and added.
    const Variable gated = geglu(linear(out, p(b.pl_gate)), extra[0]);
    out = add(out, head_rmsnorm(linear(gated, p(b.pl_proj)), p(b.pl_norm), eps, offset));
  }
  return b.layer_scale >= 0 ? scale_by(out, p(b.layer_scale)) : out;
}

Variable DecoderModel::mlp_forward(const Block& b, const Variable& x, bool normed) const {
  const float eps = config_.norm_eps, offset = config_.norm_offset();
  Variable out;
  if (b.moe_norm >= 0) {
    // Gemma 4's: the dense MLP on its norm, its output normed; the experts on theirs, routed by
    // rmsnorm(x) times the router's scale over sqrt(C), their sum normed; the two added.
    const Variable dense = head_rmsnorm(dense_mlp(b, norm(x, b.ffn_norm, b.ffn_norm_bias)),
                                        p(b.post_mlp_norm), eps, offset);
    const Variable r = scale(head_rmsnorm(x, p(b.router_scale), eps),
                             1.0f / std::sqrt(static_cast<float>(config_.d_model)));
    const Variable experts = head_rmsnorm(experts_forward(b, norm(x, b.moe_norm, -1), r),
                                          p(b.post_moe_norm), eps, offset);
    out = add(dense, experts);
  } else {
    const Variable g = normed ? x : norm(x, b.ffn_norm, b.ffn_norm_bias);
    out = b.router >= 0 ? experts_forward(b, g, g) : dense_mlp(b, g);
  }
  return b.post_ffw_norm >= 0 ? head_rmsnorm(out, p(b.post_ffw_norm), eps, offset) : out;
}

Variable DecoderModel::experts_forward(const Block& b, const Variable& g, const Variable& r) const {
  // The router's logits in FP32, each token's experts and weights (times each expert's output
  // scale where it has one), the experts' sum.
  MoeRouting route =
      moe_route(project(b, Projection::Router, b.router, b.router_bias, r), config_.experts_used,
                arch_->moe_gating, config_.expert_weights_norm);
  if (b.expert_scale >= 0) route = moe_expert_scaled(route, p(b.expert_scale));
  // The experts' adapters (gate, up, down), dropout in training only; beside a dense MLP, masks
  // other than its gate's.
  MoeAdapters lora;
  if (adapters_on_) {
    const auto at = [&](const std::array<int, 3>& ids, size_t j) {
      return ids[j] >= 0 ? p(ids[j]) : Variable();
    };
    const uint64_t seed = dropout_seed(b, static_cast<size_t>(Projection::Gate));
    lora = {at(b.expert_lora_a, 0),
            at(b.expert_lora_b, 0),
            at(b.expert_lora_a, 1),
            at(b.expert_lora_b, 1),
            at(b.expert_lora_a, 2),
            at(b.expert_lora_b, 2),
            lora_.active() ? lora_.scale() : 1.0f,
            lora_.dropout > 0.0 && grad_enabled() ? static_cast<float>(lora_.dropout) : 0.0f,
            b.moe_norm >= 0 ? splitmix64(seed + 1) : seed};
  }
  Variable out = moe_experts(
      g, p(b.experts_w1), b.experts_w3 >= 0 ? p(b.experts_w3) : Variable(), p(b.experts_w2), route,
      lora, {bias(b.experts_b1), bias(b.experts_b3), bias(b.experts_b2)}, arch_->moe_activation);
  if (b.shared_w1 >= 0) {
    // The shared expert, its output scaled by sigmoid of the token's own gate.
    const auto shared_proj = [&](size_t j, int weight, const Variable& in) {
      return adapted(b, kProjectionCount + j, weight, -1, b.shared_lora_a[j], b.shared_lora_b[j],
                     in, false);
    };
    const Variable shared = shared_proj(
        2, b.shared_w2, swiglu(shared_proj(0, b.shared_w1, g), shared_proj(1, b.shared_w3, g)));
    out = add(out, row_sigmoid_gated(shared, linear(g, p(b.shared_gate))));
  }
  return out;
}

Variable DecoderModel::dense_mlp(const Block& b, Variable g) const {
  Variable f;
  if (arch_->mlp == Mlp::Gelu) {
    f = gelu(project(b, Projection::Up, b.w3, b.b3, g));
  } else {
    const Variable gate = project(b, Projection::Gate, b.w1, -1, g);
    const Variable up = project(b, Projection::Up, b.w3, b.b3, g);
    f = arch_->mlp == Mlp::GeGlu ? geglu(gate, up) : swiglu(gate, up);
  }
  g = Variable();  // let go of before the down projection
  return project(b, Projection::Down, b.w2, b.b2, f);
}

Variable DecoderModel::hidden(const Tensor& inputs, std::shared_ptr<const Packing> packing) {
  if (inputs.ndim() != 2 || inputs.dim(1) > config_.ctx)
    throw std::invalid_argument("model input must be (B, T) with T <= ctx");
  const int64_t H = config_.n_heads;
  const Attend attend = [H, packing](const Variable& q, const Variable& k, const Variable& v,
                                     const kernels::AttentionOptions& options,
                                     const Variable& sinks) {
    // The layer's key/value heads: k's width in heads of q's size.
    const int64_t D = q.shape()[q.shape().ndim() - 1] / H;
    return attention(q, k, v, H, k.shape()[k.shape().ndim() - 1] / D, packing, options, sinks);
  };
  // Packed rows: each row's RoPE table, every sequence's positions from 0.
  RopeTables table{rope_table_, rope_table_swa_, Tensor()};
  if (packing) {
    const int64_t B = inputs.dim(0), T = inputs.dim(1);
    if (static_cast<int64_t>(packing->lengths.size()) != B)
      throw std::invalid_argument("packing of another batch");
    const auto per_row_table = [&](const Tensor& whole) {
      const int64_t R = whole.dim(1) * 2;
      Tensor rows = Tensor::empty(Shape{B, T, R / 2, 2}, DType::F32, MemoryCategory::Activations);
      if (rows.measured()) return rows;
      for (int64_t b = 0; b < B; ++b) {
        int64_t t = 0;
        for (const int64_t n : packing->lengths[static_cast<size_t>(b)]) {
          if (n <= 0 || t + n > T) throw std::invalid_argument("packed lengths beyond T");
          std::copy_n(whole.f32(), n * R, rows.f32() + (b * T + t) * R);
          t += n;
        }
        if (t != T) throw std::invalid_argument("packed lengths summing to T");
      }
      return rows;
    };
    table.global = per_row_table(rope_table_);
    table.windowed = config_.rope_swa_apart() ? per_row_table(rope_table_swa_) : table.global;
    if (!config_.linear_layers.empty()) {
      table.positions = Tensor::empty(Shape{B, T}, DType::I32, MemoryCategory::Activations);
      if (!table.positions.measured())
        for (int64_t b = 0; b < B; ++b) {
          int32_t* row = table.positions.i32() + b * T;
          int64_t t = 0;
          for (const int64_t n : packing->lengths[static_cast<size_t>(b)])
            for (int64_t i = 0; i < n; ++i) row[t++] = static_cast<int32_t>(i);
        }
    }
  }
  const bool per_row = packing != nullptr;
  read_ahead(0);
  Variable x = embedding(p(tok_embeddings_), inputs, embedding_scale());
  std::vector<Variable> per_layer = per_layer_inputs(inputs, x);
  // The inputs of the layers whose keys and values later layers share.
  std::vector<Variable> block_input(blocks_.size());
  const bool recording = read_ahead_queue_ && grad_enabled();
  const auto final_from = [this](size_t stage) {
    if (grad_enabled() && final_from_[stage] >= 0)
      record_backward("gradients final",
                      [this, stage] { params_.gradients_final_from(final_from_[stage]); });
  };
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    // The backward pass reaches this just after the block's own backward.
    final_from(i);
    if (recording) record_backward("read_ahead", [this, i] { read_ahead(i, true); });
    read_ahead(i + 1);  // the next block's weights (the head's after the last) while this runs
    // The block's per-layer input, and a shared-KV layer's source's input.
    std::vector<Variable> extra;
    if (!per_layer.empty()) extra.push_back(std::move(per_layer[i]));
    if (b.kv_from != b.layer) extra.push_back(block_input[static_cast<size_t>(b.kv_from)]);
    if (b.kv_source) block_input[i] = x;
    if (checkpointing_ == Checkpointing::Layer) {
      // The region reruns in backward: it holds its own copies of attend and the table.
      std::vector<Variable> in = {x};
      in.insert(in.end(), extra.begin(), extra.end());
      x = checkpoint(
          [this, &b, attend, table, per_row](const std::vector<Variable>& in) {
            return block_forward(b, in[0], table, per_row, attend, nullptr,
                                 std::vector<Variable>(in.begin() + 1, in.end()));
          },
          in);
    } else {
      x = block_forward(b, x, table, per_row, attend, nullptr, extra);
    }
    read_ahead(i, true);
    // The backward pass reaches this just before the block's own backward: the block before's
    // weights are read meanwhile.
    if (i > 0 && recording) record_backward("read_ahead", [this, i] { read_ahead(i - 1); });
  }
  final_from(blocks_.size());  // reached after the head's backward
  return norm(x, norm_, norm_bias_);
}

std::vector<Variable> DecoderModel::per_layer_inputs(const Tensor& inputs, const Variable& x) {
  if (pl_table_ < 0) return {};
  const int64_t P = config_.per_layer_dim, L = config_.n_layers;
  const auto Pf = static_cast<float>(P), Cf = static_cast<float>(config_.d_model);
  // The table's rows times sqrt(P), plus the embedding's projection times 1 / sqrt(C) normed in
  // each layer's P, the sum times 1 / sqrt(2).
  const Variable looked_up = embedding(p(pl_table_), inputs, std::sqrt(Pf));
  const Variable projected =
      head_rmsnorm(scale(linear(x, p(pl_model_proj_)), 1.0f / std::sqrt(Cf)), p(pl_proj_norm_),
                   config_.norm_eps, config_.norm_offset());
  const Variable sum = scale(add(projected, looked_up), 1.0f / std::sqrt(2.0f));
  std::vector<Variable> out;
  for (int64_t l = 0; l < L; ++l) out.push_back(column_slice(sum, l * P, P));
  return out;
}

Variable DecoderModel::loss(const Tensor& inputs, const Tensor& targets) {
  ComputeDTypeGuard precision(compute_dtype_);
  return lm_head_cross_entropy(hidden(inputs), p(output_), targets, 0, 0, bias(output_bias_),
                               config_.final_softcap);
}

Variable DecoderModel::loss(const Tensor& inputs, const Tensor& targets,
                            std::shared_ptr<const Packing> packing, int64_t normalizer) {
  ComputeDTypeGuard precision(compute_dtype_);
  const int64_t N = targets.numel();
  // The positions with a target, in order (while measuring, as many as the packing says).
  std::vector<int64_t> kept;
  if (!head_on_every_position_ && packing) {
    if (measuring()) {
      kept.resize(static_cast<size_t>(
          packing->measured_targets > 0 ? std::min(packing->measured_targets, N) : N));
    } else {
      for (int64_t i = 0; i < N; ++i)
        if (targets.i32()[i] >= 0) kept.push_back(i);
    }
  }
  Variable h = hidden(inputs, packing);
  if (kept.empty() || static_cast<int64_t>(kept.size()) == N)
    return lm_head_cross_entropy(h, p(output_), targets, 0, normalizer, bias(output_bias_),
                                 config_.final_softcap);
  const auto n = static_cast<int64_t>(kept.size());
  Tensor kept_targets = Tensor::empty(Shape{n}, DType::I32, MemoryCategory::Workspace);
  if (!kept_targets.measured())
    for (int64_t i = 0; i < n; ++i)
      kept_targets.i32()[i] = targets.i32()[kept[static_cast<size_t>(i)]];
  h = gather_rows(h, std::move(kept));
  return lm_head_cross_entropy(h, p(output_), kept_targets, 0, normalizer, bias(output_bias_),
                               config_.final_softcap);
}

Variable DecoderModel::target_log_probs(const Tensor& inputs, const Tensor& targets,
                                        std::shared_ptr<const Packing> packing) {
  ComputeDTypeGuard precision(compute_dtype_);
  const int64_t N = targets.numel();
  std::vector<int64_t> kept;
  if (measuring()) {
    kept.resize(static_cast<size_t>(
        packing && packing->measured_targets > 0 ? std::min(packing->measured_targets, N) : N));
    std::iota(kept.begin(), kept.end(), int64_t{0});
  } else {
    for (int64_t i = 0; i < N; ++i)
      if (targets.i32()[i] >= 0) kept.push_back(i);
  }
  const auto n = static_cast<int64_t>(kept.size());
  Tensor kept_targets = Tensor::empty(Shape{n}, DType::I32, MemoryCategory::Workspace);
  if (!kept_targets.measured())
    for (int64_t i = 0; i < n; ++i)
      kept_targets.i32()[i] = targets.i32()[kept[static_cast<size_t>(i)]];
  Variable h = hidden(inputs, std::move(packing));
  if (n < N) h = gather_rows(h, std::move(kept));
  return lm_head_log_probs(h, p(output_), kept_targets, 0, bias(output_bias_),
                           config_.final_softcap);
}

Tensor DecoderModel::logits(const Tensor& inputs) {
  NoGradGuard no_grad;
  ComputeDTypeGuard precision(compute_dtype_);
  return capped(linear(hidden(inputs), p(output_), bias(output_bias_)).value());
}

Tensor DecoderModel::logits(const Tensor& inputs, std::shared_ptr<const Packing> packing) {
  NoGradGuard no_grad;
  ComputeDTypeGuard precision(compute_dtype_);
  return capped(linear(hidden(inputs, std::move(packing)), p(output_), bias(output_bias_)).value());
}

Tensor DecoderModel::last_logits(const Tensor& inputs) {
  NoGradGuard no_grad;
  ComputeDTypeGuard precision(compute_dtype_);
  return last_position_logits(hidden(inputs).value(), inputs.dim(0), inputs.dim(1));
}

Tensor DecoderModel::last_position_logits(const Tensor& h, int64_t B, int64_t T) {
  const int64_t C = config_.d_model;
  // h is FP32, or in bf16 mode its rounding alone (rmsnorm's output), which is all the head's
  // GEMM takes of it.
  Tensor last = Tensor::empty(Shape{B, C}, h.dtype(), MemoryCategory::Workspace);
  for (int64_t b = 0; b < B; ++b)
    last.view(b * C, Shape{C}).copy_from(h.view((b * T + T - 1) * C, Shape{C}));
  return capped(linear(Variable(last, false), p(output_), bias(output_bias_)).value());
}

DecoderModel::KvCache DecoderModel::new_kv_cache(int64_t batch) const {
  if (batch < 1) throw std::invalid_argument("new_kv_cache: a batch of at least one sequence");
  KvCache cache;
  cache.batch = batch;
  for (size_t l = 0; l < blocks_.size(); ++l) {
    cache.first.push_back(0);
    if (blocks_[l].linear) {
      const int64_t taps = config_.linear_conv - 1;
      const auto zeros = [](const Shape& shape) {
        return Tensor::zeros(shape, DType::F32, MemoryCategory::Workspace);
      };
      cache.linear.push_back({zeros(Shape{batch, config_.linear_qk_dim(), taps}),
                              zeros(Shape{batch, config_.linear_qk_dim(), taps}),
                              zeros(Shape{batch, config_.linear_v_dim(), taps}),
                              zeros(Shape{batch, config_.linear_value_heads, config_.linear_key_dim,
                                          config_.linear_value_dim})});
      cache.keys.emplace_back();
      cache.values.emplace_back();
      continue;
    }
    cache.linear.emplace_back();
    const auto layer = static_cast<int64_t>(l);
    if (blocks_[l].kv_from != layer) {  // reads its source layer's
      cache.keys.emplace_back();
      cache.values.emplace_back();
      continue;
    }
    const int64_t rows = config_.windowed_layer(layer)
                             ? std::min(config_.ctx, 2 * config_.sliding_window)
                             : config_.ctx;
    const Shape shape{batch * rows, config_.kv_dim(layer)};
    cache.keys.push_back(Tensor::empty(shape, DType::F32, MemoryCategory::Workspace));
    cache.values.push_back(Tensor::empty(shape, DType::F32, MemoryCategory::Workspace));
  }
  return cache;
}

namespace {

// Of a tensor of `batch` sequences' equal parts (rows first), the parts `from` in order into
// `to` (a tensor of from.size() parts).
void copy_parts(const Tensor& src, int64_t batch, const std::vector<int64_t>& from, Tensor& to) {
  const int64_t part = src.numel() / batch;
  for (size_t i = 0; i < from.size(); ++i)
    std::copy_n(src.f32() + from[i] * part, part, to.f32() + static_cast<int64_t>(i) * part);
}

// The tensor of the parts `from` of src's `batch` (a new one; src's own where they are all).
Tensor parts_of(const Tensor& src, int64_t batch, const std::vector<int64_t>& from) {
  if (!src.defined()) return src;
  const Shape& d = src.shape();
  const int64_t first = d[0] / batch * static_cast<int64_t>(from.size());
  const Shape shape = d.ndim() == 2   ? Shape{first, d[1]}
                      : d.ndim() == 3 ? Shape{first, d[1], d[2]}
                                      : Shape{first, d[1], d[2], d[3]};
  Tensor to = Tensor::empty(shape, DType::F32, MemoryCategory::Workspace);
  copy_parts(src, batch, from, to);
  return to;
}

}  // namespace

DecoderModel::KvCache DecoderModel::repeat_kv_cache(const KvCache& one, int64_t batch) const {
  if (one.batch != 1 || batch < 1)
    throw std::invalid_argument("repeat_kv_cache: a cache of one sequence, into one or more");
  KvCache cache = one;
  const std::vector<int64_t> from(static_cast<size_t>(batch), 0);
  for (size_t l = 0; l < cache.keys.size(); ++l) {
    cache.keys[l] = parts_of(one.keys[l], 1, from);
    cache.values[l] = parts_of(one.values[l], 1, from);
    for (Tensor LinearState::*t :
         {&LinearState::conv_q, &LinearState::conv_k, &LinearState::conv_v, &LinearState::delta})
      cache.linear[l].*t = parts_of(one.linear[l].*t, 1, from);
  }
  cache.batch = batch;
  return cache;
}

void DecoderModel::keep_sequences(KvCache& cache, const std::vector<int64_t>& keep) {
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i] < 0 || keep[i] >= cache.batch || (i > 0 && keep[i] <= keep[i - 1]))
      throw std::invalid_argument("keep_sequences: increasing indices of the cache's sequences");
  if (keep.empty()) throw std::invalid_argument("keep_sequences: at least one sequence");
  if (static_cast<int64_t>(keep.size()) == cache.batch) return;
  for (size_t l = 0; l < cache.keys.size(); ++l) {
    cache.keys[l] = parts_of(cache.keys[l], cache.batch, keep);
    cache.values[l] = parts_of(cache.values[l], cache.batch, keep);
    for (Tensor LinearState::*t :
         {&LinearState::conv_q, &LinearState::conv_k, &LinearState::conv_v, &LinearState::delta})
      cache.linear[l].*t = parts_of(cache.linear[l].*t, cache.batch, keep);
  }
  cache.batch = static_cast<int64_t>(keep.size());
}

void DecoderModel::set_read_ahead(bool on) {
  read_ahead_queue_.reset();
  if (!on) return;
  for (size_t i = 0; i < params_.infos().size(); ++i) {
    if (params_.mapped(static_cast<int>(i)) && !p(static_cast<int>(i)).value().measured()) {
      read_ahead_queue_ = std::make_shared<IoQueue>();
      return;
    }
  }
}

void DecoderModel::read_ahead(size_t index, bool release) const {
  if (!read_ahead_queue_ || index > blocks_.size()) return;
  std::vector<Tensor> weights;
  const auto add = [&](int parameter) {
    if (parameter >= 0 && params_.mapped(parameter)) weights.push_back(p(parameter).value());
  };
  if (index == blocks_.size()) {
    add(output_);
  } else {
    const Block& b = blocks_[index];
    for (const int parameter :
         {b.wq,          b.wk,         b.wv,         b.wo,        b.w1,        b.w3,
          b.w2,          b.wg,         b.wz,         b.wa,        b.wb,        b.router,
          b.experts_w1,  b.experts_w3, b.experts_w2, b.shared_w1, b.shared_w3, b.shared_w2,
          b.shared_gate, b.pl_gate,    b.pl_proj})
      add(parameter);
  }
  if (weights.empty()) return;
  // The tensors keep the mapping alive until the job has run.
  read_ahead_queue_->submit([weights = std::move(weights), release] {
    for (const Tensor& w : weights)
      release ? release_mapped(w.raw(), w.bytes()) : populate_mapped(w.raw(), w.bytes());
  });
}

Tensor DecoderModel::decode(const std::vector<int32_t>& tokens, KvCache& cache) {
  const int64_t B = cache.batch;
  const auto m = B > 0 ? static_cast<int64_t>(tokens.size()) / B : 0;
  const int64_t n = cache.length, H = config_.n_heads;
  if (m == 0 || m * B != static_cast<int64_t>(tokens.size()) || n + m > config_.ctx ||
      cache.keys.size() != blocks_.size() || cache.first.size() != blocks_.size())
    throw std::invalid_argument(
        "decode: 1 .. ctx - cached tokens of each sequence, with a cache of this model");
  if (config_.shared_kv_layers > 0 && config_.sliding_window > 0 && m > config_.sliding_window) {
    // A shared-KV layer attends with its source's cache as the source left it: in pieces of at
    // most the window, that cache holds every key each piece's queries see.
    Tensor last;
    for (int64_t s = 0; s < m; s += config_.sliding_window) {
      const int64_t c = std::min(m - s, config_.sliding_window);
      std::vector<int32_t> piece;
      for (int64_t b = 0; b < B; ++b)
        piece.insert(piece.end(), tokens.begin() + b * m + s, tokens.begin() + b * m + s + c);
      last = decode(piece, cache);
    }
    return last;
  }
  if (n == 0) {
    std::fill(cache.first.begin(), cache.first.end(), 0);
    for (LinearState& state : cache.linear)
      for (Tensor* t : {&state.conv_q, &state.conv_k, &state.conv_v, &state.delta})
        if (t->defined()) std::fill_n(t->f32(), t->numel(), 0.0f);
  }
  NoGradGuard no_grad;
  ComputeDTypeGuard precision(compute_dtype_);
  Tensor input = Tensor::empty(Shape{B, m}, DType::I32, MemoryCategory::Workspace);
  std::copy(tokens.begin(), tokens.end(), input.i32());
  // RoPE angles of positions n .. n + m - 1.
  const auto rows_of = [&](const Tensor& whole) {
    const int64_t R = whole.dim(1) * 2;
    Tensor rows = Tensor::empty(Shape{m, R / 2, 2}, DType::F32, MemoryCategory::Workspace);
    std::copy_n(whole.f32() + n * R, m * R, rows.f32());
    return rows;
  };
  RopeTables table{rows_of(rope_table_), Tensor(), Tensor()};
  table.windowed = config_.rope_swa_apart() ? rows_of(rope_table_swa_) : table.global;
  Variable x = embedding(p(tok_embeddings_), input, embedding_scale());
  std::vector<Variable> per_layer = per_layer_inputs(input, x);
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const auto layer = static_cast<int64_t>(l);
    const int64_t D = config_.head_size(layer), Q = config_.q_dim(layer);
    const int64_t KVH = config_.kv_heads(layer), KV = config_.kv_dim(layer);
    // A shared-KV layer's queries attend to its source's cache, which holds this call's keys
    // and values already.
    const auto source = static_cast<size_t>(blocks_[l].kv_from);
    // The new positions' keys and values join the cache as attention would see them (bf16
    // roundings in bf16 mode); their queries attend to everything cached.
    // A windowed layer's queries go in pieces of at most the window, each after its keys and
    // values, so the cache (2 x the window) holds what each piece attends.
    const Attend attend = [&, l](const Variable& q, const Variable& k, const Variable& v,
                                 kernels::AttentionOptions options, const Variable& sinks) {
      const Tensor sink_values = sinks.defined() ? attention_input(sinks) : Tensor();
      if (sink_values.defined()) options.sinks = sink_values.f32();
      // Each sequence's queries attend to its own rows of the cache.
      if (source != l) {
        const Tensor qt = attention_input(q);
        Tensor att = Tensor::empty(Shape{B, m, Q}, DType::F32, MemoryCategory::Workspace);
        const int64_t rows = cache.keys[source].shape()[0] / B;
        for (int64_t b = 0; b < B; ++b)
          kernels::attention_decode(att.f32() + b * m * Q, qt.f32() + b * m * Q,
                                    cache.keys[source].f32() + b * rows * KV,
                                    cache.values[source].f32() + b * rows * KV,
                                    n - cache.first[source], m, H, KVH, D, options);
        return Variable(att, false);
      }
      Tensor& keys = cache.keys[l];
      Tensor& values = cache.values[l];
      int64_t& first = cache.first[l];
      const int64_t rows = keys.shape()[0] / B;
      const int64_t piece = options.window > 0 ? options.window : m;
      const Tensor kt = attention_input(k), vt = attention_input(v), qt = attention_input(q);
      const float *kn = kt.f32(), *vn = vt.f32(), *qn = qt.f32();
      Tensor att = Tensor::empty(Shape{B, m, Q}, DType::F32, MemoryCategory::Workspace);
      for (int64_t s = 0; s < m; s += piece) {
        const int64_t c = std::min(piece, m - s);
        int64_t held = n + s - first;
        if (held + c > rows) {  // keep the last window - 1 positions
          const int64_t keep = std::min(held, options.window - 1);
          for (int64_t b = 0; b < B; ++b) {
            float* kb = keys.f32() + b * rows * KV;
            float* vb = values.f32() + b * rows * KV;
            std::memmove(kb, kb + (held - keep) * KV, sizeof(float) * keep * KV);
            std::memmove(vb, vb + (held - keep) * KV, sizeof(float) * keep * KV);
          }
          first += held - keep;
          held = keep;
        }
        for (int64_t b = 0; b < B; ++b) {
          float* kb = keys.f32() + b * rows * KV;
          float* vb = values.f32() + b * rows * KV;
          std::copy_n(kn + (b * m + s) * KV, c * KV, kb + held * KV);
          std::copy_n(vn + (b * m + s) * KV, c * KV, vb + held * KV);
          kernels::attention_decode(att.f32() + (b * m + s) * Q, qn + (b * m + s) * Q, kb, vb, held,
                                    c, H, KVH, D, options);
        }
      }
      return Variable(att, false);
    };
    std::vector<Variable> extra;
    if (!per_layer.empty()) extra.push_back(std::move(per_layer[l]));
    x = block_forward(blocks_[l], x, table, false, attend,
                      blocks_[l].linear ? &cache.linear[l] : nullptr, extra);
  }
  cache.length = n + m;
  return last_position_logits(norm(x, norm_, norm_bias_).value(), B, m);
}

}  // namespace cputrain
