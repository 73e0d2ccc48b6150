#!/usr/bin/python3
"""Reference tensors for tests/models/test_llama_reference.cpp, from PyTorch.

A self-contained fp32 PyTorch implementation of the cputrain decoder, for four configurations
(CONFIGS: the tiny preset; one with grouped-query attention, tied embeddings, q/k/v biases and
half-split RoPE; that one again with a frozen base and LoRA adapters, y = W x + (alpha / rank)
B A x, on all seven projections; one with the parts of the newer families, per-head q/k norms,
Llama 3's RoPE scaling and a layer without RoPE; one with Phi-3's, adapters on its fused
projections, partial rotary and longrope scaling; one with Gemma's, GeGLU, RMSNorm scaling by
1 + w and embeddings scaled by sqrt(d_model); one with Phi-2's, a parallel block from one LayerNorm,
a GELU MLP and biases everywhere; one with Gemma 3's, post-norms and sliding-window layers at a
RoPE base of their own; one with Gemma 2's soft-capping; one with Qwen3.5's, Gated DeltaNet layers
(the delta rule in its recurrent form) beside gated attention; and three mixtures of experts,
Qwen3-MoE's, Qwen3.5-MoE's with its shared expert, gpt-oss's with its sinks, biases and clamped
SwiGLU): from one seeded set of weights and one batch it records the logits, the loss, every trainable parameter's gradient, and the losses, gradient norms and
weights of 10 AdamW steps with global norm clipping; and of the configurations with adapters,
DPO's and ORPO's losses and gradients on two preference pairs (preference_records), and GRPO's
on two groups of completions (grpo_records).

Regenerate (Debian's python3-torch; `tools/install_deps.sh --torch` installs it):
    /usr/bin/python3 tests/models/make_llama_reference.py
which rewrites tests/data/llama_{tiny,gqa,lora,parts,phi3,gemma,gemma3,gemma2,phi2,qwen35,
    qwen3moe,qwen35moe,gpt_oss}_reference.ctrf.

File format "CTRF", little-endian: magic b"CTRF", u32 version (1), u32 record count; then per
record u32 name length, name (utf-8), u32 dtype (0 f32, 1 i32), u32 ndim, ndim x u64 dims, data.
"""
import dataclasses
import math
import os
import struct
from dataclasses import dataclass

import torch


@dataclass
class Config:
    file: str
    V: int
    C: int
    L: int
    H: int
    F: int
    B: int
    T: int
    KVH: int
    D: int
    tied: bool = False
    bias: bool = False
    half_split: bool = False  # rotate (x[j], x[j + D/2]) instead of (x[2j], x[2j+1])
    theta: float = 10000.0
    eps: float = 1e-5
    lora_rank: int = 0  # adapters on q, k, v, o, gate, up, down; the base frozen
    lora_alpha: float = 0.0
    qk_norm: bool = False  # RMSNorm of each head of q and k before RoPE (Qwen3)
    # Llama 3's RoPE scaling: (factor, low_freq_factor, high_freq_factor, original context).
    scaling: tuple = None
    no_rope: tuple = ()  # layers without RoPE (SmolLM3)
    # Phi-3: adapters on the fused qkv and gate_up projections (one A for each, whose B rows are
    # q's, k's and v's; gate's and up's), RoPE on the first rope_dim of each head, and longrope:
    # (original context, ctx the model runs at) choosing the long factors beyond the original,
    # and the rotation scaled by sqrt(1 + ln(ctx / original) / ln(original)).
    fused: bool = False
    rope_dim: int = 0
    longrope: tuple = None
    # Gemma: the MLP gelu_tanh(gate) * up, each RMSNorm scaling by 1 + w (w held, and drawn,
    # near 0), the embeddings scaled by sqrt(C) on the way in (not on the tied head's way out).
    gemma: bool = False
    # Phi-2: one LayerNorm (with a bias) a block, attention and a GELU MLP (up, gelu_tanh, down; no
    # gate) in parallel from it, biases on q, k, v, o, up, down and the head; LayerNorm at the end.
    phi2: bool = False
    # Gemma 3 (with gemma): norms after attention and the MLP, layers i % swa_pattern <
    # swa_pattern - 1 attending within a window of `window` keys at RoPE base theta_swa, the
    # scores scaled by attn_scale (0: 1/sqrt(D)).
    post_norms: bool = False
    window: int = 0
    swa_pattern: int = 0
    theta_swa: float = 0.0
    attn_scale: float = 0.0
    # Gemma 2: attention scores and final logits soft-capped, cap * tanh(x / cap).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Qwen3.5: (key heads, value heads, key dim, value dim, conv taps, interval): every
    # interval-th layer (from 1) attention with its output times sigmoid of a gate projection
    # (wg), the others Gated DeltaNet, written here in its recurrent form.
    qwen35: tuple = None
    # A mixture of experts in every MLP's place: (experts, used, renormalised, shared width);
    # `gating` "softmax" (softmax over all, the top k taken, renormalised where asked: Qwen3-MoE,
    # Qwen3.5-MoE) or "topk_softmax" (the top k logits softmaxed: gpt-oss's). A shared width: a
    # SwiGLU expert every token takes, times sigmoid of its own gate (Qwen3.5-MoE).
    moe: tuple = None
    gating: str = "softmax"
    # gpt-oss's: biases on the router and each expert's three products, the experts' clamped
    # SwiGLU, a bias on attention's output and a learnt sink logit per head.
    gpt_oss: bool = False
    # The architecture's name where the parts alone do not say it.
    arch: str = None

    def linear(self, i):
        return self.qwen35 is not None and (i + 1) % self.qwen35[5] != 0


