#!/usr/bin/python3
"""A GGUF of a published model's shape with random BF16 weights, for the load, decode, memory and
fine-tuning benchmarks.

Usage: make_model.py GGUF_PY_DIR OUT.gguf [SHAPE]
SHAPE (default qwen2-0.5b; 0.5b and 3b are qwen2-0.5b and qwen2-3b):
  qwen2-0.5b   Qwen2.5-0.5B: d_model 896, 24 layers, 14 heads over 2 of 64, ffn 4864, q/k/v
               biases (494M parameters)
  qwen2-3b     Qwen2.5-3B: d_model 2048, 36 layers, 16 heads over 2 of 128, ffn 11008, biases
  qwen3-0.6b   Qwen3-0.6B: d_model 1024, 28 layers, 16 heads over 8 of 128, ffn 3072, q/k norms
               (596M)
  llama3.2-1b  Llama-3.2-1B: d_model 2048, 16 layers, 32 heads over 8 of 64, ffn 8192, theta 5e5,
               Llama 3's RoPE scaling (factor 32, original context 8192) (1.24B)
  llama3.1-8b  Llama-3.1-8B: d_model 4096, 32 layers, 32 heads over 8 of 128, ffn 14336, theta 5e5,
               Llama 3's RoPE scaling (factor 8), an untied head (8.03B)
  smollm3-3b   SmolLM3-3B: d_model 2048, 36 layers, 16 heads over 4 of 128, ffn 11008, every
               fourth layer without RoPE (3.08B)
  phi4-mini    Phi-4-mini: d_model 3072, 32 layers, 24 heads over 8 of 128, ffn 8192, fused qkv and
               gate/up tensors, RoPE on 96 of each head's 128 dimensions, longrope (3.84B)
  phi2         Phi-2: d_model 2560, 32 layers, 32 heads of 80, ffn 10240, LayerNorms with biases,
               attention and a GELU MLP in parallel, biases everywhere, RoPE on 32 of 80
               dimensions, an untied head with a bias (2.78B)
  gemma-2b     Gemma 2B: d_model 2048, 18 layers, 8 heads over 1 of 256, ffn 16384, GeGLU, vocab
               256000 (2.51B)
  gemma3-1b    Gemma 3 1B: d_model 1152, 26 layers, 4 heads over 1 of 256, ffn 6912, GeGLU, q/k
               norms, norms after attention and the MLP, five layers of six within a window of
               512 at RoPE base 10,000 (the others 1,000,000), vocab 262144 (1.00B)
  qwen35-0.8b  Qwen3.5-0.8B: d_model 1024, 24 layers (Gated DeltaNet in three of four: 16 key and
               16 value heads of 128, a convolution of 4; the fourth attention with 8 heads over 2
               of 256, its output gated, RoPE on 64 of each head's 256), ffn 3584, vocab 248320
               (0.75B)
  qwen35-2b    Qwen3.5-2B: the same with d_model 2048, ffn 6144 (1.9B)
  qwen3-30b-a3b  Qwen3-30B-A3B: d_model 2048, 48 layers, 32 heads over 4 of 128, q/k norms, a
               mixture of 128 experts of 768 in every MLP's place, 8 a token, an untied head
               (30.5B; 3.3B active)
  gpt-oss-20b  gpt-oss-20b: d_model 2880, 24 layers, 64 heads over 8 of 64 with q/k/v/o biases
               and a sink each, every other layer within a window of 128, YaRN (factor 32 from
               4096), 32 experts of 2880 with biases, 4 a token, vocab 201088, an untied head
               (20.9B; 3.6B active)
  gemma4-e2b   Gemma 4 E2B: d_model 1536, 35 layers, 8 heads over 1, of 256 in the windowed
               layers (four of five, a window of 512) and 512 in the global ones (proportional
               RoPE on a quarter), ffn 6144 (12288 in the last 20 layers, which share the keys and
               values of layers 13 and 14), per-layer embeddings of 256 (a table of 262144 x
               8960), a soft-cap of 30, vocab 262144, the gemma-4 tokenizer (5.1B; 2.3B without
               the per-layer table)
All but phi2, llama3.1-8b and the mixtures tie the head to the embedding. The tokenizer is llama.cpp's test vocabulary of the family
(models/ggml-vocab-*.gguf next to gguf-py: qwen2, llama-bpe, phi-3), padded to the model's
vocabulary as the published files are. Tensors are generated and written one at a time, so the
writer holds one in memory. A mixture's matrices are Q8_0 (uniform random codes, std 0.02), not
BF16: half the disk for a file that llama.cpp's quantiser then turns into Q4_K_M or MXFP4_MOE
(build/llama_oracle quantize).
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402

# arch, d_model, ffn, layers, heads, kv heads, head dim, vocab, theta, tokenizer file, extras
SHAPES = {
    "qwen2-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 64, 151936, 1e6, "qwen2", {"bias": True}),
    "qwen2-3b": ("qwen2", 2048, 11008, 36, 16, 2, 128, 151936, 1e6, "qwen2", {"bias": True}),
    "qwen3-0.6b": ("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, 1e6, "qwen2", {"qk_norm": True}),
    "llama3.2-1b": ("llama", 2048, 8192, 16, 32, 8, 64, 128256, 5e5, "llama-bpe",
                    {"llama3": (32.0, 1.0, 4.0, 8192), "adjacent": True}),
    "llama3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, 5e5, "llama-bpe",
                    {"llama3": (8.0, 1.0, 4.0, 8192), "adjacent": True, "untied": True}),
    "smollm3-3b": ("smollm3", 2048, 11008, 36, 16, 4, 128, 128256, 5e6, "llama-bpe",
                   {"adjacent": True}),
    "phi4-mini": ("phi3", 3072, 8192, 32, 24, 8, 128, 200064, 1e4, "phi-3",
                  {"fused": True, "rope_dim": 96, "longrope": (4096, 131072)}),
    "phi2": ("phi2", 2560, 10240, 32, 32, 32, 80, 51200, 1e4, "gpt-2",
             {"phi2": True, "rope_dim": 32}),
    "gemma-2b": ("gemma", 2048, 16384, 18, 8, 1, 256, 256000, 1e4, "llama-spm", {}),
    "gemma3-1b": ("gemma3", 1152, 6912, 26, 4, 1, 256, 262144, 1e6, "llama-spm",
                  {"qk_norm": True, "post_norms": True, "window": 512}),
    "qwen35-0.8b": ("qwen35", 1024, 3584, 24, 8, 2, 256, 248320, 1e7, "qwen35",
                    {"qk_norm": True, "rope_dim": 64, "qwen35": (16, 16, 128, 4)}),
    "qwen35-2b": ("qwen35", 2048, 6144, 24, 8, 2, 256, 248320, 1e7, "qwen35",
                  {"qk_norm": True, "rope_dim": 64, "qwen35": (16, 16, 128, 4)}),
    "qwen3-30b-a3b": ("qwen3moe", 2048, 768, 48, 32, 4, 128, 151936, 1e6, "qwen2",
                      {"qk_norm": True, "untied": True, "moe": (128, 8, 6144)}),
    "gpt-oss-20b": ("gpt-oss", 2880, 2880, 24, 64, 8, 64, 201088, 1.5e5, "qwen2",
                    {"gpt_oss": True, "untied": True, "moe": (32, 4, 2880)}),
    "gemma4-e2b": ("gemma4", 1536, 6144, 35, 8, 1, 512, 262144, 1e6, "gemma-4",
                   {"gemma4": dict(head_swa=256, pattern=5, shared=20, per_layer=256, window=512,
                                   rotated=0.25, cap=30.0)}),
}
ALIASES = {"0.5b": "qwen2-0.5b", "3b": "qwen2-3b"}
shape = sys.argv[3] if len(sys.argv) > 3 else "qwen2-0.5b"
shape = ALIASES.get(shape, shape)
if shape not in SHAPES:
    sys.exit(f"make_model.py: SHAPE {shape!r} is not one of {', '.join(SHAPES)}")
ARCH, D, F, LAYERS, HEADS, KV, HEAD, VOCAB, THETA, TOKENIZER, EXTRA = SHAPES[shape]
rng = np.random.default_rng(3)

w = gguf.GGUFWriter(sys.argv[2], ARCH)
CTX = EXTRA["longrope"][1] if "longrope" in EXTRA else 131072 if "gpt_oss" in EXTRA else 32768
w.add_context_length(CTX)
w.add_embedding_length(D)
w.add_block_count(LAYERS)
G4 = EXTRA.get("gemma4")
if G4:
    WINDOWED = [i % G4["pattern"] < G4["pattern"] - 1 for i in range(LAYERS)]
    FIRST_SHARED = LAYERS - G4["shared"]
    WIDTHS = [F if i < FIRST_SHARED else 2 * F for i in range(LAYERS)]
if "moe" in EXTRA:
    EXPERTS, USED, DENSE_FFN = EXTRA["moe"]
    w.add_feed_forward_length(DENSE_FFN)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_expert_feed_forward_length(F)
elif G4:
    w.add_feed_forward_length(WIDTHS)
else:
    w.add_feed_forward_length(F)
w.add_head_count(HEADS)
w.add_head_count_kv(KV)
w.add_key_length(HEAD)
w.add_value_length(HEAD)
w.add_rope_dimension_count(EXTRA.get("rope_dim", HEAD))
if ARCH == "phi2":
    w.add_layer_norm_eps(1e-5)
else:
    w.add_layer_norm_rms_eps(1e-5 if ARCH in ("llama", "gpt-oss") else 1e-6)
w.add_rope_freq_base(THETA)
vocab = gguf.GGUFReader(os.path.join(sys.argv[1], "..", "models", f"ggml-vocab-{TOKENIZER}.gguf"))


def field(name):
    f = vocab.fields[name]
    return [bytes(f.parts[i]).decode() for i in f.data] if f.types[0] == gguf.GGUFValueType.ARRAY \
        and f.types[-1] == gguf.GGUFValueType.STRING else [
            f.parts[i][0].item() for i in f.data]


tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
tokens += [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
types += [gguf.TokenType.UNUSED] * (VOCAB - len(types))
model = "llama" if TOKENIZER in ("phi-3", "llama-spm") else "gemma4" if G4 else "gpt2"
w.add_tokenizer_model(model)
if model == "gemma4":
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id")[0])
    w.add_add_space_prefix(False)
    w.add_chat_template(bytes(vocab.fields["tokenizer.chat_template"].parts[
        vocab.fields["tokenizer.chat_template"].data[0]]).decode())
elif model == "gpt2":
    w.add_tokenizer_pre(TOKENIZER)
    w.add_token_merges(field("tokenizer.ggml.merges"))
else:
    scores = field("tokenizer.ggml.scores")
    w.add_token_scores(scores + [0.0] * (VOCAB - len(scores)))
w.add_token_list(tokens)
w.add_token_types(types)
w.add_eos_token_id(field("tokenizer.ggml.eos_token_id")[0])
w.add_add_bos_token(model == "llama" or TOKENIZER == "gemma-4")
if ARCH in ("gemma", "gemma3"):
    w.add_add_space_prefix(False)
if "qwen35" in EXTRA:
    HK, HV, DK, CONV = EXTRA["qwen35"]
    w.add_ssm_conv_kernel(CONV)
    w.add_ssm_state_size(DK)
    w.add_ssm_group_count(HK)
    w.add_ssm_time_step_rank(HV)
    w.add_ssm_inner_size(HV * DK)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_sections([11, 11, 10, 0])
if "gpt_oss" in EXTRA:
    w.add_sliding_window(128)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
if G4:
    HEAD_SWA = G4["head_swa"]
    w.add_key_length_swa(HEAD_SWA)
    w.add_value_length_swa(HEAD_SWA)
    w.add_rope_dimension_count_swa(HEAD_SWA)
    w.add_rope_freq_base_swa(1e4)
    w.add_sliding_window(G4["window"])
    w.add_sliding_window_pattern(WINDOWED)
    w.add_shared_kv_layers(G4["shared"])
    w.add_embedding_length_per_layer_input(G4["per_layer"])
    w.add_final_logit_softcapping(G4["cap"])
if "window" in EXTRA:
    w.add_sliding_window(EXTRA["window"])
    w.add_sliding_window_pattern(6)
    w.add_rope_freq_base_swa(1e4)

# (name, shape, what): "bf16" Normal(0, 0.02) rounded to bf16, "q8_0" a mixture's matrices,
# "ones" and "bias" FP32, "factors" RoPE factors FP32.
Q, KVD = HEADS * HEAD, KV * HEAD
MATRIX = "q8_0" if "moe" in EXTRA else "bf16"
tensors = [("token_embd.weight", (VOCAB, D), MATRIX)]
if G4:
    P = G4["per_layer"]
    rotated = int(HEAD * G4["rotated"] / 2)
    tensors += [("per_layer_token_embd.weight", (VOCAB, LAYERS * P), "bf16"),
                ("per_layer_model_proj.weight", (LAYERS * P, D), "bf16"),
                ("per_layer_proj_norm.weight", (P,), "ones"),
                ("rope_freqs.weight", (HEAD // 2,),
                 np.array([1.0] * rotated + [1e30] * (HEAD // 2 - rotated), dtype=np.float32))]
for i in range(LAYERS):
    b = f"blk.{i}."
    tensors.append((b + "attn_norm.weight", (D,), "ones"))
    if G4:  # Gemma 4's block: two head sizes, shared keys and values, the per-layer input
        Dl, Fl = HEAD_SWA if WINDOWED[i] else HEAD, WIDTHS[i]
        tensors += [(b + "attn_q.weight", (HEADS * Dl, D), "bf16"),
                    (b + "attn_q_norm.weight", (Dl,), "ones")]
        if i < FIRST_SHARED:
            tensors += [(b + "attn_k.weight", (KV * Dl, D), "bf16"),
                        (b + "attn_v.weight", (KV * Dl, D), "bf16"),
                        (b + "attn_k_norm.weight", (Dl,), "ones")]
        tensors += [(b + "attn_output.weight", (D, HEADS * Dl), "bf16"),
                    (b + "post_attention_norm.weight", (D,), "ones"),
                    (b + "ffn_norm.weight", (D,), "ones"),
                    (b + "ffn_gate.weight", (Fl, D), "bf16"), (b + "ffn_up.weight", (Fl, D), "bf16"),
                    (b + "ffn_down.weight", (D, Fl), "bf16"),
                    (b + "post_ffw_norm.weight", (D,), "ones"),
                    (b + "inp_gate.weight", (P, D), "bf16"), (b + "proj.weight", (D, P), "bf16"),
                    (b + "post_norm.weight", (D,), "ones"),
                    (b + "layer_output_scale.weight", (1,), "ones")]
        continue
    if "moe" in EXTRA:  # qwen3moe's or gpt-oss's block
        tensors += [(b + "attn_q.weight", (Q, D), MATRIX), (b + "attn_k.weight", (KVD, D), MATRIX),
                    (b + "attn_v.weight", (KVD, D), MATRIX),
                    (b + "attn_output.weight", (D, Q), MATRIX),
                    (b + "ffn_gate_inp.weight", (EXPERTS, D), "router")]
        if "gpt_oss" in EXTRA:
            tensors += [(b + "attn_q.bias", (Q,), "bias"), (b + "attn_k.bias", (KVD,), "bias"),
                        (b + "attn_v.bias", (KVD,), "bias"), (b + "attn_output.bias", (D,), "bias"),
                        (b + "attn_sinks.weight", (HEADS,), "bias"),
                        (b + "post_attention_norm.weight", (D,), "ones"),
                        (b + "ffn_gate_inp.bias", (EXPERTS,), "bias"),
                        (b + "ffn_gate_exps.bias", (EXPERTS, F), "bias"),
                        (b + "ffn_up_exps.bias", (EXPERTS, F), "bias"),
                        (b + "ffn_down_exps.bias", (EXPERTS, D), "bias")]
        else:
            tensors += [(b + "attn_q_norm.weight", (HEAD,), "ones"),
                        (b + "attn_k_norm.weight", (HEAD,), "ones"),
                        (b + "ffn_norm.weight", (D,), "ones")]
        tensors += [(b + "ffn_gate_exps.weight", (EXPERTS, F, D), MATRIX),
                    (b + "ffn_up_exps.weight", (EXPERTS, F, D), MATRIX),
                    (b + "ffn_down_exps.weight", (EXPERTS, D, F), MATRIX)]
        continue
    if "qwen35" in EXTRA:  # Gated DeltaNet, or gated attention every fourth layer
        if (i + 1) % 4 != 0:
            channels = 2 * HK * DK + HV * DK
            tensors += [(b + "attn_qkv.weight", (channels, D), "bf16"),
                        (b + "attn_gate.weight", (HV * DK, D), "bf16"),
                        (b + "ssm_conv1d.weight", (channels, CONV), "conv"),
                        (b + "ssm_dt.bias", (HV,), "bias"), (b + "ssm_a", (HV,), "decay"),
                        (b + "ssm_beta.weight", (HV, D), "bf16"),
                        (b + "ssm_alpha.weight", (HV, D), "bf16"),
                        (b + "ssm_norm.weight", (DK,), "ones"),
                        (b + "ssm_out.weight", (D, HV * DK), "bf16")]
        else:
            tensors += [(b + "attn_q.weight", (2 * Q, D), "bf16"),
                        (b + "attn_k.weight", (KVD, D), "bf16"),
                        (b + "attn_v.weight", (KVD, D), "bf16"),
                        (b + "attn_q_norm.weight", (HEAD,), "ones"),
                        (b + "attn_k_norm.weight", (HEAD,), "ones"),
                        (b + "attn_output.weight", (D, Q), "bf16")]
        tensors += [(b + "post_attention_norm.weight", (D,), "ones"),
                    (b + "ffn_gate.weight", (F, D), "bf16"), (b + "ffn_up.weight", (F, D), "bf16"),
                    (b + "ffn_down.weight", (D, F), "bf16")]
        continue
    if EXTRA.get("phi2"):
        tensors.append((b + "attn_norm.bias", (D,), "bias"))
    if EXTRA.get("fused"):
        tensors.append((b + "attn_qkv.weight", (Q + 2 * KVD, D), "bf16"))
    else:
        tensors += [(b + "attn_q.weight", (Q, D), "bf16"), (b + "attn_k.weight", (KVD, D), "bf16"),
                    (b + "attn_v.weight", (KVD, D), "bf16")]
    if EXTRA.get("bias") or EXTRA.get("phi2"):
        tensors += [(b + "attn_q.bias", (Q,), "bias"), (b + "attn_k.bias", (KVD,), "bias"),
                    (b + "attn_v.bias", (KVD,), "bias")]
    if EXTRA.get("qk_norm"):
        tensors += [(b + "attn_q_norm.weight", (HEAD,), "ones"),
                    (b + "attn_k_norm.weight", (HEAD,), "ones")]
    if EXTRA.get("phi2"):  # one norm; no gate; biases on the output, up and down projections
        tensors += [(b + "attn_output.weight", (D, Q), "bf16"), (b + "attn_output.bias", (D,), "bias"),
                    (b + "ffn_up.weight", (F, D), "bf16"), (b + "ffn_up.bias", (F,), "bias"),
                    (b + "ffn_down.weight", (D, F), "bf16"), (b + "ffn_down.bias", (D,), "bias")]
        continue
    tensors += [(b + "attn_output.weight", (D, Q), "bf16"), (b + "ffn_norm.weight", (D,), "ones")]
    if EXTRA.get("post_norms"):
        tensors += [(b + "post_attention_norm.weight", (D,), "ones"),
                    (b + "post_ffw_norm.weight", (D,), "ones")]
    if EXTRA.get("fused"):
        tensors.append((b + "ffn_up.weight", (2 * F, D), "bf16"))
    else:
        tensors += [(b + "ffn_gate.weight", (F, D), "bf16"), (b + "ffn_up.weight", (F, D), "bf16")]
    tensors.append((b + "ffn_down.weight", (D, F), "bf16"))
tensors.append(("output_norm.weight", (D,), "ones"))
if EXTRA.get("phi2"):
    tensors += [("output_norm.bias", (D,), "bias"), ("output.weight", (VOCAB, D), "bf16"),
                ("output.bias", (VOCAB,), "bias")]
if EXTRA.get("untied"):
    tensors.append(("output.weight", (VOCAB, D), MATRIX))
rope = EXTRA.get("rope_dim", HEAD)
if "llama3" in EXTRA:
    factor, low, high, original = EXTRA["llama3"]
    divisors = []
    for j in range(HEAD // 2):
        wavelength = 2 * math.pi * THETA ** (2.0 * j / HEAD)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    tensors.append(("rope_freqs.weight", (HEAD // 2,), np.array(divisors, dtype=np.float32)))
if "longrope" in EXTRA:
    original, ctx = EXTRA["longrope"]
    tensors.append(("rope_factors_long.weight", (rope // 2,),
                    (1.0 + 30.0 * rng.random(rope // 2)).astype(np.float32)))
    tensors.append(("rope_factors_short.weight", (rope // 2,),
                    (1.0 + 0.2 * rng.random(rope // 2)).astype(np.float32)))
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(ctx / original) / math.log(original)))
    w.add_rope_scaling_orig_ctx_len(original)


def values(shape, what):
    if isinstance(what, np.ndarray):
        return what
    if what == "ones":
        return np.ones(shape, dtype=np.float32)
    if what == "bias":
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if what == "conv":  # a causal convolution's taps
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)
    if what == "router":  # F32, as llama.cpp's quantiser leaves it
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if what == "q8_0":  # blocks of 32: an f16 scale, then 32 int8 codes uniform in [-127, 127]
        blocks = np.empty((int(np.prod(shape)) // 32, 34), dtype=np.uint8)
        blocks[:, :2] = np.array([0.02 / (127 / math.sqrt(3))], dtype=np.float16).view(np.uint8)
        blocks[:, 2:] = rng.integers(-127, 128, (blocks.shape[0], 32), dtype=np.int8).view(np.uint8)
        return blocks
    if what == "decay":  # ssm_a = -exp(A_log), A in [1, 16] as Qwen3.5 initialises it
        return (-rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    # Drawn in pieces, so that a table of billions (Gemma 4's per-layer one) takes its own size.
    out = np.empty(int(np.prod(shape)), dtype=np.uint16)
    for at in range(0, out.size, 1 << 24):
        n = min(1 << 24, out.size - at)
        a = (0.02 * rng.standard_normal(n, dtype=np.float32)).view(np.uint32)
        out[at:at + n] = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
    return out.reshape(shape)


for name, dims, what in tensors:
    if isinstance(what, str) and what == "bf16":
        w.add_tensor_info(name, dims, np.dtype(np.uint16), 2 * int(np.prod(dims)),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif isinstance(what, str) and what == "q8_0":
        w.add_tensor_info(name, dims, np.dtype(np.int8), int(np.prod(dims)) // 32 * 34,
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()
for name, dims, what in tensors:
    w.write_tensor_data(values(dims, what))
w.close()
