#!/usr/bin/python3
"""LoRA fine-tuning of a Qwen2.5-0.5B-, Qwen3-0.6B- or Gemma-3-1B-shaped model in PyTorch, next to
`cputrain finetune`.

The shapes of benchmarks/make_model.py: qwen2-0.5b (d_model 896, 24 layers, 14 query heads and 2
key/value heads of 64, ffn 4864, q/k/v biases) and qwen3-0.6b (d_model 1024, 28 layers, 16 query
heads and 8 key/value heads of 128, ffn 3072, per-head RMSNorm of q and k before RoPE, no biases);
both vocab 151936, a tied head, half-split RoPE at theta 1e6, RMSNorm eps 1e-6; gemma3-1b (d_model
1152, 26 layers, 4 query heads and 1 key/value head of 256, ffn 6912, vocab 262144, q/k norms, GeGLU
with GELU's tanh approximation, RMSNorms after attention and after the MLP, embeddings times
sqrt(d_model), five layers of six within a window of 512 keys at RoPE base 10,000 and the sixth at
1,000,000). The base is random, frozen and held in bf16; LoRA adapters of rank r
(alpha 2r) on q, k, v, o, gate, up and down are plain modules (A and B FP32 parameters, A as PEFT
begins it, B zero), under torch.autocast bf16; AdamW (weight decay 0, clip 1) on the adapters
alone. Batches are random tokens with every position a target. Attention is the plain masked
softmax (PyTorch 1.13 has no fused attention on the CPU), key/value heads repeated for GQA.

    /usr/bin/python3 benchmarks/finetune_torch.py [--shape qwen2-0.5b|qwen3-0.6b|gemma3-1b] [--batch 4]
        [--ctx 512] [--rank 16] [--steps 6] [--checkpoint] [--threads N] [--json]

Prints tokens/s and ms/step (medians of the steps after the first two) and the peak resident
set (ru_maxrss), in PyTorch's fastest configuration on this CPU (benchmarks/torch_train.py sets
it up: OpenBLAS, all cores, ATen's AVX-512 kernels, oneDNN's best bf16 ISA, TCMalloc).
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_train  # noqa: E402  (its configure() re-runs this script in the right environment)

# d_model, ffn, layers, heads, kv heads, head dim, q/k/v biases, q/k norms
SHAPES = {"qwen2-0.5b": (896, 4864, 24, 14, 2, 64, True, False),
          "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, False, True),
          "gemma3-1b": (1152, 6912, 26, 4, 1, 256, False, True)}
D, F, LAYERS, HEADS, KV, HEAD, BIAS, QK_NORM = SHAPES["qwen2-0.5b"]
VOCAB, THETA, EPS = 151936, 1e6, 1e-6
GEMMA3, WINDOW, THETA_LOCAL = False, 512, 1e4
WARMUP = 2


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--checkpoint", action="store_true", help="per-layer activation checkpointing")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--allocator", default="tcmalloc", choices=torch_train.ALLOCATORS)
    ap.add_argument("--blas", default="openblas", choices=["openblas", "system"])
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    torch_train.configure(ARGS, script=os.path.abspath(__file__))

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402


class LoraLinear(torch.nn.Module):
    """A frozen bf16 linear layer and its adapter: y = W x + b + (alpha / r) B A x."""

    def __init__(self, inp, out, rank, bias=False):
        super().__init__()
        self.weight = torch.nn.Parameter(
            (0.02 * torch.randn(out, inp)).bfloat16(), requires_grad=False)
        self.bias = torch.nn.Parameter(0.02 * torch.randn(out), requires_grad=False) if bias else None
        self.lora_a = torch.nn.Parameter(torch.empty(rank, inp))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = torch.nn.Parameter(torch.zeros(out, rank))
        self.scale = 2.0

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return y + torch.nn.functional.linear(
            torch.nn.functional.linear(x, self.lora_a), self.lora_b) * self.scale


class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x) * self.weight


def rope(x, cos, sin):  # Hugging Face's rotate_half: pairs (j, j + D/2)
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)


class Block(torch.nn.Module):
    def __init__(self, rank, index=0):
        super().__init__()
        # Gemma 3: post-norms; five layers of six windowed, at the local RoPE base.
        self.windowed = GEMMA3 and index % 6 < 5
        self.post_attention_norm = RMSNorm(D) if GEMMA3 else torch.nn.Identity()
        self.post_ffw_norm = RMSNorm(D) if GEMMA3 else torch.nn.Identity()
        self.attention_norm = RMSNorm(D)
        self.q = LoraLinear(D, HEADS * HEAD, rank, bias=BIAS)
        self.k = LoraLinear(D, KV * HEAD, rank, bias=BIAS)
        self.v = LoraLinear(D, KV * HEAD, rank, bias=BIAS)
        self.q_norm = RMSNorm(HEAD) if QK_NORM else torch.nn.Identity()
        self.k_norm = RMSNorm(HEAD) if QK_NORM else torch.nn.Identity()
        self.o = LoraLinear(HEADS * HEAD, D, rank)
        self.ffn_norm = RMSNorm(D)
        self.gate = LoraLinear(D, F, rank)
        self.up = LoraLinear(D, F, rank)
        self.down = LoraLinear(F, D, rank)

    def forward(self, x, cos, sin, mask, cos_local=None, sin_local=None, mask_local=None):
        B, T, _ = x.shape
        if self.windowed:
            cos, sin, mask = cos_local, sin_local, mask_local
        h = self.attention_norm(x)
        q = rope(self.q_norm(self.q(h).view(B, T, HEADS, HEAD)), cos, sin)
        q = (q * HEAD ** -0.5).transpose(1, 2)
        k = rope(self.k_norm(self.k(h).view(B, T, KV, HEAD)), cos, sin).transpose(1, 2)
        v = self.v(h).view(B, T, KV, HEAD).transpose(1, 2)
        k = k.repeat_interleave(HEADS // KV, dim=1)
        v = v.repeat_interleave(HEADS // KV, dim=1)
        scores = (q @ k.transpose(-1, -2)).float().masked_fill_(mask, float("-inf"))
        a = (scores.softmax(-1).type_as(v) @ v).transpose(1, 2).reshape(B, T, HEADS * HEAD)
        x = x + self.post_attention_norm(self.o(a))
        g = self.ffn_norm(x)
        if GEMMA3:
            act = torch.nn.functional.gelu(self.gate(g), approximate="tanh")
        else:
            act = torch.nn.functional.silu(self.gate(g))
        return x + self.post_ffw_norm(self.down(act * self.up(g)))


class Model(torch.nn.Module):
    def __init__(self, rank, ctx, checkpoint):
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = torch.nn.Parameter((0.02 * torch.randn(VOCAB, D)).bfloat16(),
                                        requires_grad=False)
        self.layers = torch.nn.ModuleList(Block(rank, i) for i in range(LAYERS))
        self.norm = RMSNorm(D)
        pos = torch.arange(ctx, dtype=torch.float64)[:, None]
        j = torch.arange(HEAD // 2, dtype=torch.float64)[None, :]
        angle = pos * THETA ** (-2.0 * j / HEAD)
        self.register_buffer("cos", torch.cos(angle).float())
        self.register_buffer("sin", torch.sin(angle).float())
        self.register_buffer("mask", ~torch.ones(ctx, ctx, dtype=torch.bool).tril())
        local = pos * THETA_LOCAL ** (-2.0 * j / HEAD)
        self.register_buffer("cos_local", torch.cos(local).float())
        self.register_buffer("sin_local", torch.sin(local).float())
        self.register_buffer("mask_local",
                             self.mask | torch.ones(ctx, ctx, dtype=torch.bool).tril(-WINDOW))

    def forward(self, tokens, targets):
        x = torch.nn.functional.embedding(tokens, self.embed)
        if GEMMA3:
            x = x * torch.tensor(D ** 0.5, dtype=x.dtype)
        tables = (self.cos, self.sin, self.mask, self.cos_local, self.sin_local, self.mask_local)
        for layer in self.layers:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, *tables)
            else:
                x = layer(x, *tables)
        logits = torch.nn.functional.linear(self.norm(x), self.embed).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def main(args):
    global D, F, LAYERS, HEADS, KV, HEAD, BIAS, QK_NORM, VOCAB, GEMMA3
    D, F, LAYERS, HEADS, KV, HEAD, BIAS, QK_NORM = SHAPES[args.shape]
    if args.shape == "gemma3-1b":
        VOCAB, GEMMA3 = 262144, True
    torch.set_num_threads(args.threads)
    print(torch_train.configuration(args), file=sys.stderr, flush=True)
    torch.manual_seed(0)
    with torch.no_grad():
        model = Model(args.rank, args.ctx, args.checkpoint)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (args.batch, args.ctx + 1), generator=gen)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        print(f"step {step + 1}: loss {losses[-1]:.4f}, {times[-1] * 1000:.0f} ms", file=sys.stderr,
              flush=True)
    measured = times[WARMUP:] or times
    ms = statistics.median(measured) * 1000
    tokens_per_s = args.batch * args.ctx / (ms / 1000)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"tokens_per_s": tokens_per_s, "ms_per_step": ms, "peak_rss_bytes": peak,
              "trained_parameters": sum(p.numel() for p in trained), "losses": losses}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"pytorch LoRA r{args.rank}: {tokens_per_s:.0f} tokens/s, {ms:.0f} ms/step, "
              f"peak RSS {peak / 2**30:.2f} GiB")


if __name__ == "__main__":
    main(ARGS)