CONFIGS = [
    # The tiny preset.
    Config("llama_tiny_reference.ctrf", V=512, C=64, L=2, H=4, F=192, B=2, T=32, KVH=4, D=16),
    # Qwen2/SmolLM2-like: grouped-query attention (8 query heads, 2 kv heads), tied embeddings,
    # q/k/v biases, half-split RoPE at theta 1e6, eps 1e-6, and a head dim of 10 (not a power of
    # two, and H * D = 80 differs from the width 96).
    Config("llama_gqa_reference.ctrf", V=256, C=96, L=2, H=8, F=160, B=2, T=24, KVH=2, D=10,
           tied=True, bias=True, half_split=True, theta=1e6, eps=1e-6),
    # The same with LoRA: rank 4, alpha 8 (scale 2).
    Config("llama_lora_reference.ctrf", V=256, C=96, L=2, H=8, F=160, B=2, T=24, KVH=2, D=10,
           tied=True, bias=True, half_split=True, theta=1e6, eps=1e-6, lora_rank=4,
           lora_alpha=8.0),
    # The parts of the newer families together: per-head q/k norms (Qwen3), Llama 3's RoPE
    # scaling with a short original context, so that every branch of its factors is taken at
    # this head dim, and a layer without RoPE (SmolLM3); 3 query heads over 1 kv head of 16.
    Config("llama_parts_reference.ctrf", V=256, C=64, L=3, H=3, F=128, B=2, T=24, KVH=1, D=16,
           half_split=True, theta=10000.0, eps=1e-6, qk_norm=True, scaling=(8.0, 1.0, 4.0, 128),
           no_rope=(1,)),
    # Phi-3's parts with LoRA on all projections (rank 4, alpha 8): fused qkv and gate_up adapters,
    # RoPE on 12 of each head's 16 dimensions, longrope with an original context of 32 below the
    # 64 the model runs at.
    Config("llama_phi3_reference.ctrf", V=256, C=64, L=2, H=4, F=96, B=2, T=24, KVH=2, D=16,
           half_split=True, theta=10000.0, eps=1e-5, lora_rank=4, lora_alpha=8.0, fused=True,
           rope_dim=12, longrope=(32, 64)),
    # Gemma's parts, trained whole: multi-query attention with heads of 32 over a width of 96
    # (sqrt(96) is not a float), a tied head, half-split RoPE.
    Config("llama_gemma_reference.ctrf", V=256, C=96, L=2, H=4, F=160, B=2, T=24, KVH=1, D=32,
           tied=True, half_split=True, theta=10000.0, eps=1e-6, gemma=True),
    # Phi-2's parts, trained whole (the LayerNorms' gains and biases, every projection's bias and
    # the head's): RoPE on 8 of each head's 20 dimensions (its 40%).
    # Gemma 3's parts, trained whole: q/k norms and post-norms (1 + w), layers 0 and 1 of every 3
    # within a window of 5 keys at RoPE base 100 (the others at 10,000), scores scaled by 0.2.
    Config("llama_gemma3_reference.ctrf", V=256, C=64, L=3, H=4, F=96, B=2, T=24, KVH=2, D=16,
           tied=True, half_split=True, theta=10000.0, eps=1e-6, qk_norm=True, gemma=True,
           post_norms=True, window=5, swa_pattern=3, theta_swa=100.0, attn_scale=0.2),
    # Gemma 2's: post-norms, every other layer within a window of 6 keys, the attention scores
    # soft-capped at 1 and the final logits at 4 (small, so that the tanh bends).
    Config("llama_gemma2_reference.ctrf", V=256, C=64, L=2, H=4, F=96, B=2, T=24, KVH=2, D=16,
           tied=True, half_split=True, theta=10000.0, eps=1e-6, gemma=True, post_norms=True,
           window=6, swa_pattern=2, theta_swa=10000.0, attn_softcap=1.0, final_softcap=4.0),
    Config("llama_phi2_reference.ctrf", V=256, C=80, L=2, H=4, F=160, B=2, T=24, KVH=4, D=20,
           bias=True, half_split=True, theta=10000.0, eps=1e-5, rope_dim=8, phi2=True),    # Qwen3.5's parts, trained whole: layers DeltaNet, DeltaNet, attention; 2 key heads of 6 read
    # by 4 value heads of 5 (value head h reading key head h mod 2), convolutions of 4 taps;
    # attention with q/k norms, half-split RoPE on 6 of each head's 12 dimensions and its output
    # gated; 70 positions, across the delta rule's chunk of 64.
    Config("llama_qwen35_reference.ctrf", V=256, C=64, L=3, H=4, F=96, B=2, T=70, KVH=2, D=12,
           half_split=True, theta=10000.0, eps=1e-6, qk_norm=True, rope_dim=6,
           qwen35=(2, 4, 6, 5, 4, 3)),
    # Qwen3-MoE's parts, trained whole: per-head q/k norms, 8 experts of width 36, each token's
    # softmax over them, its top 2 renormalised.
    Config("llama_qwen3moe_reference.ctrf", V=256, C=64, L=2, H=4, F=36, B=2, T=24, KVH=2, D=16,
           half_split=True, theta=1e6, eps=1e-6, qk_norm=True, moe=(8, 2, True, 0),
           arch="qwen3moe"),
    # Qwen3.5-MoE's: a DeltaNet layer and a gated attention layer, each with 8 experts of width 28,
    # the top 4 of the softmax renormalised, and a shared expert of width 44 gated by a sigmoid.
    Config("llama_qwen35moe_reference.ctrf", V=256, C=64, L=2, H=4, F=28, B=2, T=24, KVH=2,
           D=12, half_split=True, theta=10000.0, eps=1e-6, qk_norm=True, rope_dim=6,
           qwen35=(2, 4, 6, 5, 4, 2), moe=(8, 4, True, 44), arch="qwen35moe"),
    # gpt-oss's: q/k/v/o biases, a sink per head, layer 0 within a window of 5 keys; 7 experts of
    # width 36 with biases, each token's top 3 logits (the router's bias added) softmaxed, the
    # clamped SwiGLU drawn wide enough that its clamps bite.
    Config("llama_gpt_oss_reference.ctrf", V=256, C=64, L=2, H=4, F=36, B=2, T=24, KVH=2, D=16,
           bias=True, half_split=True, theta=10000.0, eps=1e-5, window=5, swa_pattern=2,
           theta_swa=10000.0, moe=(7, 3, False, 0), gating="topk_softmax", gpt_oss=True,
           arch="gpt-oss"),
]
PROJECTIONS = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
               "feed_forward.w3", "feed_forward.w2"]
