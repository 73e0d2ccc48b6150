#!/usr/bin/python3
"""Random-weight models of each architecture family, in its real conventions, for the interop tests.

Usage: make_family_models.py GGUF_PY_DIR OUT_DIR
For each family below, writes OUT_DIR/<family>.gguf with llama.cpp's own gguf-py (the tensor names,
keys and q/k row order llama.cpp's converter writes) and OUT_DIR/<family>_hf/, the same weights as
a Hugging Face folder (config.json, model.safetensors, tokenizer.json), q and k rows in Hugging
Face's rotate-half order:
- llama3: Llama 3.1/3.2 RoPE scaling (rope_type llama3; rope_freqs.weight in GGUF, computed here
  from the four numbers as Hugging Face's _compute_llama3_parameters does), grouped-query
  attention, an untied head;
- qwen3: per-head RMSNorm of q and k (attn_q_norm, attn_k_norm), a head dimension apart from
  d_model / heads, an odd head count (3, one key/value head), no biases, a tied head;
- smollm3: every fourth layer without RoPE (no_rope_layers), 5 heads over 1 key/value head, tied;
- phi3: q, k, v in one tensor and gate, up in one (attn_qkv and ffn_up; qkv_proj and
  gate_up_proj), RoPE on 24 of each head's 32 dimensions (Phi-4-mini's partial rotary), longrope
  scaling with short and long factors and an original context of 128 below the 256 the model runs
  at (so the long factors, and the rotation scaled by sqrt(1 + ln 2 / ln 128));
- gemma: GeGLU (gelu_pytorch_tanh), RMSNorm scaling by 1 + w (Hugging Face holds w, GGUF 1 + w,
  as llama.cpp's converter adds it), embeddings scaled by sqrt(d_model), multi-query attention
  with heads of 64 over a d_model of 128, a tied head, no space prefix in the vocabulary. llama.cpp
  computes GELU through a table of fp16 inputs and outputs (ggml's GGML_GELU_FP16), about 5e-4
  relative per element: Gemma's MLP weights are drawn at half the others' scale, which keeps that
  table's effect on the logits near 4e-5 (at the others' scale it is 4e-4); GeGLU's own arithmetic
  is checked against PyTorch's exact tanh GELU (tests/models/make_llama_reference.py);
- phi2: attention and a GELU MLP (fc1, fc2) in parallel from one LayerNorm with a bias, biases on
  q, k, v, dense, fc1, fc2 and the head, RoPE on 32 of each head's 80 dimensions (Phi-2's 40%),
  an untied head; its MLP (weights and biases) drawn at a tenth of the others' scale, for
  llama.cpp's GELU table as Gemma's (at half scale the table moves the logits by 1.2e-3; with
  the MLP zeroed, llama.cpp's and cputrain's logits are 7.6e-6 apart);
- phi2_fused: the same parts, with q, k and v (weights and biases) in one tensor, attn_qkv, as
  llama.cpp's converter writes Phi-2's original checkpoint;
- gemma3: Gemma's parts with per-head q/k norms (1 + w) and norms after attention and the MLP
  (post_attention_norm / post_attention_layernorm, post_ffw_norm / post_feedforward_layernorm,
  the MLP's pre-norm pre_feedforward_layernorm), layers 0-4 of 6 within a sliding window of 32
  keys at RoPE base 10,000 and layer 5 global at 1,000,000, scaled linearly by 8 as Gemma 3 4B's
  (rope_scaling linear; rope.scaling.type and rope.scaling.factor in GGUF); 200 tokens reach past
  the window;
- gemma2: Gemma's parts with the post-norms, layers 0 and 2 of 4 within a window of 32 keys (at
  the model's RoPE base), attention scores soft-capped at 1 and the final logits at 5 (small
  caps, so that the tanh bends), Gemma 2's files' keys and defaults (no window pattern key).
- qwen35: Qwen3.5's hybrid of Gated DeltaNet and gated attention, layers L L L A, 2 key heads of
  24 read by 4 value heads (Hugging Face's grouped order, which llama.cpp's converter tiles), a
  causal convolution of 4 taps, attention's q and output gate in one tensor head by head, q/k
  norms, RoPE on 6 of each head's 24 dimensions (M-RoPE sections 1, 1, 1 as text rotates them),
  norms of 1 + w (but the DeltaNet output's), a multi-token-prediction block (nextn_predict_layers
  1 in GGUF, mtp.* in Hugging Face) that both leave out, and a head of its own drawn apart from
  the embedding, so that the greedy continuation walks the vocabulary as the layers' states move
  it (with the embedding's head every family's continuation repeats BOS); also as the published
  checkpoints hold it, the text model of an image-and-text Qwen3_5ForConditionalGeneration
  (qwen35_vl_hf: model.language_model.*, a vision model beside it).
- qwen3moe, qwen3moe_top4: Qwen3-MoE's block, qwen3's attention and in the MLP's place 8 SwiGLU
  experts of a router's softmax, each token's top 2 (top 4) renormalised; ffn_gate_inp and the
  experts stacked as llama.cpp's converter stacks Hugging Face's per-expert tensors
  (mlp.gate, mlp.experts.<e>.gate_proj ...);
- qwen35moe: Qwen3.5's layers with qwen3moe's experts (8, top 2) in every MLP's place and a shared
  expert beside them, its output times sigmoid of a gate of its own (ffn_*_shexp,
  ffn_gate_inp_shexp), and its Hugging Face folders: per-expert tensors (qwen35moe_hf) and, as
  Transformers 5 writes them, each layer's experts in one tensor with gate and up fused
  (qwen35moe_fused_hf).
- gemma4: Gemma 4 E2B's parts (conversion/gemma.py's names and keys): 9 layers, two windowed
  (a window of 32 keys, RoPE base 10,000, heads of 32, 2 key/value heads) to one global
  (heads of 64, 1 key/value head, RoPE base 1,000,000, proportional RoPE: rope_freqs of 1 for
  a quarter of the pairs and 1e30, no rotation, for the others); the last 3 layers sharing the
  keys and values of layers 4 (windowed) and 5 (global), their MLPs twice as wide; per-layer
  embeddings of 16 a layer (per_layer_token_embd, per_layer_model_proj and its norm; each
  layer's inp_gate, proj and post_norm); q, k and v norms (v's without a gain); a learnt output
  scale per layer; the logits soft-capped at 5. The scores are not scaled (a scale of 1): the q
  and k norms' gains are near 0.3, as at gains near 1 over heads of 64 the scores reach tens
  and the softmax is so sharp that float rounding alone moves the logits by up to 1e-3 (with
  the MLPs zeroed; 1.5e-6 at 0.3). GELU (the MLP's and the per-layer gate's) goes
  through llama.cpp's fp16 table: the norms after the MLP and after the per-layer projection
  have gains of 0.03, as gemma3's post-MLP norm, which keeps the table's effect small;
- gemma4_e2b: gemma4's parts with one key/value head in every layer (as E2B's: Hugging Face's
  config gives the global layers heads of their own only beside attention_k_eq_v), and
  Transformers' folder of it (gemma4_e2b_hf: Gemma4ForCausalLM, norms as their gains, the
  experts' and router's names, layer_scalar; the shared-KV layers' k and v projections and k
  norms beside, which the model leaves out as Transformers does); gemma4_moe's folder
  (gemma4_moe_hf) is the text model of Gemma4ForConditionalGeneration, vision and audio towers
  beside it;
- gpt_oss: gpt-oss's block (llama.cpp's converter's names and keys, and Transformers' folder,
  the experts' gate and up alternating in one tensor, with truncate true): q, k, v and o
  biases, a learnt sink per head (attn_sinks), layers 0 and 2 of 4 within a sliding window of 32
  (the default pattern, no pattern key), YaRN RoPE (factor 32 from an original context of 64,
  half-split), post_attention_norm as the MLP's norm, and 8 experts (top 4 of the router's
  logits, softmaxed) with a router bias, biases on each expert's gate, up and down, and the
  clamped SwiGLU: on the MLP's normed input (RMS 1 over 88 elements) each gate and up product is
  about N(0, 3.9) (weights 0.4, biases 1), past the clamp at 7 for some 4% of gates and 7% of
  ups; the down weights small (0.003), so that the experts' sum does not outweigh the embedding.
Every family has the SentencePiece-style vocabulary of make_gguf_models.py (the tokenizer is not
what these models test) and weights drawn so that the embedding dominates the residual stream: the
next-token distribution is peaked, so greedy continuations compare the arithmetic, not ties.
"""
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402

