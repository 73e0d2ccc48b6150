#!/usr/bin/python3
"""Reference tensors for tests/models/test_llama_reference.cpp, from PyTorch.

A self-contained fp32 PyTorch implementation of the cputrain decoder (tiny preset): from one
seeded set of weights and one batch it records the logits, the loss, every parameter gradient,
and the losses, gradient norms and weights of 10 AdamW steps with global norm clipping.

Regenerate (Debian's python3-torch; `tools/install_deps.sh --torch` installs it):
    /usr/bin/python3 tests/models/make_llama_reference.py
which rewrites tests/data/llama_tiny_reference.ctrf.

File format "CTRF", little-endian: magic b"CTRF", u32 version (1), u32 record count; then per
record u32 name length, name (utf-8), u32 dtype (0 f32, 1 i32), u32 ndim, ndim x u64 dims, data.
"""
import math
import os
import struct

import torch

V, C, L, H, F = 512, 64, 2, 4, 192  # the tiny preset
B, T = 2, 32
D = C // H
EPS = 1e-5
THETA = 10000.0
LR, BETAS, ADAM_EPS, DECAY, CLIP, STEPS = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0, 10


def parameter_shapes():
    shapes = [("tok_embeddings.weight", (V, C))]
    for i in range(L):
        p = f"layers.{i}."
        shapes += [
            (p + "attention_norm.weight", (C,)),
            (p + "attention.wq.weight", (C, C)),
            (p + "attention.wk.weight", (C, C)),
            (p + "attention.wv.weight", (C, C)),
            (p + "attention.wo.weight", (C, C)),
            (p + "ffn_norm.weight", (C,)),
            (p + "feed_forward.w1.weight", (F, C)),
            (p + "feed_forward.w3.weight", (F, C)),
            (p + "feed_forward.w2.weight", (C, F)),
        ]
    shapes += [("norm.weight", (C,)), ("output.weight", (V, C))]
    return shapes


def init_parameters(gen):
    params = {}
    for name, shape in parameter_shapes():
        if len(shape) == 1:
            # Gains away from 1 so their gradients matter.
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("wo.weight") or name.endswith("w2.weight"):
            t = torch.randn(shape, generator=gen) * (0.02 / math.sqrt(2 * L))
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        params[name] = t.float().requires_grad_(True)
    return params


def rope_table():
    # Angles in float64, rounded to float32, as the C++ table is.
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    j = torch.arange(D // 2, dtype=torch.float64)[None, :]
    angle = pos * THETA ** (-2.0 * j / D)
    return torch.cos(angle).float(), torch.sin(angle).float()


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, cos, sin):
    # x (B, T, H, D): rotate adjacent pairs (x[2j], x[2j+1]) by the angle of position t.
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def attention(q, k, v):
    # (B, T, H, D) -> (B, T, H, D), causal, scale 1/sqrt(D).
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def forward(p, tokens, cos, sin):
    x = p["tok_embeddings.weight"][tokens]
    for i in range(L):
        n = f"layers.{i}."
        h = rmsnorm(x, p[n + "attention_norm.weight"])
        q = rope((h @ p[n + "attention.wq.weight"].T).view(B, T, H, D), cos, sin)
        k = rope((h @ p[n + "attention.wk.weight"].T).view(B, T, H, D), cos, sin)
        v = (h @ p[n + "attention.wv.weight"].T).view(B, T, H, D)
        x = x + attention(q, k, v).reshape(B, T, C) @ p[n + "attention.wo.weight"].T
        g = rmsnorm(x, p[n + "ffn_norm.weight"])
        gate = g @ p[n + "feed_forward.w1.weight"].T
        up = g @ p[n + "feed_forward.w3.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ p[n + "feed_forward.w2.weight"].T
    x = rmsnorm(x, p["norm.weight"])
    return x @ p["output.weight"].T


def loss_of(logits, targets):
    return torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))


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


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(1234)
    params = init_parameters(gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    cos, sin = rope_table()

    out = Writer()
    out.add("config", torch.tensor([V, C, L, H, F, B, T], dtype=torch.int32))
    out.add("tokens", tokens)
    out.add("targets", targets)
    for name, t in params.items():
        out.add("init/" + name, t)

    logits = forward(params, tokens, cos, sin)
    loss = loss_of(logits, targets)
    loss.backward()
    out.add("logits", logits)
    out.add("loss", loss.reshape(1))
    for name, t in params.items():
        out.add("grad/" + name, t.grad)

    matrices = [t for t in params.values() if t.dim() == 2]
    gains = [t for t in params.values() if t.dim() == 1]
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": DECAY}, {"params": gains, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=ADAM_EPS)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        loss = loss_of(forward(params, tokens, cos, sin), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    out.add("steps/loss", torch.tensor(losses))
    out.add("steps/grad_norm", torch.tensor(norms))
    for name, t in params.items():
        out.add("final/" + name, t)

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                        "llama_tiny_reference.ctrf")
    out.write(os.path.normpath(path))
    print(f"init loss {losses[0]:.6f}, after {STEPS} steps {losses[-1]:.6f}; grad norms "
          + " ".join(f"{n:.4f}" for n in norms))
    print(f"wrote {os.path.normpath(path)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