LR, BETAS, ADAM_EPS, DECAY, CLIP, STEPS = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0, 10
# The preference records of the configurations with adapters: each pair's prompt length, DPO's
# beta and ORPO's lambda.
PREF_PROMPTS, PREF_BETA, PREF_LAMBDA = (6, 9), 0.5, 0.5
# GRPO's records: each group's prompt length, the completions' rewards (three a group), beta and
# the clipping's epsilons.
GRPO_PROMPTS, GRPO_REWARDS = (5, 8), (1.0, 0.0, 0.5, 0.2, 0.9, 0.9)
GRPO_BETA, GRPO_EPS, GRPO_EPS_HIGH = 0.04, 0.2, 0.28


def parameter_shapes(c):
    Q, KV = c.H * c.D, c.KVH * c.D
    shapes = [("tok_embeddings.weight", (c.V, c.C))]
    for i in range(c.L):
        p = f"layers.{i}."
        shapes += [(p + "attention_norm.weight", (c.C,))]
        if c.linear(i):
            Hk, Hv, dk, dv, K, _ = c.qwen35
            d = p + "linear."
            shapes += [(d + "wq.weight", (Hk * dk, c.C)), (d + "wk.weight", (Hk * dk, c.C)),
                       (d + "wv.weight", (Hv * dv, c.C)), (d + "wz.weight", (Hv * dv, c.C)),
                       (d + "wb.weight", (Hv, c.C)), (d + "wa.weight", (Hv, c.C)),
                       (d + "conv_q.weight", (Hk * dk, K)), (d + "conv_k.weight", (Hk * dk, K)),
                       (d + "conv_v.weight", (Hv * dv, K)), (d + "dt_bias.weight", (Hv,)),
                       (d + "a_log.weight", (Hv,)), (d + "gain.weight", (dv,)),
                       (d + "wo.weight", (c.C, Hv * dv)), (p + "ffn_norm.weight", (c.C,))]
            shapes += mlp_shapes(c, p)
            continue
        if c.qwen35:
            shapes += [(p + "attention.wg.weight", (Q, c.C))]
        if c.phi2:
            shapes += [(p + "attention_norm.bias", (c.C,))]
        shapes += [
            (p + "attention.wq.weight", (Q, c.C)),
            (p + "attention.wk.weight", (KV, c.C)),
            (p + "attention.wv.weight", (KV, c.C)),
        ]
        if c.qk_norm:
            shapes += [(p + "attention.q_norm.weight", (c.D,)), (p + "attention.k_norm.weight", (c.D,))]
        if c.gpt_oss:
            shapes += [(p + "attention.wo.bias", (c.C,)), (p + "attention.sinks.weight", (c.H,))]
        if c.post_norms:
            shapes += [(p + "post_attention_norm.weight", (c.C,)),
                       (p + "post_ffw_norm.weight", (c.C,))]
        if c.bias:
            shapes += [
                (p + "attention.wq.bias", (Q,)),
                (p + "attention.wk.bias", (KV,)),
                (p + "attention.wv.bias", (KV,)),
            ]
        if c.phi2:
            shapes += [
                (p + "attention.wo.weight", (c.C, Q)),
                (p + "attention.wo.bias", (c.C,)),
                (p + "feed_forward.w3.weight", (c.F, c.C)),
                (p + "feed_forward.w3.bias", (c.F,)),
                (p + "feed_forward.w2.weight", (c.C, c.F)),
                (p + "feed_forward.w2.bias", (c.C,)),
            ]
        else:
            shapes += [(p + "attention.wo.weight", (c.C, Q)), (p + "ffn_norm.weight", (c.C,))]
            shapes += mlp_shapes(c, p)
        if c.lora_rank:  # each projection's A (rank, in) and B (out, rank)
            dims = dict(shapes)
            for proj in PROJECTIONS:
                if p + proj + ".weight" not in dims:
                    continue  # Phi-2 has no gate
                out_dim, in_dim = dims[p + proj + ".weight"]
                a = fused_a(c, p + proj + ".lora_a")
                if a not in dict(shapes):
                    shapes += [(a, (c.lora_rank, in_dim))]
                shapes += [(p + proj + ".lora_b", (out_dim, c.lora_rank))]
    shapes += [("norm.weight", (c.C,))]
    if c.phi2:
        shapes += [("norm.bias", (c.C,))]
    if not c.tied:
        shapes += [("output.weight", (c.V, c.C))]
    if c.phi2:
        shapes += [("output.bias", (c.V,))]
    return shapes


def mlp_shapes(c, p):
    """A block's SwiGLU MLP, or its mixture of experts: the router (E, C), each expert's gate and
    up (E, F, C) and down (E, C, F), their biases (gpt-oss), the shared expert and its gate."""
    f = p + "feed_forward."
    if not c.moe:
        return [(f + "w1.weight", (c.F, c.C)), (f + "w3.weight", (c.F, c.C)),
                (f + "w2.weight", (c.C, c.F))]
    E, _, _, S = c.moe
    shapes = [(f + "router.weight", (E, c.C)), (f + "experts.w1.weight", (E, c.F, c.C)),
              (f + "experts.w3.weight", (E, c.F, c.C)), (f + "experts.w2.weight", (E, c.C, c.F))]
    if c.gpt_oss:
        shapes += [(f + "router.bias", (E,)), (f + "experts.w1.bias", (E, c.F)),
                   (f + "experts.w3.bias", (E, c.F)), (f + "experts.w2.bias", (E, c.C))]
    if S:
        shapes += [(f + "shared.w1.weight", (S, c.C)), (f + "shared.w3.weight", (S, c.C)),
                   (f + "shared.w2.weight", (c.C, S)), (f + "shared_gate.weight", (1, c.C))]
    return shapes


