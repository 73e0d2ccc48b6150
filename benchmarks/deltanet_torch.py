#!/usr/bin/env python3
"""The chunked gated delta rule in PyTorch, as Transformers runs Qwen3.5's linear attention on a
CPU (its pure-torch chunked path): per chunk of 64 the WY form, (I + X)^-1 by a triangular solve
batched over the chunks and heads, then the chunks in turn for the state; the backward pass by
autograd. Written from the formulas of kernels/deltanet/gated_delta.h, FP32, at the shape of
benchmarks/bench_deltanet.cpp (Qwen3.5-2B's layer: 16 key and 16 value heads of 128, ctx 2048,
one sequence); prints the median forward and forward+backward times of RUNS (5) runs and checks
its output against the recurrent form on a short sequence first.

    /usr/bin/python3 benchmarks/deltanet_torch.py [--threads N]

threads: all cores this process may run on unless --threads.
"""
import argparse
import os
import statistics
import time

import torch


def chunked(q, k, v, g, beta, chunk=64):
    """q, k (B, H, T, dk), q already scaled; v (B, H, T, dv); g, beta (B, H, T)."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))
    G = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    X = (beta[..., :, None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype)
    Tinv = torch.linalg.solve_triangular(eye + X, eye.expand_as(X), upper=False)
    Ut = Tinv @ (beta[..., None] * v)
    W = Tinv @ ((beta * G.exp())[..., None] * k)
    A = (q @ k.transpose(-1, -2)) * decay
    khat = (G[..., -1:] - G).exp()[..., None] * k
    S = q.new_zeros(B, H, dk, dv)
    outs = []
    for c in range(n):
        U = Ut[:, :, c] - W[:, :, c] @ S
        outs.append(G[:, :, c, :, None].exp() * (q[:, :, c] @ S) + A[:, :, c] @ U)
        S = G[:, :, c, -1, None, None].exp() * S + khat[:, :, c].transpose(-1, -2) @ U
    return torch.stack(outs, 2).reshape(B, H, n * chunk, dv)[:, :, :T]


def recurrent(q, k, v, g, beta):
    B, H, T, dk = q.shape
    S = q.new_zeros(B, H, dk, v.shape[-1])
    outs = []
    for t in range(T):
        S = g[:, :, t, None, None].exp() * S
        u = beta[:, :, t, None] * (v[:, :, t] - (k[:, :, t, :, None] * S).sum(-2))
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, 2)


def inputs(B, H, T, d, grad):
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, H, T, d), dim=-1) / d**0.5
    k = torch.nn.functional.normalize(torch.randn(B, H, T, d), dim=-1)
    v = torch.randn(B, H, T, d)
    g = -0.01 - 0.49 * torch.rand(B, H, T)
    beta = 0.05 + 0.9 * torch.rand(B, H, T)
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    small = inputs(1, 2, 150, 16, False)
    err = (chunked(*small) - recurrent(*small)).abs().max().item()
    assert err < 1e-4, f"chunked against recurrent: {err}"
    runs = int(os.environ.get("RUNS", "5"))
    fwd, both = [], []
    for _ in range(runs):
        x = inputs(1, 16, 2048, 128, True)
        start = time.perf_counter()
        out = chunked(*x)
        mid = time.perf_counter()
        out.backward(torch.ones_like(out))
        end = time.perf_counter()
        fwd.append(mid - start)
        both.append(end - start)
    print(f"torch {torch.__version__}, {args.threads} threads: chunked gated delta rule, "
          f"1 x 16 heads x 2048 x 128, forward {1e3 * statistics.median(fwd):.1f} ms, "
          f"forward+backward {1e3 * statistics.median(both):.1f} ms (median of {runs}; "
          f"check against recurrent {err:.1e})")


if __name__ == "__main__":
    main()
