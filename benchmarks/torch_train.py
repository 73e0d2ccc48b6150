#!/usr/bin/python3
"""Trains cputrain's decoder in PyTorch, for the side-by-side throughput comparison.

The same architecture as models/llama.cpp (RMSNorm, RoPE on adjacent pairs, causal attention,
SwiGLU, untied LM head, mean cross-entropy), the same presets, batch, context and vocabulary,
AdamW (0.9, 0.95, weight decay 0.1 on matrices) with global norm clipping at 1. Tokens are
random: throughput does not depend on them. Attention is the plain masked softmax (Debian's
PyTorch 1.13 has no fused attention on the CPU).

    /usr/bin/python3 benchmarks/torch_train.py --preset mega --dtype bf16 [--steps 6]
        [--checkpoint] [--threads N] [--allocator glibc] [--json]

--dtype bf16 is torch.autocast("cpu", dtype=torch.bfloat16) over FP32 weights, PyTorch's
mixed precision on the CPU. Prints tokens/s and ms/step (medians of the steps after the first
two, which are warm-up) and the peak resident set (ru_maxrss).

PyTorch runs in its fastest configuration on this CPU, which the script sets up for its own
process and prints on its first line (stderr):
- BLAS: OpenBLAS built with OpenMP (Debian's libopenblas0-openmp, the same libgomp as PyTorch's
  threads), selected by putting its directory first on LD_LIBRARY_PATH; the line names the
  libblas.so.3 actually mapped. FP32 products run on it (the reference BLAS is about 40x slower).
- threads: torch.set_num_threads(all cores this process may run on) and OMP_NUM_THREADS.
- ATen kernels: ATEN_CPU_CAPABILITY=avx512 where the CPU has AVX-512 (PyTorch 1.13 otherwise
  picks its AVX2 kernels); the line prints the capability in use.
- oneDNN (bf16 products under autocast): AMX where the CPU has it and a bf16 product and its
  gradient on AMX complete correctly in a child process first; otherwise (no AMX, or a probe
  that fails, as oneDNN 2.6's AMX kernels dying on SIGILL would) at most AVX512_CORE_BF16.
  ONEDNN_MAX_CPU_ISA, if set, wins.
- allocator: TCMalloc (Debian's libtcmalloc-minimal4, preloaded), which keeps the memory freed
  (TCMALLOC_RELEASE_RATE=0) for later allocations. With glibc's defaults every block over 32 MiB
  (the attention scores are 128 MiB per layer in mega) is a fresh mmap whose pages the kernel
  faults in and zeroes, and the process spends about as long in the kernel as in PyTorch.
  --allocator glibc keeps glibc and sets it to keep freed memory (more peak RSS, several steps
  to settle), jemalloc preloads libjemalloc2 likewise, system leaves glibc as it is.
Setting these takes environment variables read when the process starts, so the script re-runs
itself once with them. Installed by `tools/install_deps.sh --torch`.
"""
import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PRESETS = {  # vocab, d_model, layers, heads, ffn, ctx, batch (as models/llama_config.cpp)
    "tiny": (512, 64, 2, 4, 192, 64, 4),
    "mini": (16384, 256, 6, 8, 768, 256, 8),
    "mega": (16384, 512, 24, 8, 1536, 1024, 4),
    "behemoth": (16384, 1024, 32, 16, 2816, 1024, 2),
}
EPS = 1e-5
THETA = 10000.0
WARMUP = 2  # steps left out of the medians