OUT = sys.argv[2]
VOCAB, CTX = 512, 256

FAMILIES = {
    "llama3": dict(arch="llama", hf_type="llama", hf_class="LlamaForCausalLM", d=128, ffn=320,
                   layers=2, heads=4, kv=2, head=32, theta=10000.0, tied=False, adjacent=True,
                   scaling=dict(factor=8.0, low=1.0, high=4.0, original=1024)),
    "qwen3": dict(arch="qwen3", hf_type="qwen3", hf_class="Qwen3ForCausalLM", d=192, ffn=384,
                  layers=2, heads=3, kv=1, head=48, theta=1e6, tied=True, adjacent=False,
                  qk_norm=True),
    "smollm3": dict(arch="smollm3", hf_type="smollm3", hf_class="SmolLM3ForCausalLM", d=160,
                    ffn=352, layers=5, heads=5, kv=1, head=32, theta=2e6, tied=True,
                    adjacent=True, no_rope_step=4),
    "phi3": dict(arch="phi3", hf_type="phi3", hf_class="Phi3ForCausalLM", d=128, ffn=256,
                 layers=2, heads=4, kv=2, head=32, theta=10000.0, tied=False, adjacent=False,
                 fused=True, rope_dim=24, longrope=dict(original=128),
                 special=("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")),
    "phi2": dict(arch="phi2", hf_type="phi", hf_class="PhiForCausalLM", d=160, ffn=320,
                 layers=2, heads=2, kv=2, head=80, theta=10000.0, tied=False, adjacent=False,
                 phi2=True, rope_dim=32, mlp_std=0.005),
    "gemma3": dict(arch="gemma3", hf_type="gemma3_text", hf_class="Gemma3ForCausalLM", d=128,
                   ffn=256, layers=6, heads=4, kv=1, head=64, theta=1e6, tied=True,
                   adjacent=False, gemma=True, qk_norm=True, post_norms=True, window=32,
                   pattern=6, theta_swa=1e4, mlp_std=0.025, linear=8.0,
                   special=("<start_of_turn>", "<end_of_turn>")),
    "gemma2": dict(arch="gemma2", hf_type="gemma2", hf_class="Gemma2ForCausalLM", d=128,
                   ffn=256, layers=4, heads=4, kv=2, head=64, theta=1e4, tied=True,
                   adjacent=False, gemma=True, post_norms=True, window=32, pattern=2,
                   caps=(1.0, 5.0), mlp_std=0.025, special=("<start_of_turn>", "<end_of_turn>")),
    "gemma": dict(arch="gemma", hf_type="gemma", hf_class="GemmaForCausalLM", d=128, ffn=256,
                  layers=2, heads=4, kv=1, head=64, theta=10000.0, tied=True, adjacent=False,
                  gemma=True, mlp_std=0.025, special=("<start_of_turn>", "<end_of_turn>")),
    "qwen3moe": dict(arch="qwen3moe", hf_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM", d=96,
                     ffn=40, layers=2, heads=3, kv=1, head=32, theta=1e6, tied=False,
                     adjacent=False, qk_norm=True, moe=dict(experts=8, used=2)),
    "qwen3moe_top4": dict(arch="qwen3moe", hf_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM",
                          d=80, ffn=24, layers=3, heads=2, kv=2, head=40, theta=1e6, tied=True,
                          adjacent=False, qk_norm=True, moe=dict(experts=8, used=4)),
    "qwen35moe": dict(arch="qwen35moe", hf_type="qwen3_5_moe_text", hf_class="Qwen3_5MoeForCausalLM",
                      d=72, ffn=32, layers=4, heads=2, kv=1, head=24, theta=1e7, tied=False,
                      adjacent=False, rope_dim=6,
                      qwen35=dict(hk=2, hv=4, dk=24, conv=4, interval=4, sections=[1, 1, 1, 0]),
                      moe=dict(experts=8, used=2, shared=48)),
    "qwen35": dict(arch="qwen35", hf_type="qwen3_5_text", hf_class="Qwen3_5ForCausalLM", d=88,
                   ffn=200, layers=4, heads=4, kv=2, head=24, theta=1e7, tied=False,
                   adjacent=False, rope_dim=6, qwen35=dict(hk=2, hv=4, dk=24, conv=4, interval=4,
                                                          sections=[1, 1, 1, 0])),
    "gpt_oss": dict(arch="gpt-oss", d=88, ffn=24, layers=4, heads=4, kv=2, head=32, theta=1.5e5,
                    window=32, yarn=dict(factor=32.0, original=64), moe=dict(experts=8, used=4)),
    # Phi-2 as converted from its original checkpoint: q, k, v (weights and biases) in attn_qkv.
    # (Last, so that the others keep their seeds.)
    "phi2_fused": dict(arch="phi2", hf_type="phi", hf_class="PhiForCausalLM", d=160, ffn=320,
                       layers=2, heads=2, kv=2, head=80, theta=10000.0, tied=False,
                       adjacent=False, phi2=True, rope_dim=32, mlp_std=0.005, fused_qkv=True),
    # Gemma 4 E2B's parts, small: written as llama.cpp's converter writes gemma4.
    "gemma4": dict(arch="gemma4", d=64, ffn=96, layers=9, heads=2, kv=1, head=64, kv_swa=2,
                   head_swa=32, theta=1e6, theta_swa=1e4, window=32, pattern=3, shared=3,
                   per_layer=16, rotated=0.25, cap=5.0),
    # Gemma 4 26B-A4B's and 31B's parts, small: GELU experts beside the dense MLP (their gate and
    # up in one tensor, as the converter writes them), global layers taking k as v.
    "gemma4_moe": dict(arch="gemma4", d=64, ffn=64, layers=4, heads=2, kv=1, head=64, kv_swa=2,
                       head_swa=32, theta=1e6, theta_swa=1e4, window=32, pattern=3, shared=0,
                       per_layer=0, rotated=0.25, cap=5.0, experts=8, experts_used=2,
                       expert_ffn=32, k_as_v=True, hf="multimodal"),
    # Gemma 4 E2B's parts with one key/value head in every layer, as Hugging Face's config
    # expresses them (num_global_key_value_heads only beside attention_k_eq_v), and its folder.
    "gemma4_e2b": dict(arch="gemma4", d=64, ffn=96, layers=9, heads=2, kv=1, head=64, kv_swa=1,
                       head_swa=32, theta=1e6, theta_swa=1e4, window=32, pattern=3, shared=3,
                       per_layer=16, rotated=0.25, cap=5.0, hf="text"),
}


