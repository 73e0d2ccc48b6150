#!/usr/bin/python3
"""Random-weight GGUF models for the interop tests, written with llama.cpp's own gguf-py.

Usage: make_gguf_models.py GGUF_PY_DIR OUT_DIR
Writes into OUT_DIR:
- llama_gqa.gguf: architecture llama, grouped-query attention (8 query heads, 2 key/value
  heads), an untied output layer, RoPE theta 500000, F32 and F16 tensors;
- llama_gqa_f32.gguf: the same values, its F16 matrices widened to F32 (llama.cpp rounds the
  activations of an F16 product to F16 on most CPUs: the tight comparison is on this file);
- qwen2_tied.gguf: architecture qwen2, q/k/v biases, the output tied to the embedding, RoPE
  theta 1e6, F32 tensors;
- qwen2_tied_bf16.gguf: the same with BF16 matrices;
- llama_gqa_hf/: llama_gqa.gguf's weights as a Hugging Face folder (config.json, model.safetensors
  written by hand, tokenizer.json, tokenizer_config.json), q and k rows back in Hugging Face's
  rotate-half order.
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


HF_TENSORS = {}  # llama_gqa's tensors, for the Hugging Face folder


def write(name, arch, theta, tied, biases, dtype, widen=False):
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
            if widen:
                a = a.astype(np.float32)
        if name == "llama_gqa.gguf":
            HF_TENSORS[tname] = a
        if len(shape) == 2 and dtype == "bf16":
            bits = (a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1)) >> 16
            w.add_tensor(tname, bits.astype(np.uint16), raw_shape=shape,
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
            return
        w.add_tensor(tname, a)

    embedding = (0.15 * rng.standard_normal((VOCAB, D))).astype(np.float32)
    if dtype == "bf16":  # every matrix BF16, the embedding too
        bits = embedding.view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        w.add_tensor("token_embd.weight", bits, raw_shape=(VOCAB, D),
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        w.add_tensor("token_embd.weight", embedding)
    if name == "llama_gqa.gguf":
        HF_TENSORS["token_embd.weight"] = embedding
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
            if widen:
                head = head.astype(np.float32)
        w.add_tensor("output.weight", head)
        if name == "llama_gqa.gguf":
            HF_TENSORS["output.weight"] = head
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


write("llama_gqa.gguf", "llama", 500000.0, tied=False, biases=False, dtype="f16")
write("llama_gqa_f32.gguf", "llama", 500000.0, tied=False, biases=False, dtype="f16", widen=True)
write("qwen2_tied.gguf", "qwen2", 1e6, tied=True, biases=True, dtype="f32")
write("qwen2_tied_bf16.gguf", "qwen2", 1e6, tied=True, biases=True, dtype="bf16")


def rotate_half_rows(a, heads):
    """GGUF llama's adjacent pairs (2j, 2j+1) of each head back to rows (j, j + D/2)."""
    rows, cols = a.shape
    d = rows // heads
    a = a.reshape(heads, d // 2, 2, cols)
    return a.transpose(0, 2, 1, 3).reshape(rows, cols)


def write_safetensors(path, tensors):
    import json
    header, chunks, offset = {}, [], 0
    for tname, a in tensors.items():
        data = np.ascontiguousarray(a).tobytes()
        dtype = {"float32": "F32", "float16": "F16"}[a.dtype.name]
        header[tname] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for c in chunks:
            f.write(c)


def write_hf(folder):
    import json
    import os
    os.makedirs(folder, exist_ok=True)
    names = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    parts = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tensors = {}
    for gname, a in HF_TENSORS.items():
        if gname in names:
            tensors[names[gname]] = a
            continue
        _, layer, part, kind = gname.split(".")
        if part == "attn_q":
            a = rotate_half_rows(a, HEADS)
        if part == "attn_k":
            a = rotate_half_rows(a, KV_HEADS)
        tensors[f"model.layers.{layer}.{parts[part]}.{kind}"] = a
    write_safetensors(f"{folder}/model.safetensors", tensors)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
              "hidden_size": D, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "intermediate_size": F, "rms_norm_eps": 1e-6,
              "rope_theta": 500000.0, "max_position_embeddings": CTX, "tie_word_embeddings": False,
              "hidden_act": "silu", "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    tokens, _, types = vocabulary()
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": tokens[i], "special": True} for i in (0, 1, 2)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "model": {"type": "BPE", "byte_fallback": True, "unk_token": "<unk>",
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": []},
    }
    with open(f"{folder}/tokenizer.json", "w") as f:
        json.dump(tokenizer, f)
    with open(f"{folder}/tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}, f)


write_hf(f"{OUT}/llama_gqa_hf")