LIB = "/usr/lib/x86_64-linux-gnu"
OPENBLAS_DIR = f"{LIB}/openblas-openmp"  # libopenblas0-openmp's libblas.so.3
KEEP = str(4 << 30)  # bytes: glibc's mmap and trim thresholds that keep freed memory
ALLOCATORS = {  # name: (library to preload or None, environment)
    "system": (None, {}),
    "glibc": (None, {"MALLOC_MMAP_THRESHOLD_": KEEP, "MALLOC_TRIM_THRESHOLD_": KEEP,
                     "MALLOC_TOP_PAD_": str(64 << 20), "MALLOC_ARENA_MAX": "1"}),
    "jemalloc": (f"{LIB}/libjemalloc.so.2",
                 {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1,narenas:1"}),
    "tcmalloc": (f"{LIB}/libtcmalloc_minimal.so.4",
                 {"TCMALLOC_RELEASE_RATE": "0",
                  "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}),
}
ONEDNN_CAP = "AVX512_CORE_BF16"
ONEDNN_ISAS = {0x0: "all", 0x1: "SSE41", 0x3: "AVX", 0x7: "AVX2", 0x27: "AVX512_CORE",
               0x67: "AVX512_CORE_VNNI", 0xE7: "AVX512_CORE_BF16", 0x3E7: "AVX512_CORE_AMX",
               0x407: "AVX2_VNNI"}
CONFIGURED = "CPUTRAIN_TORCH_CONFIGURED"  # set in the re-run process

# Run in a child process with ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX: a bf16 linear layer and a
# batched product under autocast, forward and backward, against FP32 on the same bf16 inputs.
AMX_PROBE = r"""
import ctypes, sys, torch
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
if ctypes.CDLL("libdnnl.so.2").dnnl_get_effective_cpu_isa() != 0x3E7:
    sys.exit(3)
x = torch.randn(384, 512).bfloat16().float().requires_grad_()
w = torch.randn(768, 512).bfloat16().float().requires_grad_()
q, k = torch.randn(2, 4, 256, 64).bfloat16().float().unbind(0)
with torch.autocast("cpu", dtype=torch.bfloat16):
    y, s = torch.nn.functional.linear(x, w), q @ k.transpose(-1, -2)
y.float().sum().backward()
for got, want in ((y, x @ w.t()), (s, q @ k.transpose(-1, -2)), (x.grad, w.sum(0).expand_as(x))):
    if ((got.float() - want).norm() / want.norm()).item() > 1e-2:
        sys.exit(4)
"""


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mini", choices=PRESETS)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batch", type=int)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--steps", type=int, default=6,
                    help=f"steps in all; the first {WARMUP} are warm-up, left out of the medians")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="default: all cores this process may run on")
    ap.add_argument("--allocator", default="tcmalloc", choices=ALLOCATORS)
    ap.add_argument("--blas", default="openblas", choices=["openblas", "system"],
                    help="system: whichever libblas.so.3 update-alternatives points at")
    ap.add_argument("--checkpoint", action="store_true", help="per-layer activation checkpointing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.steps < 1 or args.threads < 1:
        ap.error("--steps and --threads must be at least 1")
    return args


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def prepend(env, name, value):
    env[name] = value + (":" + env[name] if env.get(name) else "")


def configure(args, script=None):
    """Re-runs this script (or `script`) with the environment of the fastest configuration, once."""
    if os.environ.get(CONFIGURED):
        return
    env = dict(os.environ)
    notes = []
    if args.blas == "openblas":
        if os.path.exists(f"{OPENBLAS_DIR}/libblas.so.3"):
            prepend(env, "LD_LIBRARY_PATH", OPENBLAS_DIR)
        else:
            notes.append(f"no {OPENBLAS_DIR}/libblas.so.3 (tools/install_deps.sh --torch)")
    library, allocator_env = ALLOCATORS[args.allocator]
    if library and not os.path.exists(library):
        notes.append(f"no {library} (tools/install_deps.sh --torch): glibc as --allocator glibc")
        library, allocator_env = ALLOCATORS["glibc"]
    if library:
        prepend(env, "LD_PRELOAD", library)
    for name, value in allocator_env.items():
        env.setdefault(name, value)
    env["OMP_NUM_THREADS"] = str(args.threads)
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        env.setdefault("ATEN_CPU_CAPABILITY", "avx512")
    if "ONEDNN_MAX_CPU_ISA" not in env and "DNNL_MAX_CPU_ISA" not in env:
        env["ONEDNN_MAX_CPU_ISA"] = ONEDNN_CAP
        if {"amx_bf16", "amx_tile"} <= flags:
            probe = subprocess.run([sys.executable, "-c", AMX_PROBE, str(args.threads)],
                                   env={**env, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if probe.returncode == 0:
                env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_AMX"
            else:
                status = (f"signal {-probe.returncode}" if probe.returncode < 0
                          else f"exit {probe.returncode}")
                notes.append(f"oneDNN's AMX bf16 probe failed ({status}), kept to {ONEDNN_CAP}")
    env[CONFIGURED] = "; ".join(notes) or "1"
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, script or os.path.abspath(__file__)] + sys.argv[1:],
              env)


if __name__ == "__main__":
    ARGS = parse_args()
    configure(ARGS)

import torch  # noqa: E402 (after configure(): the environment must be set before the import)
import torch.utils.checkpoint  # noqa: E402


def mapped(*names):
    """Paths of the mapped files of this process whose names start with one of names."""
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(None, 5)[-1].strip()
            if path.startswith("/") and os.path.basename(path).startswith(names) \
                    and path not in paths:
                paths.append(path)
    return paths


def configuration(args):
    """One line: what PyTorch runs on in this process, read back from the process itself."""
    a = torch.randn(64, 64)
    a @ a  # FP32 product: the BLAS
    blas = sorted(mapped("libblas.so", "libopenblas"), key=lambda p: "libblas.so" not in p)
    blas_text = " + ".join(blas) or "none mapped"
    openblas = [p for p in blas if os.path.basename(p).startswith("libopenblas")]
    try:
        get_config = ctypes.CDLL(openblas[0]).openblas_get_config
        get_config.restype = ctypes.c_char_p
        blas_text += f" ({get_config().decode()})"
    except (IndexError, OSError, AttributeError):
        pass
    capability = next((line.split(":", 1)[1].strip()
                        for line in torch.__config__.show().splitlines()
                        if "CPU capability usage" in line), "?")
    try:
        isa = ctypes.CDLL("libdnnl.so.2").dnnl_get_effective_cpu_isa()
        onednn = ONEDNN_ISAS.get(isa, hex(isa))
    except (OSError, AttributeError):
        onednn = "?"
    allocator_env = ALLOCATORS[args.allocator][1]
    preloaded = mapped("libjemalloc", "libtcmalloc")
    allocator = " + ".join(preloaded) if preloaded else "glibc"
    names = set(allocator_env) | set(ALLOCATORS["glibc"][1]) | {"MALLOC_CONF", "GLIBC_TUNABLES"}
    settings = [f"{n}={os.environ[n]}" for n in sorted(names) if n in os.environ]
    if settings:
        allocator += " " + " ".join(settings)
    notes = os.environ.get(CONFIGURED, "")
    return (f"pytorch {torch.__version__}: BLAS {blas_text}; threads {torch.get_num_threads()} "
            f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); "
            f"ATen capability {capability}; oneDNN ISA {onednn} "
            f"(ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}); "
            f"allocator {allocator}" + (f"; note: {notes}" if notes not in ("", "1") else ""))


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
        # 1/sqrt(D) scales q (T x D per head) rather than the T x T scores
        q = (rope(self.wq(h).view(B, T, H, D), cos, sin) * D ** -0.5).transpose(1, 2)
        k = rope(self.wk(h).view(B, T, H, D), cos, sin).transpose(1, 2)
        v = self.wv(h).view(B, T, H, D).transpose(1, 2)
        # the product's output is not needed by its backward, so the mask fills it in place
        scores = (q @ k.transpose(-1, -2)).float().masked_fill_(mask, float("-inf"))
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
        # built once: the tables and the causal mask are buffers, not rebuilt per step
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


def main(args):
    vocab, d, layers, heads, ffn, ctx, batch = PRESETS[args.preset]
    batch, ctx = args.batch or batch, args.ctx or ctx
    torch.set_num_threads(args.threads)
    config = configuration(args)
    print(config, file=sys.stderr, flush=True)
    torch.manual_seed(0)
    model = Model(vocab, d, layers, heads, ffn, ctx, args.checkpoint)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (batch, ctx + 1), generator=gen)
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        times.append(elapsed)
        print(f"step {step} loss {losses[-1]:.4f} {elapsed * 1000:.0f} ms (CPU user "
              f"{after.ru_utime - before.ru_utime:.1f} s, "
              f"sys {after.ru_stime - before.ru_stime:.1f} s, "
              f"{after.ru_minflt - before.ru_minflt} page faults)"
              f"{' warm-up' if step < WARMUP and args.steps > WARMUP else ''}", file=sys.stderr)
    # with no more steps than the warm-up, the last step stands for them
    measured = times[WARMUP:] or times[-1:]
    ms = statistics.median(measured) * 1000
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "impl": "pytorch", "torch": torch.__version__, "preset": args.preset,
        "dtype": args.dtype, "checkpoint": args.checkpoint, "batch": batch, "ctx": ctx,
        "threads": args.threads, "ms_per_step": ms, "tokens_per_s": batch * ctx / (ms / 1000),
        "step_ms": [t * 1000 for t in times], "measured_steps": len(measured),
        "peak_rss_bytes": usage.ru_maxrss * 1024, "final_loss": losses[-1],
        "user_s": usage.ru_utime, "sys_s": usage.ru_stime, "minor_faults": usage.ru_minflt,
        "configuration": config,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"pytorch {torch.__version__} {args.preset} {args.dtype} batch {batch} x {ctx}"
              f"{' checkpoint' if args.checkpoint else ''}: {result['tokens_per_s']:.0f} tokens/s, "
              f"{ms:.0f} ms/step (median of {len(measured)}), peak RSS "
              f"{result['peak_rss_bytes'] / 2**30:.2f} GiB; user {usage.ru_utime:.0f} s, "
              f"sys {usage.ru_stime:.0f} s, {usage.ru_minflt} minor page faults")


if __name__ == "__main__":
    main(ARGS)