def decays(name, t):
    """Whether AdamW decays the parameter: matrices and the experts' weights, not biases, gains
    or sinks."""
    return t.dim() >= 2 and not name.endswith(".bias")


def fused_a(c, name):
    """The A an adapter uses: with fused projections, q, k, v share the qkv one, gate and up the
    gate_up one."""
    if not c.fused:
        return name
    for part, whole in ((".attention.wq.", ".attention.wqkv."), (".attention.wk.", ".attention.wqkv."),
                        (".attention.wv.", ".attention.wqkv."), (".feed_forward.w1.", ".feed_forward.w13."),
                        (".feed_forward.w3.", ".feed_forward.w13.")):
        name = name.replace(part, whole)
    return name


def longrope_factors(c):
    """Short and long divisors of the rotated frequencies, drawn from a fixed seed."""
    g = torch.Generator().manual_seed(77)
    n = c.rope_dim // 2
    return 1.0 + 0.5 * torch.rand(n, generator=g), 1.0 + 8.0 * torch.rand(n, generator=g)


def init_parameters(c, gen):
    params = {}
    for name, shape in parameter_shapes(c):
        if name.endswith(".bias"):
            # Biases away from 0 so they change what attention sees.
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("a_log.weight"):
            # A in (1, 8): decays from slow to fast.
            t = torch.log(1.0 + 7.0 * torch.rand(shape, generator=gen))
        elif ".conv_" in name:
            t = 0.3 * torch.randn(shape, generator=gen)
        elif name.endswith("sinks.weight"):
            # Sinks about as large as the scores, so that each takes a share of the weights.
            t = torch.randn(shape, generator=gen)
        elif name.endswith("router.weight"):
            # Logits of about 1: routing neither uniform nor one-hot.
            t = 0.15 * torch.randn(shape, generator=gen)
        elif name.endswith("shared_gate.weight"):
            t = 0.2 * torch.randn(shape, generator=gen)
        elif c.gpt_oss and (name.endswith("experts.w1.weight") or name.endswith("experts.w3.weight")):
            # The gate and up products at a spread of about 5, so that the clamp at 7 bites.
            t = 0.6 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            # Gains away from 1 so their gradients matter (held less 1 in Gemma's norms).
            t = (0.0 if c.gemma else 1.0) + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".lora_a") or name.endswith(".lora_b"):
            # B away from its zero start, so that A's gradient is not zero.
            t = torch.randn(shape, generator=gen) * 0.05
        elif name.endswith("wo.weight") or name.endswith("w2.weight"):
            t = torch.randn(shape, generator=gen) * (0.02 / math.sqrt(2 * c.L))
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        trainable = not c.lora_rank or ".lora_" in name
        params[name] = t.float().requires_grad_(trainable)
    return params


