#!/usr/bin/python3
"""A GGUF of a Qwen2.5 model's shape with random BF16 weights, for the load, decode and fine-tuning
benchmarks.

Usage: make_qwen2.py GGUF_PY_DIR OUT.gguf [SIZE]
SIZE 0.5b (the default): d_model 896, 24 layers, 14 query heads and 2 key/value heads of 64,
  ffn 4864 (494M parameters, 0.99 GB).
SIZE 3b: d_model 2048, 36 layers, 16 query heads and 2 key/value heads of 128, ffn 11008
  (3.09B parameters, 6.2 GB).
Both: vocab 151936, q/k/v biases, tied embeddings, RoPE theta 1e6. The tokenizer is Qwen2's, from
llama.cpp's models/ggml-vocab-qwen2.gguf (next to gguf-py), padded to 151936 as Qwen2's own files
are. Tensors are generated and written one at a time, so the writer holds one in memory.
"""
import os
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402

SHAPES = {"0.5b": (896, 4864, 24, 14, 2, 64), "3b": (2048, 11008, 36, 16, 2, 128)}
size = sys.argv[3] if len(sys.argv) > 3 else "0.5b"
if size not in SHAPES:
    sys.exit(f"make_qwen2.py: SIZE {size!r} is not one of {', '.join(SHAPES)}")
D, F, LAYERS, HEADS, KV, HEAD = SHAPES[size]
VOCAB = 151936
rng = np.random.default_rng(3)

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

# (name, shape, what): "bf16" Normal(0, 0.02) rounded to bf16, "ones" and "bias" FP32.
tensors = [("token_embd.weight", (VOCAB, D), "bf16")]
for i in range(LAYERS):
    b = f"blk.{i}."
    tensors += [(b + "attn_norm.weight", (D,), "ones"),
                (b + "attn_q.weight", (HEADS * HEAD, D), "bf16"),
                (b + "attn_k.weight", (KV * HEAD, D), "bf16"),
                (b + "attn_v.weight", (KV * HEAD, D), "bf16"),
                (b + "attn_q.bias", (HEADS * HEAD,), "bias"),
                (b + "attn_k.bias", (KV * HEAD,), "bias"),
                (b + "attn_v.bias", (KV * HEAD,), "bias"),
                (b + "attn_output.weight", (D, HEADS * HEAD), "bf16"),
                (b + "ffn_norm.weight", (D,), "ones"),
                (b + "ffn_gate.weight", (F, D), "bf16"),
                (b + "ffn_up.weight", (F, D), "bf16"),
                (b + "ffn_down.weight", (D, F), "bf16")]
tensors.append(("output_norm.weight", (D,), "ones"))


def values(shape, what):
    if what == "ones":
        return np.ones(shape, dtype=np.float32)
    if what == "bias":
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    a = (0.02 * rng.standard_normal(shape, dtype=np.float32)).view(np.uint32)
    return ((a + 0x7FFF + ((a >> 16) & 1)) >> 16).astype(np.uint16)


for name, shape, what in tensors:
    if what == "bf16":
        w.add_tensor_info(name, shape, np.dtype(np.uint16), 2 * int(np.prod(shape)),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()
for name, shape, what in tensors:
    w.write_tensor_data(values(shape, what))
w.close()
