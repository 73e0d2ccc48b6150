#!/usr/bin/python3
"""Random-weight GGUF models for the interop tests, written with llama.cpp's own gguf-py.

Usage: make_gguf_models.py GGUF_PY_DIR OUT_DIR
Writes into OUT_DIR:
- llama_gqa.gguf: architecture llama, grouped-query attention (8 query heads, 2 key/value
  heads), an untied output layer, RoPE theta 500000, F32 and F16 tensors;
- qwen2_tied.gguf: architecture qwen2, q/k/v biases, the output tied to the embedding, RoPE
  theta 1e6, F32 tensors;
- qwen2_tied_bf16.gguf: the same with BF16 matrices.
Both have a SentencePiece-style vocabulary of 512 pieces (unk, bos, eos, 256 byte pieces and
words), rows of 256 so that llama.cpp's quantiser writes K-quants for every matrix, and weights
drawn so that the embedding dominates the residual stream: the next-token distribution is
peaked, and an argmax comparison measures the arithmetic rather than ties among near-equal
logits.
"""
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402

OUT = sys.argv[2]
D, F, LAYERS, HEADS, KV_HEADS, VOCAB, CTX = 256, 512, 2, 4, 2, 512, 256
HEAD = D // HEADS


def vocabulary():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    words = ["▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "▁and", "▁ran", "▁far"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["▁"]
    pieces = words + letters
    i = 0
    while len(tokens) + len(pieces) < VOCAB:
        pieces.append(f"▁w{i}")
        i += 1
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def write(name, arch, theta, tied, biases, dtype):
    rng = np.random.default_rng(1 if arch == "llama" else 2)
    w = gguf.GGUFWriter(f"{OUT}/{name}", arch)
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(F)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(HEAD)
    tokens, scores, types = vocabulary()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def tensor(tname, shape, std, mean=0.0):
        # numpy shape is (rows, row length): ggml's ne reversed.
        a = (mean + std * rng.standard_normal(shape)).astype(np.float32)
        if len(shape) == 2 and dtype == "f16":
            a = a.astype(np.float16)
        if len(shape) == 2 and dtype == "bf16":
            bits = (a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1)) >> 16
            w.add_tensor(tname, bits.astype(np.uint16), raw_shape=shape,
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
            return
        w.add_tensor(tname, a)

    embedding = (0.15 * rng.standard_normal((VOCAB, D))).astype(np.float32)
    w.add_tensor("token_embd.weight", embedding)
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", (D,), 0.05, 1.0)
        tensor(b + "attn_q.weight", (D, D), 0.05)
        tensor(b + "attn_k.weight", (KV_HEADS * HEAD, D), 0.05)
        tensor(b + "attn_v.weight", (KV_HEADS * HEAD, D), 0.05)
        if biases:
            tensor(b + "attn_q.bias", (D,), 0.1)
            tensor(b + "attn_k.bias", (KV_HEADS * HEAD,), 0.1)
            tensor(b + "attn_v.bias", (KV_HEADS * HEAD,), 0.1)
        tensor(b + "attn_output.weight", (D, D), 0.05)
        tensor(b + "ffn_norm.weight", (D,), 0.05, 1.0)
        tensor(b + "ffn_gate.weight", (F, D), 0.05)
        tensor(b + "ffn_up.weight", (F, D), 0.05)
        tensor(b + "ffn_down.weight", (D, F), 0.05)
    tensor("output_norm.weight", (D,), 0.05, 1.0)
    if not tied:
        head = embedding + (0.1 * rng.standard_normal((VOCAB, D))).astype(np.float32)
        if dtype == "f16":
            head = head.astype(np.float16)
        w.add_tensor("output.weight", head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


write("llama_gqa.gguf", "llama", 500000.0, tied=False, biases=False, dtype="f16")
write("qwen2_tied.gguf", "qwen2", 1e6, tied=True, biases=True, dtype="f32")
write("qwen2_tied_bf16.gguf", "qwen2", 1e6, tied=True, biases=True, dtype="bf16")
