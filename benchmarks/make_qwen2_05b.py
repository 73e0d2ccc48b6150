#!/usr/bin/python3
"""A GGUF of Qwen2-0.5B's shape with random BF16 weights, for the load, decode and fine-tuning
benchmarks.

Usage: make_qwen2_05b.py GGUF_PY_DIR OUT.gguf
Shape: d_model 896, 24 layers, 14 query heads and 2 key/value heads of 64, ffn 4864, vocab 151936,
q/k/v biases, tied embeddings, RoPE theta 1e6 (494M parameters, 0.99 GB). The tokenizer is
Qwen2's, from llama.cpp's models/ggml-vocab-qwen2.gguf (next to gguf-py), padded to 151936 as
Qwen2's own files are.
"""
import os
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402

D, F, LAYERS, HEADS, KV, HEAD, VOCAB = 896, 4864, 24, 14, 2, 64, 151936
rng = np.random.default_rng(3)


def bf16(shape, std):
    a = (std * rng.standard_normal(shape, dtype=np.float32)).view(np.uint32)
    return ((a + 0x7FFF + ((a >> 16) & 1)) >> 16).astype(np.uint16)


w = gguf.GGUFWriter(sys.argv[2], "qwen2")
w.add_context_length(32768)
w.add_embedding_length(D)
w.add_block_count(LAYERS)
w.add_feed_forward_length(F)
w.add_head_count(HEADS)
w.add_head_count_kv(KV)
w.add_layer_norm_rms_eps(1e-6)
w.add_rope_freq_base(1e6)
vocab = gguf.GGUFReader(os.path.join(sys.argv[1], "..", "models", "ggml-vocab-qwen2.gguf"))


def field(name):
    f = vocab.fields[name]
    return [bytes(f.parts[i]).decode() for i in f.data] if f.types[0] == gguf.GGUFValueType.ARRAY \
        and f.types[-1] == gguf.GGUFValueType.STRING else [int(f.parts[i][0]) for i in f.data]


tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
tokens += [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
types += [gguf.TokenType.UNUSED] * (VOCAB - len(types))
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("qwen2")
w.add_token_list(tokens)
w.add_token_types(types)
w.add_token_merges(field("tokenizer.ggml.merges"))
w.add_eos_token_id(field("tokenizer.ggml.eos_token_id")[0])
w.add_add_bos_token(False)


def add(name, shape, std):
    w.add_tensor(name, bf16(shape, std), raw_shape=shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


add("token_embd.weight", (VOCAB, D), 0.02)
for i in range(LAYERS):
    b = f"blk.{i}."
    w.add_tensor(b + "attn_norm.weight", np.ones(D, dtype=np.float32))
    add(b + "attn_q.weight", (HEADS * HEAD, D), 0.02)
    add(b + "attn_k.weight", (KV * HEAD, D), 0.02)
    add(b + "attn_v.weight", (KV * HEAD, D), 0.02)
    for part, n in (("q", HEADS * HEAD), ("k", KV * HEAD), ("v", KV * HEAD)):
        w.add_tensor(b + f"attn_{part}.bias", (0.02 * rng.standard_normal(n)).astype(np.float32))
    add(b + "attn_output.weight", (D, HEADS * HEAD), 0.02)
    w.add_tensor(b + "ffn_norm.weight", np.ones(D, dtype=np.float32))
    add(b + "ffn_gate.weight", (F, D), 0.02)
    add(b + "ffn_up.weight", (F, D), 0.02)
    add(b + "ffn_down.weight", (D, F), 0.02)
w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