def llama3_factors(c):
    """Each frequency's divisor under Llama 3's scaling, from Hugging Face's formula: inv_freq
    kept below original / high, divided by factor above original / low, blended between."""
    factor, low, high, original = c.scaling
    out = []
    for j in range(c.D // 2):
        inv_freq = c.theta ** (-2.0 * j / c.D)
        wavelength = 2 * math.pi / inv_freq
        if wavelength < original / high:
            scaled = inv_freq
        elif wavelength > original / low:
            scaled = inv_freq / factor
        else:
            smooth = (original / wavelength - low) / (high - low)
            scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out.append(inv_freq / scaled)
    # Held as float32 divisors, as GGUF's rope_freqs.weight holds them.
    return torch.tensor(out, dtype=torch.float32).double()


def rope_table(c, theta=None):
    # Angles in float64, rounded to float32, as the C++ table is; R the rotated dimensions.
    R = c.rope_dim or c.D
    pos = torch.arange(c.T, dtype=torch.float64)[:, None]
    j = torch.arange(R // 2, dtype=torch.float64)[None, :]
    freq = (theta or c.theta) ** (-2.0 * j / R)
    scale = 1.0
    if c.scaling:
        freq = freq / llama3_factors(c)[None, :]
    if c.longrope:
        original, ctx = c.longrope
        short, long = longrope_factors(c)
        freq = freq / (long if ctx > original else short).float().double()[None, :]
        scale = math.sqrt(1 + math.log(ctx / original) / math.log(original))
    angle = pos * freq
    return (scale * torch.cos(angle)).float(), (scale * torch.sin(angle)).float()


def layernorm(c, x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + c.eps) * w + b


def rmsnorm(c, x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.eps) * ((1.0 + w) if c.gemma else w)


def rope(c, x, cos, sin):
    # x (B, T, H, D): rotate each pair of position t by its angle; with rope_dim only the first
    # rope_dim of each head, the rest passing.
    cs, sn = cos[None, :, None, :], sin[None, :, None, :]
    if c.rope_dim:
        R = c.rope_dim
        x0, x1, rest = x[..., : R // 2], x[..., R // 2: R], x[..., R:]
        return torch.cat((x0 * cs - x1 * sn, x0 * sn + x1 * cs, rest), dim=-1)
    if c.half_split:  # pairs (x[j], x[j + D/2]), Hugging Face's rotate_half
        x0, x1 = x[..., : c.D // 2], x[..., c.D // 2:]
        return torch.cat((x0 * cs - x1 * sn, x0 * sn + x1 * cs), dim=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]  # adjacent pairs (x[2j], x[2j+1])
    return torch.stack((x0 * cs - x1 * sn, x0 * sn + x1 * cs), dim=-1).flatten(-2)


def attention(c, q, k, v, window=0, sinks=None):
    # q (B, T, H, D), k and v (B, T, KVH, D) -> (B, T, H, D), causal, scale 1/sqrt(D) (or
    # attn_scale), within `window` keys of each query where given; query head h reads kv head
    # h // (H / KVH).
    k = k.repeat_interleave(c.H // c.KVH, dim=2)
    v = v.repeat_interleave(c.H // c.KVH, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * (c.attn_scale or 1.0 / math.sqrt(c.D))
    if c.attn_softcap:
        scores = c.attn_softcap * torch.tanh(scores / c.attn_softcap)
    mask = torch.ones(c.T, c.T, dtype=torch.bool).tril()
    if window:
        mask = mask & ~torch.ones(c.T, c.T, dtype=torch.bool).tril(-window)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        # Each head's sink, one more logit in its softmax whose value is zero (gpt-oss).
        sink = sinks[None, :, None, None].expand(scores.shape[0], c.H, c.T, 1)
        return (torch.cat((scores, sink), -1).softmax(-1)[..., :-1] @ v).transpose(1, 2)
    return (scores.softmax(-1) @ v).transpose(1, 2)


def projection(c, p, name, h):
    y = h @ p[name + ".weight"].T
    if (c.bias or c.phi2) and name + ".bias" in p:
        y = y + p[name + ".bias"]
    if c.lora_rank:
        a = p[fused_a(c, name + ".lora_a")]
        y = y + (h @ a.T @ p[name + ".lora_b"].T) * (c.lora_alpha / c.lora_rank)
    return y


def causal_conv_silu(x, w):
    # x (B, T, channels), w (channels, K): each channel over its K - 1 positions before (zeros
    # before the first) and itself, then SiLU.
    K, T = w.shape[1], x.shape[1]
    padded = torch.nn.functional.pad(x, (0, 0, K - 1, 0))
    return torch.nn.functional.silu(sum(w[:, j] * padded[:, j:j + T] for j in range(K)))


def l2norm(c, x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + c.eps)


def gated_deltanet(c, p, n, h):
    # Qwen3.5's linear attention, the delta rule in its recurrent form: per value head a state S
    # (dk x dv), decayed by exp(g), corrected toward v by beta, read by q / sqrt(dk).
    Hk, Hv, dk, dv, K, _ = c.qwen35
    B, T = c.B, c.T
    d = n + "linear."
    q = causal_conv_silu(h @ p[d + "wq.weight"].T, p[d + "conv_q.weight"]).view(B, T, Hk, dk)
    k = causal_conv_silu(h @ p[d + "wk.weight"].T, p[d + "conv_k.weight"]).view(B, T, Hk, dk)
    v = causal_conv_silu(h @ p[d + "wv.weight"].T, p[d + "conv_v.weight"]).view(B, T, Hv, dv)
    q, k = l2norm(c, q) / math.sqrt(dk), l2norm(c, k)
    # Value head j reads key head j mod Hk (llama.cpp's tiled order).
    q, k = q.repeat(1, 1, Hv // Hk, 1), k.repeat(1, 1, Hv // Hk, 1)
    g = -p[d + "a_log.weight"].exp() * torch.nn.functional.softplus(
        h @ p[d + "wa.weight"].T + p[d + "dt_bias.weight"])
    beta = torch.sigmoid(h @ p[d + "wb.weight"].T)
    S = torch.zeros(B, Hv, dk, dv)
    outs = []
    for t in range(T):
        S = S * g[:, t, :, None, None].exp()
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1)  # (B, T, Hv, dv)
    z = (h @ p[d + "wz.weight"].T).view(B, T, Hv, dv)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps) * p[d + "gain.weight"]
    o = o * torch.nn.functional.silu(z)
    return o.reshape(B, T, Hv * dv) @ p[d + "wo.weight"].T


ROUTING_GAPS = []  # each routing's smallest margin at its k-th choice (a tie would be ambiguous)
CLAMPED = []  # the share of the clamped SwiGLU's gate and up elements that its clamps bite


def gated(c, gate, up, clamped=False):
    """act(gate) * up: SiLU, Gemma's GELU, or gpt-oss's clamped SwiGLU (the gate clamped above at
    7, up to [-7, 7]; g sigmoid(1.702 g) (up + 1))."""
    if clamped:
        CLAMPED.append(((gate > 7).float().mean().item(), (up.abs() > 7).float().mean().item()))
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1)
    if c.gemma:
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.silu(gate) * up


def mlp(c, p, n, g):
    """A block's MLP from its normed input g: gated (SwiGLU, GeGLU), or the mixture of experts
    (each expert run on every token here, each token's output the weighted sum of its chosen
    experts')."""
    f = n + "feed_forward."
    if not c.moe:
        gate, up = projection(c, p, f + "w1", g), projection(c, p, f + "w3", g)
        return projection(c, p, f + "w2", gated(c, gate, up))
    E, k, renormalise, S = c.moe
    logits = g @ p[f + "router.weight"].T
    if c.gpt_oss:
        logits = logits + p[f + "router.bias"]
    if c.gating == "softmax":
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(k, dim=-1)
        if renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        ranked = probs.detach().sort(-1, descending=True).values
    else:
        top, chosen = logits.topk(k, dim=-1)
        weights = top.softmax(-1)
        ranked = logits.detach().sort(-1, descending=True).values
    ROUTING_GAPS.append((ranked[..., k - 1] - ranked[..., k]).min().item())
    outs = []
    for e in range(E):
        gate = g @ p[f + "experts.w1.weight"][e].T
        up = g @ p[f + "experts.w3.weight"][e].T
        if c.gpt_oss:
            gate, up = gate + p[f + "experts.w1.bias"][e], up + p[f + "experts.w3.bias"][e]
        y = gated(c, gate, up, c.gpt_oss) @ p[f + "experts.w2.weight"][e].T
        if c.gpt_oss:
            y = y + p[f + "experts.w2.bias"][e]
        outs.append(y)
    every = torch.stack(outs, -2)  # (B, T, E, C)
    picked = every.gather(-2, chosen[..., None].expand(*chosen.shape, c.C))  # (B, T, k, C)
    out = (weights[..., None] * picked).sum(-2)
    if S:
        shared = gated(c, g @ p[f + "shared.w1.weight"].T, g @ p[f + "shared.w3.weight"].T)
        shared = shared @ p[f + "shared.w2.weight"].T
        out = out + shared * torch.sigmoid(g @ p[f + "shared_gate.weight"].T)
    return out


def forward(c, p, tokens, cos, sin):
    B, T, H, KVH, D = c.B, c.T, c.H, c.KVH, c.D
    cos_swa, sin_swa = rope_table(c, c.theta_swa) if c.window else (cos, sin)
    x = p["tok_embeddings.weight"][tokens]
    if c.gemma:
        x = x * torch.tensor(math.sqrt(c.C), dtype=torch.float32)
    for i in range(c.L):
        n = f"layers.{i}."
        if c.phi2:
            h = layernorm(c, x, p[n + "attention_norm.weight"], p[n + "attention_norm.bias"])
        else:
            h = rmsnorm(c, x, p[n + "attention_norm.weight"])
        if c.linear(i):
            x = x + gated_deltanet(c, p, n, h)
            x = x + mlp(c, p, n, rmsnorm(c, x, p[n + "ffn_norm.weight"]))
            continue
        q = projection(c, p, n + "attention.wq", h).view(B, T, H, D)
        k = projection(c, p, n + "attention.wk", h).view(B, T, KVH, D)
        if c.qk_norm:  # over each head's D elements
            q = rmsnorm(c, q, p[n + "attention.q_norm.weight"])
            k = rmsnorm(c, k, p[n + "attention.k_norm.weight"])
        windowed = c.window and i % c.swa_pattern < c.swa_pattern - 1
        cs, sn = (cos_swa, sin_swa) if windowed else (cos, sin)
        if i not in c.no_rope:
            q, k = rope(c, q, cs, sn), rope(c, k, cs, sn)
        v = projection(c, p, n + "attention.wv", h).view(B, T, KVH, D)
        sinks = p[n + "attention.sinks.weight"] if c.gpt_oss else None
        heads = attention(c, q, k, v, c.window if windowed else 0, sinks).reshape(B, T, H * D)
        if c.qwen35:  # the output gated
            heads = heads * torch.sigmoid(h @ p[n + "attention.wg.weight"].T)
        attended = projection(c, p, n + "attention.wo", heads)
        if c.post_norms:
            attended = rmsnorm(c, attended, p[n + "post_attention_norm.weight"])
        if c.phi2:  # the MLP from the same norm, both added to the residual
            up = projection(c, p, n + "feed_forward.w3", h)
            act = torch.nn.functional.gelu(up, approximate="tanh")
            x = x + attended + projection(c, p, n + "feed_forward.w2", act)
            continue
        x = x + attended
        down = mlp(c, p, n, rmsnorm(c, x, p[n + "ffn_norm.weight"]))
        if c.post_norms:
            down = rmsnorm(c, down, p[n + "post_ffw_norm.weight"])
        x = x + down
    if c.phi2:
        x = layernorm(c, x, p["norm.weight"], p["norm.bias"])
        return x @ p["output.weight"].T + p["output.bias"]
    x = rmsnorm(c, x, p["norm.weight"])
    logits = x @ p["tok_embeddings.weight" if c.tied else "output.weight"].T
    if c.final_softcap:
        logits = c.final_softcap * torch.tanh(logits / c.final_softcap)
    return logits


def loss_of(c, logits, targets):
    return torch.nn.functional.cross_entropy(logits.view(-1, c.V), targets.view(-1))


class Writer:
    def __init__(self):
        self.records = []

    def add(self, name, tensor):
        t = tensor.detach().contiguous()
        if t.dtype in (torch.int32, torch.int64):
            dtype, data = 1, t.to(torch.int32).numpy().astype("<i4").tobytes()
        else:
            dtype, data = 0, t.to(torch.float32).numpy().astype("<f4").tobytes()
        name_bytes = name.encode()
        header = struct.pack("<I", len(name_bytes)) + name_bytes
        header += struct.pack("<II", dtype, t.dim()) + b"".join(struct.pack("<Q", d) for d in t.shape)
        self.records.append(header + data)

    def write(self, path):
        with open(path + ".tmp", "wb") as f:
            f.write(b"CTRF" + struct.pack("<II", 1, len(self.records)))
            for r in self.records:
                f.write(r)
        os.replace(path + ".tmp", path)


def preference_records(c, params, trained, cos, sin, out):
    """DPO and ORPO on two pairs, from the papers' formulas: each sequence's sum of its completion
    tokens' log-probabilities (log_softmax of the logits at the targets), the reference's from the
    same weights without the adapters; DPO's sigmoid loss with PREF_BETA, and ORPO's NLL of the
    chosen tokens plus PREF_LAMBDA times -log sigmoid of the log odds ratio of the per-token means;
    each loss and the adapters' gradients."""
    gen = torch.Generator().manual_seed(4321)
    rows = dataclasses.replace(c, B=4)  # chosen, rejected, chosen, rejected: a sequence a row
    seqs, masks = [], []
    for prompt in PREF_PROMPTS:
        chosen = torch.randint(0, c.V, (c.T + 1,), generator=gen)
        rejected = torch.randint(0, c.V, (c.T + 1,), generator=gen)
        rejected[:prompt] = chosen[:prompt]  # the prompt they share
        for s in (chosen, rejected):
            seqs.append(s)
            masks.append((torch.arange(c.T) + 1 >= prompt).float())  # targets: the completion
    seqs, mask = torch.stack(seqs), torch.stack(masks)
    inputs, targets = seqs[:, :c.T], seqs[:, 1:]

    def sums(config):
        logp = torch.log_softmax(forward(config, params, inputs, cos, sin), -1)
        return (logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask).sum(-1)

    with torch.no_grad():
        reference = sums(dataclasses.replace(rows, lora_rank=0))
    count = mask.sum(-1)
    out.add("pref/tokens", seqs)
    out.add("pref/prompts", torch.tensor(PREF_PROMPTS, dtype=torch.int32))
    out.add("pref/options", torch.tensor([PREF_BETA, PREF_LAMBDA]))
    out.add("pref/reference", reference)
    logsigmoid = torch.nn.functional.logsigmoid
    for method in ("dpo", "orpo"):
        for t in trained.values():
            t.grad = None
        logps = sums(rows)
        pc, pr = logps[0::2], logps[1::2]
        if method == "dpo":
            rc, rr = reference[0::2], reference[1::2]
            loss = -logsigmoid(PREF_BETA * ((pc - rc) - (pr - rr))).mean()
        else:
            ac, ar = pc / count[0::2], pr / count[1::2]
            log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
            nll = -pc.sum() / count[0::2].sum()
            loss = nll - PREF_LAMBDA * logsigmoid(log_odds).mean()
        loss.backward()
        out.add(method + "/logps", logps)
        out.add(method + "/loss", loss.reshape(1))
        for name, t in trained.items():
            out.add(method + "/grad/" + name, t.grad)
    for t in trained.values():
        t.grad = None


def grpo_records(c, params, trained, cos, sin, out):
    """GRPO on two groups of three completions, from TRL's formulas: advantages (r - mean) /
    (std + 1e-4) within each group (Bessel's std); per completion token r = exp(logp - old),
    -min(r A, clamp(r, 1 - GRPO_EPS, 1 + GRPO_EPS_HIGH) A) + GRPO_BETA (exp(ref - logp) - (ref -
    logp) - 1), the reference's log-probabilities from the same weights without the adapters and
    the old ones the policy's perturbed (so that some ratios are clipped); the losses of TRL's
    dapo (over all completion tokens), grpo (each completion's mean, then their mean) and dr_grpo
    (over completions x T) and the adapters' gradients."""
    gen = torch.Generator().manual_seed(8765)
    G = 3
    rows = dataclasses.replace(c, B=2 * G)
    seqs, masks = [], []
    for g, prompt in enumerate(GRPO_PROMPTS):
        head = torch.randint(0, c.V, (prompt,), generator=gen)
        for i in range(G):
            seq = torch.randint(0, c.V, (c.T + 1,), generator=gen)
            seq[:prompt] = head
            end = c.T + 1 - (2 * i + g)  # completions of several lengths
            positions = torch.arange(c.T) + 1
            seqs.append(seq)
            masks.append(((positions >= prompt) & (positions < end)).float())
    seqs, mask = torch.stack(seqs), torch.stack(masks)
    inputs, targets = seqs[:, :c.T], seqs[:, 1:]
    rewards = torch.tensor(GRPO_REWARDS, dtype=torch.float32)

    def token_logps(config):
        logp = torch.log_softmax(forward(config, params, inputs, cos, sin), -1)
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        reference = token_logps(dataclasses.replace(rows, lora_rank=0))
        old = token_logps(rows) + 0.3 * torch.randn(mask.shape, generator=gen)
    grouped = rewards.view(-1, G)
    advantages = (rewards - grouped.mean(1).repeat_interleave(G)) / (
        grouped.std(1).repeat_interleave(G) + 1e-4)
    out.add("grpo/tokens", seqs)
    out.add("grpo/mask", mask)
    out.add("grpo/rewards", rewards)
    out.add("grpo/old", old)
    out.add("grpo/options", torch.tensor([GRPO_BETA, GRPO_EPS, GRPO_EPS_HIGH, G]))
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        for t in trained.values():
            t.grad = None
        logp = token_logps(rows)
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, 1 - GRPO_EPS, 1 + GRPO_EPS_HIGH)
        a = advantages.unsqueeze(1)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
        d = reference - logp
        per_token = per_token + GRPO_BETA * (torch.exp(d) - d - 1)
        if loss_type == "dapo":
            loss = (per_token * mask).sum() / mask.sum()
        elif loss_type == "grpo":
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        else:
            loss = (per_token * mask).sum() / (mask.shape[0] * c.T)
        loss.backward()
        out.add(loss_type + "/loss", loss.reshape(1))
        for name, t in trained.items():
            out.add(loss_type + "/grad/" + name, t.grad)
    for t in trained.values():
        t.grad = None


def float64_grad_norms(c):
    """The gradient norms of write_reference's 10 AdamW steps (all parameters trained), in
    float64 from the same weights and batch."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    params = init_parameters(c, gen)
    tokens = torch.randint(0, c.V, (c.B, c.T), generator=gen)
    targets = torch.randint(0, c.V, (c.B, c.T), generator=gen)
    cos, sin = rope_table(c)
    torch.set_default_dtype(torch.float64)
    try:
        params = {k: v.detach().double().requires_grad_(True) for k, v in params.items()}
        cos, sin = cos.double(), sin.double()
        matrices = [t for name, t in params.items() if decays(name, t)]
        vectors = [t for name, t in params.items() if not decays(name, t)]
        opt = torch.optim.AdamW([{"params": matrices, "weight_decay": DECAY},
                                 {"params": vectors, "weight_decay": 0.0}],
                                lr=LR, betas=BETAS, eps=ADAM_EPS)
        norms = []
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=False)
            loss_of(c, forward(c, params, tokens, cos, sin), targets).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP).item())
            opt.step()
        return norms
    finally:
        torch.set_default_dtype(torch.float32)


def write_reference(c):
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(1234)
    params = init_parameters(c, gen)
    tokens = torch.randint(0, c.V, (c.B, c.T), generator=gen)
    targets = torch.randint(0, c.V, (c.B, c.T), generator=gen)
    cos, sin = rope_table(c)

    out = Writer()
    config = [c.V, c.C, c.L, c.H, c.F, c.B, c.T]
    if c.file != CONFIGS[0].file:  # the tiny file keeps its original 7 fields
        config += [c.KVH, c.D, int(c.tied), int(c.bias), int(c.half_split)]
        floats = [c.theta, c.eps]
        if c.lora_rank:  # and the gqa file its 12
            config += [c.lora_rank]
            floats += [c.lora_alpha]
        out.add("config", torch.tensor(config, dtype=torch.int32))
        out.add("config_f32", torch.tensor(floats, dtype=torch.float32))
        if c.fused:
            # rope_dim, the original context and the ctx the model runs at; the factors.
            original, ctx = c.longrope
            out.add("phi3", torch.tensor([c.rope_dim, original, ctx], dtype=torch.int32))
            short, long = longrope_factors(c)
            out.add("short_factors", short)
            out.add("long_factors", long)
        if c.gemma or c.phi2 or c.arch:
            name = b"phi2"
            if c.gemma:
                name = (b"gemma2" if c.attn_softcap else b"gemma3") if c.post_norms else b"gemma"
            if c.arch:
                name = c.arch.encode()
            out.add("architecture", torch.tensor(list(name), dtype=torch.int32))
        if c.phi2:
            out.add("rope_dim", torch.tensor([c.rope_dim], dtype=torch.int32))
        if c.qwen35:  # its heads, dims, taps and interval; RoPE's dimensions
            out.add("qwen35", torch.tensor(list(c.qwen35) + [c.rope_dim], dtype=torch.int32))
        if c.moe:  # experts, used, renormalised, the shared expert's width
            E, k, renormalise, S = c.moe
            out.add("moe", torch.tensor([E, k, int(renormalise), S], dtype=torch.int32))
        if c.window:  # the window, the pattern; RoPE base of the windowed layers, the scale
            out.add("window", torch.tensor([c.window, c.swa_pattern], dtype=torch.int32))
            out.add("window_f32", torch.tensor([c.theta_swa, c.attn_scale, c.attn_softcap,
                                                c.final_softcap], dtype=torch.float32))
        if c.qk_norm or c.scaling or c.no_rope:
            # qk_norm, then a 0/1 per layer (1: without RoPE); the scaling's four numbers.
            out.add("parts", torch.tensor([int(c.qk_norm)] + [int(i in c.no_rope)
                                                              for i in range(c.L)],
                                          dtype=torch.int32))
            out.add("parts_f32", torch.tensor(list(c.scaling or (0, 0, 0, 0)),
                                              dtype=torch.float32))
    else:
        out.add("config", torch.tensor(config, dtype=torch.int32))
    out.add("tokens", tokens)
    out.add("targets", targets)
    for name, t in params.items():
        out.add("init/" + name, t)

    logits = forward(c, params, tokens, cos, sin)
    loss = loss_of(c, logits, targets)
    loss.backward()
    out.add("logits", logits)
    out.add("loss", loss.reshape(1))
    trained = {name: t for name, t in params.items() if t.requires_grad}
    for name, t in trained.items():
        out.add("grad/" + name, t.grad)

    if c.lora_rank:
        preference_records(c, params, trained, cos, sin, out)
        grpo_records(c, params, trained, cos, sin, out)

    matrices = [t for name, t in trained.items() if decays(name, t)]
    vectors = [t for name, t in trained.items() if not decays(name, t)]  # gains, biases: no decay
    groups = [{"params": matrices, "weight_decay": DECAY}]
    if vectors:
        groups.append({"params": vectors, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=ADAM_EPS)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        loss = loss_of(c, forward(c, params, tokens, cos, sin), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(trained.values()), CLIP)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    if c.moe:
        # The routing's smallest margin at the k-th choice over the forward passes, far above
        # float32's rounding (a near tie could choose otherwise in cputrain); the share of the
        # clamps that bite, enough that their gradients are tested.
        gap = min(ROUTING_GAPS)
        print(f"{c.file}: smallest routing margin {gap:.3g}")
        assert gap > 1e-6, f"{c.file}: a near tie in the routing ({gap:.3g}): draw again"
        if CLAMPED:
            gates = sum(g for g, _ in CLAMPED) / len(CLAMPED)
            ups = sum(u for _, u in CLAMPED) / len(CLAMPED)
            print(f"{c.file}: clamps bite on {100 * gates:.1f}% of gates, {100 * ups:.1f}% of ups")
            assert gates > 0.01 and ups > 0.01, f"{c.file}: the clamps hardly bite"
        ROUTING_GAPS.clear()
        CLAMPED.clear()
    out.add("steps/loss", torch.tensor(losses))
    out.add("steps/grad_norm", torch.tensor(norms))
    if c.qwen35:
        # The decay's parameters make the later steps sensitive to rounding: the same steps in
        # float64 say how far this float32 run's own gradient norms stray.
        out.add("steps/grad_norm_f64", torch.tensor(float64_grad_norms(c), dtype=torch.float32))
    for name, t in params.items():
        out.add("final/" + name, t)

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", c.file)
    out.write(os.path.normpath(path))
    print(f"{c.file}: init loss {losses[0]:.6f}, after {STEPS} steps {losses[-1]:.6f}; grad norms "
          + " ".join(f"{n:.4f}" for n in norms))
    print(f"wrote {os.path.normpath(path)} ({os.path.getsize(path)} bytes)")


def main():
    import sys
    only = sys.argv[1:]  # file names; all where none are given
    for c in CONFIGS:
        if not only or c.file in only:
            write_reference(c)


if __name__ == "__main__":
    main()
