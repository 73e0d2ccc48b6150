#!/usr/bin/python3
"""Trains cputrain's decoder in PyTorch, for the side-by-side throughput comparison.

The same architecture as models/llama.cpp (RMSNorm, RoPE on adjacent pairs, causal attention,
SwiGLU, untied LM head, mean cross-entropy), the same presets, batch, context and vocabulary,
AdamW (0.9, 0.95, weight decay 0.1 on matrices) with global norm clipping at 1. Tokens are
random: throughput does not depend on them. Attention is the plain masked softmax (Debian's
PyTorch 1.13 has no fused attention on the CPU).

    /usr/bin/python3 benchmarks/torch_train.py --preset mega --dtype bf16 [--steps 4]
        [--checkpoint] [--threads 2] [--json]

--dtype bf16 is torch.autocast("cpu", dtype=torch.bfloat16) over FP32 weights, PyTorch's
mixed precision on the CPU. Prints tokens/s and ms/step (medians of the steps after the first)
and the peak resident set (ru_maxrss). Installed by `tools/install_deps.sh --torch`.
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

# Debian's PyTorch 1.13 runs bf16 through oneDNN 2.6, whose AMX kernels die on SIGILL on the
# Xeons with AMX we have run on; it is kept to AVX512_CORE_BF16 there, as cputrain's oneDNN backend
# is (kernels/gemm_onednn.cpp), unless ONEDNN_MAX_CPU_ISA is set. Must precede the import.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
import torch
import torch.utils.checkpoint

PRESETS = {  # vocab, d_model, layers, heads, ffn, ctx, batch (as models/llama_config.cpp)
    "tiny": (512, 64, 2, 4, 192, 64, 4),
    "mini": (16384, 256, 6, 8, 768, 256, 8),
    "mega": (16384, 512, 24, 8, 1536, 1024, 4),
    "behemoth": (16384, 1024, 32, 16, 2816, 1024, 2),
}
EPS = 1e-5
THETA = 10000.0


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x) * self.weight


def rope(x, cos, sin):
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class Block(torch.nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.heads = heads
        self.attention_norm = RMSNorm(d)
        self.wq = torch.nn.Linear(d, d, bias=False)
        self.wk = torch.nn.Linear(d, d, bias=False)
        self.wv = torch.nn.Linear(d, d, bias=False)
        self.wo = torch.nn.Linear(d, d, bias=False)
        self.ffn_norm = RMSNorm(d)
        self.w1 = torch.nn.Linear(d, ffn, bias=False)
        self.w3 = torch.nn.Linear(d, ffn, bias=False)
        self.w2 = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, C = x.shape
        H, D = self.heads, C // self.heads
        h = self.attention_norm(x)
        q = rope(self.wq(h).view(B, T, H, D), cos, sin).transpose(1, 2)
        k = rope(self.wk(h).view(B, T, H, D), cos, sin).transpose(1, 2)
        v = self.wv(h).view(B, T, H, D).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        scores = scores.float().masked_fill(mask, float("-inf"))
        a = (scores.softmax(-1).type_as(v) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.wo(a)
        g = self.ffn_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(g)) * self.w3(g))


class Model(torch.nn.Module):
    def __init__(self, vocab, d, layers, heads, ffn, ctx, checkpoint):
        super().__init__()
        self.checkpoint = checkpoint
        self.tok_embeddings = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = torch.nn.Linear(d, vocab, bias=False)
        D = d // heads
        pos = torch.arange(ctx, dtype=torch.float64)[:, None]
        j = torch.arange(D // 2, dtype=torch.float64)[None, :]
        angle = pos * THETA ** (-2.0 * j / D)
        self.register_buffer("cos", torch.cos(angle).float())
        self.register_buffer("sin", torch.sin(angle).float())
        self.register_buffer("mask", ~torch.ones(ctx, ctx, dtype=torch.bool).tril())
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens, targets):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, self.cos, self.sin, self.mask)
            else:
                x = layer(x, self.cos, self.sin, self.mask)
        logits = self.output(self.norm(x)).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini", choices=PRESETS)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batch", type=int)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--steps", type=int, default=4, help="steps timed after one warm-up step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", action="store_true", help="per-layer activation checkpointing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    vocab, d, layers, heads, ffn, ctx, batch = PRESETS[args.preset]
    batch, ctx = args.batch or batch, args.ctx or ctx
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Model(vocab, d, layers, heads, ffn, ctx, args.checkpoint)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(args.steps + 1):
        tokens = torch.randint(0, vocab, (batch, ctx + 1), generator=gen)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        losses.append(loss.item())
        if step > 0:
            times.append(elapsed)
        print(f"step {step} loss {losses[-1]:.4f} {elapsed * 1000:.0f} ms", file=sys.stderr)
    ms = statistics.median(times) * 1000
    result = {
        "impl": "pytorch", "torch": torch.__version__, "preset": args.preset,
        "dtype": args.dtype, "checkpoint": args.checkpoint, "batch": batch, "ctx": ctx,
        "threads": args.threads, "ms_per_step": ms, "tokens_per_s": batch * ctx / (ms / 1000),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "final_loss": losses[-1],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"pytorch {torch.__version__} {args.preset} {args.dtype} batch {batch} x {ctx}"
              f"{' checkpoint' if args.checkpoint else ''}: {result['tokens_per_s']:.0f} tokens/s, "
              f"{ms:.0f} ms/step, peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