def vocabulary(special=()):
    """unk, bos, eos, 256 byte pieces, words; `special` control tokens last (Phi-3's, which
    llama.cpp looks for in a vocabulary of a model named phi3)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    words = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁and", "▁ran", "▁far"]
    pieces = words + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["▁"]
    i = 0
    while len(tokens) + len(pieces) + len(special) < VOCAB:
        pieces.append(f"▁w{i}")
        i += 1
    tokens += pieces + list(special)
    types += [gguf.TokenType.NORMAL] * len(pieces) + [gguf.TokenType.CONTROL] * len(special)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(special)
    return tokens, scores, types


def add_vocabulary(w, special=()):
    """The vocabulary's size, tokens, scores, types and BOS/EOS/UNK ids into GGUF writer `w`;
    returns its tokens and types."""
    tokens, scores, types = vocabulary(special)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return tokens, types


def finish(w):
    """Writes GGUF writer `w`'s header, metadata and tensors, and closes its file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_factors(theta, head, factor, low, high, original):
    """The divisor of each frequency: Hugging Face's llama3 inv_freq is inv_freq / divisor."""
    out = []
    for j in range(head // 2):
        freq = theta ** (-2.0 * j / head)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def to_adjacent(a, heads):
    """Rows of each head from Hugging Face's rotate-half order (j, j + D/2) to adjacent pairs."""
    rows = a.shape[0]
    d = rows // heads
    return a.reshape(heads, 2, d // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def write_safetensors(path, tensors):
    header, chunks, offset = {}, [], 0
    for name, a in tensors.items():
        data = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for c in chunks:
            f.write(c)


def add_widths(w, ffn, moe):
    """The MLP's width, or a mixture's: the dense width its files also give, the experts' count,
    those a token uses and their width, and a shared expert's."""
    if not moe:
        w.add_feed_forward_length(ffn)
        return
    w.add_feed_forward_length(6 * ffn)
    w.add_expert_count(moe["experts"])
    w.add_expert_used_count(moe["used"])
    w.add_expert_feed_forward_length(ffn)
    if moe.get("shared"):
        w.add_expert_shared_feed_forward_length(moe["shared"])


def write_family(name, spec, seed):
    rng = np.random.default_rng(seed)
    d, ffn, layers, heads, kv, head = (spec[k] for k in ("d", "ffn", "layers", "heads", "kv", "head"))

    def draw(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    # Hugging Face's tensors (rotate-half q and k rows); GGUF's are derived from them.
    gemma, phi2 = spec.get("gemma", False), spec.get("phi2", False)
    gain = 0.0 if gemma else 1.0  # Gemma's Hugging Face norms hold the gain less 1
    hf = {"model.embed_tokens.weight": draw((VOCAB, d), 0.15)}
    for i in range(layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = draw((d,), 0.05, gain)
        hf[p + "self_attn.q_proj.weight"] = draw((heads * head, d), 0.05)
        hf[p + "self_attn.k_proj.weight"] = draw((kv * head, d), 0.05)
        hf[p + "self_attn.v_proj.weight"] = draw((kv * head, d), 0.05)
        if spec.get("qk_norm"):
            hf[p + "self_attn.q_norm.weight"] = draw((head,), 0.1, gain)
            hf[p + "self_attn.k_norm.weight"] = draw((head,), 0.1, gain)
        hf[p + "self_attn.o_proj.weight"] = draw((d, heads * head), 0.05)
        hf[p + "post_attention_layernorm.weight"] = draw((d,), 0.05, gain)
        if spec.get("post_norms"):  # Gemma 3: the MLP's pre-norm, and post-norms of both
            hf[p + "pre_feedforward_layernorm.weight"] = draw((d,), 0.05, gain)
            # The MLP's post-norm at a gain of 0.03: the norm undoes any scale of the MLP's
            # weights, so this alone keeps llama.cpp's fp16 GELU table (which at gains near 1
            # moves these logits by 2.5e-3; with the MLP zeroed they are 8e-6 apart) below 1e-4.
            hf[p + "post_feedforward_layernorm.weight"] = draw((d,), 0.002, gain - 0.97)
        mlp = spec.get("mlp_std", 0.05)
        if spec.get("moe"):  # a router and experts of ffn each, in Hugging Face's per-expert names
            hf[p + "mlp.gate.weight"] = draw((spec["moe"]["experts"], d), 0.5)
            for e in range(spec["moe"]["experts"]):
                hf[p + f"mlp.experts.{e}.gate_proj.weight"] = draw((ffn, d), 0.1)
                hf[p + f"mlp.experts.{e}.up_proj.weight"] = draw((ffn, d), 0.1)
                hf[p + f"mlp.experts.{e}.down_proj.weight"] = draw((d, ffn), 0.1)
            continue
        hf[p + "mlp.gate_proj.weight"] = draw((ffn, d), mlp)
        hf[p + "mlp.up_proj.weight"] = draw((ffn, d), mlp)
        hf[p + "mlp.down_proj.weight"] = draw((d, ffn), mlp)
    hf["model.norm.weight"] = draw((d,), 0.05, gain)
    if not spec["tied"]:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"] + draw((VOCAB, d), 0.1)
    if phi2:  # one LayerNorm a block, no gate, biases on every projection and the head
        for i in range(layers):
            p = f"model.layers.{i}."
            del hf[p + "post_attention_layernorm.weight"], hf[p + "mlp.gate_proj.weight"]
            hf[p + "input_layernorm.bias"] = draw((d,), 0.05)
            for proj, rows in (("self_attn.q_proj", heads * head), ("self_attn.k_proj", kv * head),
                               ("self_attn.v_proj", kv * head), ("self_attn.o_proj", d)):
                hf[p + proj + ".bias"] = draw((rows,), 0.05)
            for proj, rows in (("mlp.up_proj", ffn), ("mlp.down_proj", d)):
                hf[p + proj + ".bias"] = draw((rows,), spec["mlp_std"])
        hf["model.norm.bias"] = draw((d,), 0.05)
        hf["lm_head.bias"] = draw((VOCAB,), 0.1)

    # GGUF, as llama.cpp's converter writes it.
    w = gguf.GGUFWriter(f"{OUT}/{name}.gguf", spec["arch"])
    w.add_context_length(CTX)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    moe = spec.get("moe")
    add_widths(w, ffn, moe)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head)
    w.add_value_length(head)
    if phi2:
        w.add_layer_norm_eps(1e-5)
    else:
        w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(spec["theta"])
    w.add_rope_dimension_count(spec.get("rope_dim", head))
    tokens, types = add_vocabulary(w, spec.get("special", ()))
    if gemma:
        w.add_add_space_prefix(False)
    if spec.get("window"):
        w.add_sliding_window(spec["window"])
        if spec["pattern"] != 2:  # Gemma 2's files give none
            w.add_sliding_window_pattern(spec["pattern"])
        if spec.get("theta_swa"):
            w.add_rope_freq_base_swa(spec["theta_swa"])
    if spec.get("linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec["linear"])
    if spec.get("caps"):
        w.add_attn_logit_softcapping(spec["caps"][0])
        w.add_final_logit_softcapping(spec["caps"][1])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": ("post_attention_norm" if spec.get("post_norms")
                                          else "ffn_norm"),
             "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {}
    for hname, a in hf.items():
        if ".mlp.experts." in hname or hname.endswith(".mlp.gate.weight"):
            continue
        if hname == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif hname.startswith("model.norm."):
            gname = "output_norm." + hname.rsplit(".", 1)[1]
        elif hname.startswith("lm_head."):
            gname = "output." + hname.rsplit(".", 1)[1]
        else:
            _, _, layer, rest = hname.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[module]}.{kind}"
            if spec["adjacent"] and module == "self_attn.q_proj":
                a = to_adjacent(a, heads)
            if spec["adjacent"] and module == "self_attn.k_proj":
                a = to_adjacent(a, kv)
        if gemma and gname.endswith("norm.weight"):
            a = a + np.float32(1.0)  # llama.cpp's converter: the gain itself
        tensors[gname] = a
    if spec.get("fused"):  # llama.cpp's phi3: q, k, v rows in attn_qkv; gate, up rows in ffn_up
        for i in range(layers):
            b = f"blk.{i}."
            qkv = [tensors.pop(b + p + ".weight") for p in ("attn_q", "attn_k", "attn_v")]
            gate_up = [tensors.pop(b + p + ".weight") for p in ("ffn_gate", "ffn_up")]
            tensors[b + "attn_qkv.weight"] = np.concatenate(qkv)
            tensors[b + "ffn_up.weight"] = np.concatenate(gate_up)
    if spec.get("fused_qkv"):  # q, k, v rows (and biases) in attn_qkv alone
        for i in range(layers):
            for kind in ("weight", "bias"):
                b = f"blk.{i}."
                qkv = [tensors.pop(f"{b}{p}.{kind}") for p in ("attn_q", "attn_k", "attn_v")]
                tensors[f"{b}attn_qkv.{kind}"] = np.concatenate(qkv)
    if moe:  # the router, and each layer's experts stacked: (E, F, d) and (E, d, F)
        for i in range(layers):
            p = f"model.layers.{i}.mlp."
            tensors[f"blk.{i}.ffn_gate_inp.weight"] = hf[p + "gate.weight"]
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                tensors[f"blk.{i}.ffn_{ours}_exps.weight"] = np.stack(
                    [hf[p + f"experts.{e}.{theirs}.weight"] for e in range(moe["experts"])])
    for gname, a in tensors.items():
        w.add_tensor(gname, a)
    rope_dim = spec.get("rope_dim", head)
    longrope = spec.get("longrope")
    if longrope:
        short = (1.0 + 0.5 * rng.random(rope_dim // 2)).astype(np.float32)
        long = (1.0 + 8.0 * rng.random(rope_dim // 2)).astype(np.float32)
        scale = CTX / longrope["original"]
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(longrope["original"]))
        w.add_tensor("rope_factors_long.weight", long)
        w.add_tensor("rope_factors_short.weight", short)
        w.add_rope_scaling_attn_factors(attn_factor)
        w.add_rope_scaling_orig_ctx_len(longrope["original"])
    scaling = spec.get("scaling")
    if scaling:
        w.add_tensor("rope_freqs.weight",
                     llama3_factors(spec["theta"], head, scaling["factor"], scaling["low"],
                                    scaling["high"], scaling["original"]))
    finish(w)

    folder = f"{OUT}/{name}_hf"
    os.makedirs(folder, exist_ok=True)
    if spec.get("fused"):  # Hugging Face's Phi3: qkv_proj and gate_up_proj
        for i in range(layers):
            p = f"model.layers.{i}."
            hf[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [hf.pop(p + f"self_attn.{x}_proj.weight") for x in ("q", "k", "v")])
            hf[p + "mlp.gate_up_proj.weight"] = np.concatenate(
                [hf.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    if phi2:  # Hugging Face's Phi: dense, fc1, fc2, final_layernorm
        renames = {"self_attn.o_proj": "self_attn.dense", "mlp.up_proj": "mlp.fc1",
                   "mlp.down_proj": "mlp.fc2"}
        renamed = {}
        for hname, a in hf.items():
            for ours, theirs in renames.items():
                hname = hname.replace("." + ours + ".", "." + theirs + ".")
            renamed[hname.replace("model.norm.", "model.final_layernorm.")] = a
        hf = renamed
    write_safetensors(f"{folder}/model.safetensors", hf)
    config = {"architectures": [spec["hf_class"]], "model_type": spec["hf_type"],
              "vocab_size": VOCAB, "hidden_size": d, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head,
              "intermediate_size": ffn, "rms_norm_eps": 1e-6, "rope_theta": spec["theta"],
              "max_position_embeddings": CTX, "tie_word_embeddings": spec["tied"],
              "hidden_act": "gelu_pytorch_tanh" if gemma else "silu",
              "attention_bias": False, "attention_dropout": 0.0,
              "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32", "use_cache": True}
    if scaling:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": scaling["factor"],
                                  "low_freq_factor": scaling["low"],
                                  "high_freq_factor": scaling["high"],
                                  "original_max_position_embeddings": scaling["original"]}
    if rope_dim != head:
        config["partial_rotary_factor"] = rope_dim / head
    if longrope:
        config["original_max_position_embeddings"] = longrope["original"]
        config["rope_scaling"] = {"type": "longrope", "short_factor": short.tolist(),
                                  "long_factor": long.tolist()}
        config["resid_pdrop"] = 0.0
        config["embd_pdrop"] = 0.0
    if gemma:
        config["hidden_activation"] = "gelu_pytorch_tanh"
    if spec.get("linear"):
        config["rope_scaling"] = {"rope_type": "linear", "factor": spec["linear"]}
    if spec.get("window"):
        pattern = spec["pattern"]
        caps = spec.get("caps", (None, None))
        config.update(sliding_window=spec["window"], query_pre_attn_scalar=head,
                      attn_logit_softcapping=caps[0], final_logit_softcapping=caps[1])
        if pattern != 2:
            config.update(sliding_window_pattern=pattern, rope_local_base_freq=spec["theta_swa"],
                          layer_types=["full_attention" if (i + 1) % pattern == 0
                                       else "sliding_attention" for i in range(layers)])
    if phi2:
        del config["rms_norm_eps"], config["attention_bias"]
        config.update(hidden_act="gelu_new", layer_norm_eps=1e-5, qk_layernorm=False,
                      resid_pdrop=0.0, embd_pdrop=0.0)
    if moe:
        config.update(num_experts=moe["experts"], num_experts_per_tok=moe["used"],
                      moe_intermediate_size=ffn, intermediate_size=6 * ffn, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                      output_router_logits=False)
    if spec.get("no_rope_step"):
        step = spec["no_rope_step"]
        config["no_rope_layers"] = [int((i + 1) % step != 0) for i in range(layers)]
        config["no_rope_layer_interval"] = step
        config["use_sliding_window"] = False
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    write_tokenizer(folder, tokens, types, gemma)


def grouped_to_tiled(a, hk, hv, dim, axis=0):
    """Value heads from Hugging Face's order grouped by key head [k0v0, k0v1, k1v0, k1v1] to
    llama.cpp's tiled [k0v0, k1v0, k0v1, k1v1], along `axis` (heads of `dim` elements)."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(hk, hv // hk, dim, *rest).swapaxes(0, 1).reshape(hv * dim, *rest)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def write_qwen35(name, spec, seed):
    rng = np.random.default_rng(seed)
    d, ffn, layers, heads, kv, head = (spec[k] for k in ("d", "ffn", "layers", "heads", "kv", "head"))
    q35 = spec["qwen35"]
    hk, hv, dk, conv, interval = (q35[k] for k in ("hk", "hv", "dk", "conv", "interval"))
    qk, vd = hk * dk, hv * dk

    def draw(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    def linear_layer(i):
        return (i + 1) % interval != 0

    # Hugging Face's tensors: norms hold w of 1 + w (but linear_attn.norm, the gain), value heads
    # grouped by key head, A as A_log.
    hf = {"model.embed_tokens.weight": draw((VOCAB, d), 0.15)}

    def attention_layer(p):
        hf[p + "self_attn.q_proj.weight"] = draw((heads * head * 2, d), 0.05)  # q, gate per head
        hf[p + "self_attn.k_proj.weight"] = draw((kv * head, d), 0.05)
        hf[p + "self_attn.v_proj.weight"] = draw((kv * head, d), 0.05)
        hf[p + "self_attn.q_norm.weight"] = draw((head,), 0.1)
        hf[p + "self_attn.k_norm.weight"] = draw((head,), 0.1)
        hf[p + "self_attn.o_proj.weight"] = draw((d, heads * head), 0.05)

    def mlp(p):
        hf[p + "post_attention_layernorm.weight"] = draw((d,), 0.05)
        moe = spec.get("moe")
        if moe:  # a router, experts, and a shared expert behind a sigmoid gate of its own
            hf[p + "mlp.gate.weight"] = draw((moe["experts"], d), 0.5)
            for e in range(moe["experts"]):
                hf[p + f"mlp.experts.{e}.gate_proj.weight"] = draw((ffn, d), 0.1)
                hf[p + f"mlp.experts.{e}.up_proj.weight"] = draw((ffn, d), 0.1)
                hf[p + f"mlp.experts.{e}.down_proj.weight"] = draw((d, ffn), 0.1)
            fs = moe["shared"]
            hf[p + "mlp.shared_expert.gate_proj.weight"] = draw((fs, d), 0.1)
            hf[p + "mlp.shared_expert.up_proj.weight"] = draw((fs, d), 0.1)
            hf[p + "mlp.shared_expert.down_proj.weight"] = draw((d, fs), 0.1)
            hf[p + "mlp.shared_expert_gate.weight"] = draw((1, d), 0.3)
            return
        hf[p + "mlp.gate_proj.weight"] = draw((ffn, d), 0.05)
        hf[p + "mlp.up_proj.weight"] = draw((ffn, d), 0.05)
        hf[p + "mlp.down_proj.weight"] = draw((d, ffn), 0.05)

    for i in range(layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = draw((d,), 0.05)
        if linear_layer(i):
            hf[p + "linear_attn.in_proj_qkv.weight"] = draw((2 * qk + vd, d), 0.05)
            hf[p + "linear_attn.in_proj_z.weight"] = draw((vd, d), 0.05)
            hf[p + "linear_attn.in_proj_b.weight"] = draw((hv, d), 0.1)
            hf[p + "linear_attn.in_proj_a.weight"] = draw((hv, d), 0.1)
            hf[p + "linear_attn.conv1d.weight"] = draw((2 * qk + vd, 1, conv), 0.3)
            hf[p + "linear_attn.dt_bias"] = draw((hv,), 0.5)
            hf[p + "linear_attn.A_log"] = draw((hv,), 0.5)
            hf[p + "linear_attn.norm.weight"] = draw((dk,), 0.05, 1.0)
            hf[p + "linear_attn.out_proj.weight"] = draw((d, vd), 0.05)
        else:
            attention_layer(p)
        mlp(p)
    hf["model.norm.weight"] = draw((d,), 0.05)
    # A head of its own, not the embedding's: the next token is not the last one, and the layers
    # move it, so that greedy continuations walk through the vocabulary.
    hf["lm_head.weight"] = draw((VOCAB, d), 0.15)
    # The multi-token-prediction block: a full-attention block and its projection and norms.
    mtp = {}
    saved = dict(hf)
    attention_layer("mtp.layers.0.")
    mlp("mtp.layers.0.")
    hf["mtp.layers.0.input_layernorm.weight"] = draw((d,), 0.05)
    for k in [k for k in hf if k.startswith("mtp.")]:
        mtp[k] = hf.pop(k)
    mtp["mtp.fc.weight"] = draw((d, 2 * d), 0.05)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = draw((d,), 0.05)
    assert set(hf) == set(saved)

    # GGUF, as llama.cpp's converter writes it.
    w = gguf.GGUFWriter(f"{OUT}/{name}.gguf", spec["arch"])
    w.add_context_length(CTX)
    w.add_embedding_length(d)
    w.add_block_count(layers + 1)
    w.add_nextn_predict_layers(1)
    moe = spec.get("moe")
    add_widths(w, ffn, moe)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(spec["theta"])
    w.add_rope_dimension_count(spec["rope_dim"])
    w.add_rope_dimension_sections(q35["sections"])
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(vd)
    w.add_full_attention_interval(interval)
    tokens, types = add_vocabulary(w)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
             "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
             "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
             "linear_attn.out_proj": "ssm_out", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    experts = {}  # (block, projection) -> each expert's tensor, stacked as llama.cpp stacks them
    tiled = lambda a, axis=0, dim=dk: grouped_to_tiled(a, hk, hv, dim, axis)  # noqa: E731
    items = list(hf.items()) + [(k.replace("mtp.layers.0.", f"model.layers.{layers}."), a)
                                for k, a in mtp.items() if k.startswith("mtp.layers.")]
    for hname, a in items:
        if hname == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
            continue
        if hname == "model.norm.weight":
            w.add_tensor("output_norm.weight", a + np.float32(1.0))
            continue
        if hname == "lm_head.weight":
            w.add_tensor("output.weight", a)
            continue
        _, _, layer, rest = hname.split(".", 3)
        b = f"blk.{layer}."
        if rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault((b, proj), {})[int(e)] = a
            continue
        if rest == "linear_attn.A_log":
            w.add_tensor(b + "ssm_a", -np.exp(tiled(a, dim=1)))
            continue
        if rest == "linear_attn.dt_bias":
            w.add_tensor(b + "ssm_dt.bias", tiled(a, dim=1))
            continue
        module, kind = rest.rsplit(".", 1)
        if module == "linear_attn.in_proj_qkv":
            a = np.concatenate([a[:2 * qk], tiled(a[2 * qk:])])
        elif module == "linear_attn.in_proj_z":
            a = tiled(a)
        elif module in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
            a = tiled(a, dim=1)
        elif module == "linear_attn.conv1d":
            a = a[:, 0, :]
            a = np.concatenate([a[:2 * qk], tiled(a[2 * qk:])])
        elif module == "linear_attn.out_proj":
            a = tiled(a, axis=1)
        elif module.endswith("norm") and module != "linear_attn.norm":
            a = a + np.float32(1.0)
        w.add_tensor(f"{b}{names[module]}.{kind}", a)
    for (b, proj), by_expert in experts.items():
        ours = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
        w.add_tensor(b + ours[proj] + ".weight", np.stack([by_expert[e] for e in sorted(by_expert)]))
    for n, g in (("fc", "eh_proj"), ("pre_fc_norm_embedding", "enorm"),
                 ("pre_fc_norm_hidden", "hnorm"), ("norm", "shared_head_norm")):
        a = mtp[f"mtp.{n}.weight"]
        w.add_tensor(f"blk.{layers}.nextn.{g}.weight", a if n == "fc" else a + np.float32(1.0))
    finish(w)

    folder = f"{OUT}/{name}_hf"
    os.makedirs(folder, exist_ok=True)
    write_safetensors(f"{folder}/model.safetensors", {**hf, **mtp})
    config = {"architectures": [spec["hf_class"]], "model_type": spec["hf_type"],
              "vocab_size": VOCAB, "hidden_size": d, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head,
              "intermediate_size": ffn, "rms_norm_eps": 1e-6, "max_position_embeddings": CTX,
              "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
              "attention_dropout": 0.0, "attn_output_gate": True,
              "full_attention_interval": interval,
              "layer_types": ["linear_attention" if linear_layer(i) else "full_attention"
                              for i in range(layers)],
              "linear_conv_kernel_dim": conv, "linear_key_head_dim": dk,
              "linear_value_head_dim": dk, "linear_num_key_heads": hk,
              "linear_num_value_heads": hv, "mtp_num_hidden_layers": 1,
              "mtp_use_dedicated_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": spec["theta"],
                                  "partial_rotary_factor": spec["rope_dim"] / head,
                                  "mrope_interleaved": True,
                                  "mrope_section": q35["sections"][:3]},
              "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32", "use_cache": True}
    if moe:
        config.update(num_experts=moe["experts"], num_experts_per_tok=moe["used"],
                      moe_intermediate_size=ffn, shared_expert_intermediate_size=moe["shared"],
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      router_aux_loss_coef=0.001, output_router_logits=False)
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    write_tokenizer(folder, tokens, types, False)
    if moe:
        # As Transformers 5 writes a mixture: each layer's experts one tensor, gate and up fused
        # (each expert's gate rows, then its up rows), down_proj without ".weight".
        folder = f"{OUT}/{name}_fused_hf"
        os.makedirs(folder, exist_ok=True)
        fused = {k: a for k, a in {**hf, **mtp}.items() if ".mlp.experts." not in k}
        for i in range(layers):
            p = f"model.layers.{i}.mlp.experts."
            fused[p + "gate_up_proj"] = np.stack(
                [np.concatenate([hf[p + f"{e}.gate_proj.weight"], hf[p + f"{e}.up_proj.weight"]])
                 for e in range(moe["experts"])])
            fused[p + "down_proj"] = np.stack(
                [hf[p + f"{e}.down_proj.weight"] for e in range(moe["experts"])])
        write_safetensors(f"{folder}/model.safetensors", fused)
        with open(f"{folder}/config.json", "w") as f:
            json.dump(config, f)
        write_tokenizer(folder, tokens, types, False)
        return

    # The published checkpoints' form: the text model inside an image-and-text one
    # (Qwen3_5ForConditionalGeneration), its tensors under model.language_model., a vision model
    # beside it.
    folder = f"{OUT}/{name}_vl_hf"
    os.makedirs(folder, exist_ok=True)
    wrapped = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: a
               for k, a in {**hf, **mtp}.items()}
    wrapped["model.visual.blocks.0.attn.qkv.weight"] = draw((48, 16), 0.05)
    wrapped["model.visual.merger.linear_fc2.weight"] = draw((d, 32), 0.05)
    write_safetensors(f"{folder}/model.safetensors", wrapped)
    text = dict(config)
    del text["architectures"]
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "text_config": text, "tie_word_embeddings": False, "image_token_id": 500,
               "video_token_id": 501, "vision_start_token_id": 502, "vision_end_token_id": 503,
               "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16,
                                 "out_hidden_size": d}}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(wrapper, f)
    write_tokenizer(folder, tokens, types, False)


def write_gpt_oss(name, spec, seed):
    """gpt-oss's block as llama.cpp's converter writes it (conversion/gpt_oss.py)."""
    rng = np.random.default_rng(seed)
    d, ffn, layers, heads, kv, head = (spec[k] for k in ("d", "ffn", "layers", "heads", "kv", "head"))
    experts, used = spec["moe"]["experts"], spec["moe"]["used"]

    def draw(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    w = gguf.GGUFWriter(f"{OUT}/{name}.gguf", "gpt-oss")
    w.add_context_length(CTX)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    add_widths(w, ffn, spec["moe"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(spec["theta"])
    w.add_rope_dimension_count(head)
    w.add_sliding_window(spec["window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(spec["yarn"]["factor"])
    w.add_rope_scaling_orig_ctx_len(spec["yarn"]["original"])
    tokens, types = add_vocabulary(w)
    t = {"token_embd.weight": draw((VOCAB, d), 0.15), "output_norm.weight": draw((d,), 0.05, 1.0)}
    t["output.weight"] = t["token_embd.weight"] + draw((VOCAB, d), 0.1)
    for i in range(layers):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = draw((d,), 0.05, 1.0)
        t[b + "attn_q.weight"] = draw((heads * head, d), 0.05)
        t[b + "attn_q.bias"] = draw((heads * head,), 0.1)
        t[b + "attn_k.weight"] = draw((kv * head, d), 0.05)
        t[b + "attn_k.bias"] = draw((kv * head,), 0.1)
        t[b + "attn_v.weight"] = draw((kv * head, d), 0.05)
        t[b + "attn_v.bias"] = draw((kv * head,), 0.1)
        t[b + "attn_output.weight"] = draw((d, heads * head), 0.05)
        t[b + "attn_output.bias"] = draw((d,), 0.05)
        t[b + "attn_sinks.weight"] = draw((heads,), 1.0, 0.5)
        t[b + "post_attention_norm.weight"] = draw((d,), 0.05, 1.0)
        t[b + "ffn_gate_inp.weight"] = draw((experts, d), 0.5)
        t[b + "ffn_gate_inp.bias"] = draw((experts,), 0.5)
        t[b + "ffn_gate_exps.weight"] = draw((experts, ffn, d), 0.4)
        t[b + "ffn_gate_exps.bias"] = draw((experts, ffn), 1.0)
        t[b + "ffn_up_exps.weight"] = draw((experts, ffn, d), 0.4)
        t[b + "ffn_up_exps.bias"] = draw((experts, ffn), 1.0)
        t[b + "ffn_down_exps.weight"] = draw((experts, d, ffn), 0.003)
        t[b + "ffn_down_exps.bias"] = draw((experts, d), 0.05)
    for gname, a in t.items():
        w.add_tensor(gname, a)
    finish(w)

    # The same weights as Transformers' GptOssForCausalLM holds them: the experts' gate and up
    # columns alternating in gate_up_proj [E, d, 2 F] (x times it), down_proj [E, F, d].
    hf = {"model.embed_tokens.weight": t["token_embd.weight"],
          "model.norm.weight": t["output_norm.weight"], "lm_head.weight": t["output.weight"]}
    names = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
             "ffn_gate_inp.bias": "mlp.router.bias"}
    for x, y in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
        for kind in ("weight", "bias"):
            names[f"attn_{x}.{kind}"] = f"self_attn.{y}_proj.{kind}"
    for i in range(layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for g, h in names.items():
            hf[p + h] = t[b + g]
        gate, up = t[b + "ffn_gate_exps.weight"], t[b + "ffn_up_exps.weight"]
        gu = np.empty((experts, d, 2 * ffn), dtype=np.float32)
        gu[:, :, 0::2] = gate.transpose(0, 2, 1)
        gu[:, :, 1::2] = up.transpose(0, 2, 1)
        gub = np.empty((experts, 2 * ffn), dtype=np.float32)
        gub[:, 0::2] = t[b + "ffn_gate_exps.bias"]
        gub[:, 1::2] = t[b + "ffn_up_exps.bias"]
        hf[p + "mlp.experts.gate_up_proj"] = gu
        hf[p + "mlp.experts.gate_up_proj_bias"] = gub
        hf[p + "mlp.experts.down_proj"] = np.ascontiguousarray(
            t[b + "ffn_down_exps.weight"].transpose(0, 2, 1))
        hf[p + "mlp.experts.down_proj_bias"] = t[b + "ffn_down_exps.bias"]
    folder = f"{OUT}/{name}_hf"
    os.makedirs(folder, exist_ok=True)
    write_safetensors(f"{folder}/model.safetensors", hf)
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
              "vocab_size": VOCAB, "hidden_size": d, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head,
              "intermediate_size": ffn, "num_local_experts": experts,
              "num_experts_per_tok": used, "experts_per_token": used, "rms_norm_eps": 1e-5,
              "rope_theta": spec["theta"], "max_position_embeddings": CTX,
              "initial_context_length": spec["yarn"]["original"],
              "rope_scaling": {"rope_type": "yarn", "factor": spec["yarn"]["factor"],
                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                               "original_max_position_embeddings": spec["yarn"]["original"]},
              "sliding_window": spec["window"],
              "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(layers)],
              "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu",
              "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "output_router_logits": False,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32", "use_cache": True, "initializer_range": 0.02}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    write_tokenizer(folder, tokens, types, False)


def write_gemma4(name, spec, seed):
    """Gemma 4's block as llama.cpp's converter writes it (conversion/gemma.py Gemma4Model)."""
    rng = np.random.default_rng(seed)
    d, ffn, layers, heads = (spec[k] for k in ("d", "ffn", "layers", "heads"))
    pattern, shared, P = spec["pattern"], spec["shared"], spec["per_layer"]

    def draw(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    windowed = [i % pattern < pattern - 1 for i in range(layers)]
    first_shared = layers - shared
    widths = [ffn if i < first_shared else 2 * ffn for i in range(layers)]
    kv = [spec["kv_swa"] if w else spec["kv"] for w in windowed]
    head = [spec["head_swa"] if w else spec["head"] for w in windowed]
    w = gguf.GGUFWriter(f"{OUT}/{name}.gguf", "gemma4")
    w.add_context_length(CTX)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(widths)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(spec["head"])
    w.add_value_length(spec["head"])
    w.add_key_length_swa(spec["head_swa"])
    w.add_value_length_swa(spec["head_swa"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(spec["theta"])
    w.add_rope_freq_base_swa(spec["theta_swa"])
    w.add_rope_dimension_count(spec["head"])
    w.add_rope_dimension_count_swa(spec["head_swa"])
    w.add_sliding_window(spec["window"])
    w.add_sliding_window_pattern(windowed)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(P)
    w.add_final_logit_softcapping(spec["cap"])
    E = spec.get("experts", 0)
    if E:
        w.add_expert_count(E)
        w.add_expert_used_count(spec["experts_used"])
        w.add_expert_feed_forward_length(spec["expert_ffn"])
    add_vocabulary(w, ("<start_of_turn>", "<end_of_turn>"))
    rotated = int(spec["head"] * spec["rotated"] / 2)
    t = {"token_embd.weight": draw((VOCAB, d), 0.15),
         "rope_freqs.weight": np.array([1.0] * rotated + [1e30] * (spec["head"] // 2 - rotated),
                                       dtype=np.float32),
         "output_norm.weight": draw((d,), 0.05, 1.0)}
    if P:
        t["per_layer_token_embd.weight"] = draw((VOCAB, layers * P), 0.5)
        t["per_layer_model_proj.weight"] = draw((layers * P, d), 0.1)
        t["per_layer_proj_norm.weight"] = draw((P,), 0.05, 1.0)
    for i in range(layers):
        b, D = f"blk.{i}.", head[i]
        t[b + "attn_norm.weight"] = draw((d,), 0.05, 1.0)
        t[b + "attn_q.weight"] = draw((heads * D, d), 0.1)
        t[b + "attn_q_norm.weight"] = draw((D,), 0.03, 0.3)
        if i < first_shared:
            t[b + "attn_k.weight"] = draw((kv[i] * D, d), 0.1)
            if windowed[i] or not spec.get("k_as_v"):
                t[b + "attn_v.weight"] = draw((kv[i] * D, d), 0.1)
            t[b + "attn_k_norm.weight"] = draw((D,), 0.03, 0.3)
        t[b + "attn_output.weight"] = draw((d, heads * D), 0.05)
        t[b + "post_attention_norm.weight"] = draw((d,), 0.05, 1.0)
        t[b + "ffn_norm.weight"] = draw((d,), 0.05, 1.0)
        t[b + "ffn_gate.weight"] = draw((widths[i], d), 0.05)
        t[b + "ffn_up.weight"] = draw((widths[i], d), 0.05)
        t[b + "ffn_down.weight"] = draw((d, widths[i]), 0.05)
        t[b + "post_ffw_norm.weight"] = draw((d,), 0.002, 0.03)
        if E:
            # The experts on a norm of their own, the router on the residual through its scale,
            # each expert's output scaled; both outputs normed, their sum normed small.
            Fe = spec["expert_ffn"]
            t[b + "post_ffw_norm_1.weight"] = draw((d,), 0.05, 1.0)
            t[b + "pre_ffw_norm_2.weight"] = draw((d,), 0.05, 1.0)
            t[b + "post_ffw_norm_2.weight"] = draw((d,), 0.05, 1.0)
            t[b + "ffn_gate_inp.weight"] = draw((E, d), 0.5)
            t[b + "ffn_gate_inp.scale"] = draw((d,), 0.1, 1.0)
            t[b + "ffn_gate_up_exps.weight"] = draw((E, 2 * Fe, d), 0.05)
            t[b + "ffn_down_exps.weight"] = draw((E, d, Fe), 0.05)
            t[b + "ffn_down_exps.scale"] = draw((E,), 0.2, 1.0)
        if P:
            t[b + "inp_gate.weight"] = draw((P, d), 0.1)
            t[b + "proj.weight"] = draw((d, P), 0.1)
            t[b + "post_norm.weight"] = draw((d,), 0.002, 0.03)
        t[b + "layer_output_scale.weight"] = draw((1,), 0.1, 0.8)
    for gname, a in t.items():
        w.add_tensor(gname, a)
    finish(w)
    if spec.get("hf"):
        write_gemma4_hf(name, spec, t, windowed, kv, head)


# Gemma 4's GGUF tensors (less blk.N.) by Transformers' names (less model.layers.N.).
GEMMA4_HF = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj", "ffn_down_exps.weight": "experts.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight", "layer_output_scale.weight": "layer_scalar",
}


def write_gemma4_hf(name, spec, t, windowed, kv, head):
    """Gemma 4's weights `t` as Transformers holds them (norms as their gains, q and k rows in
    rotate-half order as in GGUF, rope_freqs derived from rope_parameters): Gemma4ForCausalLM's
    folder ("text"; with k and v projections of the shared-KV layers that the model leaves
    out, as a checkpoint may hold them), or the text model of Gemma4ForConditionalGeneration
    ("multimodal": model.language_model.*, vision and audio towers beside it)."""
    rng = np.random.default_rng(7)
    layers, d, shared = spec["layers"], spec["d"], spec["shared"]
    hf = {}
    model_names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                   "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
                   "per_layer_model_proj.weight": "per_layer_model_projection.weight",
                   "per_layer_proj_norm.weight": "per_layer_projection_norm.weight"}
    for gname, a in t.items():
        if gname == "rope_freqs.weight":
            continue
        if gname in model_names:
            hf["model." + model_names[gname]] = a
            continue
        _, i, rest = gname.split(".", 2)
        hf[f"model.layers.{i}." + GEMMA4_HF[rest]] = a
    for i in range(layers - shared, layers):
        D = head[i]
        for part, shape in (("k_proj.weight", (kv[i] * D, d)), ("v_proj.weight", (kv[i] * D, d)),
                            ("k_norm.weight", (D,))):
            hf[f"model.layers.{i}.self_attn.{part}"] = rng.standard_normal(shape).astype(np.float32)
    types = ["sliding_attention" if w else "full_attention" for w in windowed]
    E = spec.get("experts", 0)
    text = {"model_type": "gemma4_text", "vocab_size": VOCAB, "hidden_size": d,
            "num_hidden_layers": layers, "num_attention_heads": spec["heads"],
            "num_key_value_heads": spec["kv_swa"],
            "num_global_key_value_heads": spec["kv"] if spec.get("k_as_v") else None,
            "head_dim": spec["head_swa"], "global_head_dim": spec["head"],
            "intermediate_size": spec["ffn"], "use_double_wide_mlp": shared > 0,
            "num_kv_shared_layers": shared, "hidden_size_per_layer_input": spec["per_layer"],
            "vocab_size_per_layer_input": VOCAB, "layer_types": types,
            "sliding_window": spec["window"],
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "rope_theta": spec["theta"],
                                   "partial_rotary_factor": spec["rotated"]},
                "sliding_attention": {"rope_type": "default", "rope_theta": spec["theta_swa"]}},
            "final_logit_softcapping": spec["cap"], "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "attention_k_eq_v": bool(spec.get("k_as_v")),
            "enable_moe_block": E > 0, "num_experts": E or None,
            "top_k_experts": spec.get("experts_used"), "moe_intermediate_size": spec.get("expert_ffn"),
            "max_position_embeddings": CTX, "tie_word_embeddings": True, "attention_bias": False,
            "attention_dropout": 0.0, "use_bidirectional_attention": None, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 0, "dtype": "float32", "use_cache": True,
            "initializer_range": 0.02}
    if spec["hf"] == "multimodal":
        hf = {k.replace("model.", "model.language_model.", 1): a for k, a in hf.items()}
        for k, shape in (("model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight",
                          (32, 32)),
                         ("model.embed_vision.embedding_projection.weight", (d, 32)),
                         ("model.audio_tower.subsample_conv_projection.layer0.conv.weight",
                          (8, 1, 3, 3)),
                         ("model.embed_audio.embedding_projection.weight", (d, 32))):
            hf[k] = rng.standard_normal(shape).astype(np.float32)
        config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                  "text_config": text, "tie_word_embeddings": True,
                  "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32},
                  "audio_config": {"model_type": "gemma4_audio", "hidden_size": 32},
                  "image_token_id": 3, "dtype": "float32"}
    else:
        config = dict(text, architectures=["Gemma4ForCausalLM"])
    folder = f"{OUT}/{name}_hf"
    os.makedirs(folder, exist_ok=True)
    write_safetensors(f"{folder}/model.safetensors", hf)
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    tokens, _, types_ = vocabulary(("<start_of_turn>", "<end_of_turn>"))
    write_tokenizer(folder, tokens, types_, True)


def write_tokenizer(folder, tokens, types, gemma):
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": tokens[i], "special": True}
                         for i in range(len(tokens))
                         if i < 3 or types[i] == gguf.TokenType.CONTROL],
        "normalizer": {"type": "Sequence", "normalizers": (
            [] if gemma else [{"type": "Prepend", "prepend": "▁"}]) + [
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "model": {"type": "BPE", "byte_fallback": True, "unk_token": "<unk>",
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": []},
    }
    with open(f"{folder}/tokenizer.json", "w") as f:
        json.dump(tokenizer, f)
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)


for seed, (family, family_spec) in enumerate(FAMILIES.items()):
    write = (write_gpt_oss if family_spec["arch"] == "gpt-oss" else
             write_gemma4 if family_spec["arch"] == "gemma4" else
             write_qwen35 if family_spec.get("qwen35") else write_family)
    write(family, family_spec, 10 + seed)
