#!/usr/bin/env bash
# Training throughput, cputrain next to PyTorch, in one run on one machine. Each argument is
# "<preset> <dtype>" (dtype fp32 or bf16); default: mini and mega in both. For each, cputrain
# trains STEPS steps (default 6; batch, ctx as the preset, accumulation 1, no checkpointing) and
# benchmarks/torch_train.py the same architecture with the same batch, ctx and vocabulary, in
# PyTorch's fastest configuration here, which it prints (TORCH_STEPS steps, default 6, the first
# two warm-up; TORCH=0 skips it). Prints one
# Markdown row per run: tokens/s and ms/step (medians of the steps after the first), MFU, peak
# RSS, and ours / PyTorch. MFU = tokens/s x FLOPs per token over the peak of that dtype measured
# here by bench_gemm first (bf16: AMX tdpbf16ps where the CPU has AMX, else vdpbf16ps); FLOPs per
# token = 6 x matrix parameters + 6 x layers x ctx x d_model (causal attention, forward and
# backward).
#   benchmarks/train_bench.sh                       # all four
#   benchmarks/train_bench.sh "mega bf16"
#   benchmarks/train_bench.sh --json "mini bf16"    # a JSON array of one object per run instead
# Needs build/ (tools/build.sh) and, for PyTorch, tools/install_deps.sh --torch.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-6}
torch_steps=${TORCH_STEPS:-6}
dir=${CPUTRAIN_BENCH_DIR:-runs/train_bench}
mkdir -p "$dir"
format=markdown
if [[ "${1:-}" == "--json" ]]; then
  format=json
  shift
fi
[[ $# -gt 0 ]] || set -- "mini fp32" "mini bf16" "mega fp32" "mega bf16"
peak_line=$(build/bench_gemm --benchmark_filter='^$' 2>/dev/null | grep 'peak GFLOP/s' || true)
machine="$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
if [[ $format == markdown ]]; then
  echo "machine: $machine; $peak_line"
  echo
  echo "| preset | dtype | batch x ctx | cputrain tokens/s | ms/step | MFU | peak RSS | PyTorch tokens/s | ms/step | MFU | peak RSS | tokens/s ratio | RSS ratio |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
else
  echo "["
fi
separator=""
for row in "$@"; do
  read -r preset dtype <<<"$row"
  run="$dir/run"  # the run directory, each row's --overwrite of the one before; logs beside it
  log="$dir/$preset-$dtype"
  build/cputrain --preset "$preset" --dtype "$dtype" --checkpoint none --accum 1 --steps "$steps" \
    --eval-windows 1 --sample-tokens 1 --save-every 0 --overwrite --out "$run" >"$log.log" 2>&1 ||
    { echo "cputrain $preset $dtype failed: $(tail -1 "$log.log")" >&2; continue; }
  torch_json="{}"
  if [[ "${TORCH:-1}" != 0 ]]; then
    torch_json=$(/usr/bin/python3 benchmarks/torch_train.py --preset "$preset" --dtype "$dtype" \
                   --steps "$torch_steps" --threads "$(nproc)" --json 2>"$log.torch.log") ||
      torch_json="{}"
  fi
  [[ $format == json ]] && printf '%s' "$separator"
  separator=","
  python3 - "$run/metrics.jsonl" "$run/config.json" "$preset" "$dtype" "$peak_line" "$torch_json" \
    "$format" "$machine" <<'EOF'
import json, re, statistics, sys
metrics, config_path, preset, dtype, peak_line, torch_json, fmt, machine = sys.argv[1:]
rows = [json.loads(line) for line in open(metrics)]
config = json.load(open(config_path))
model, train = config["model"], config["train"]
d, layers, ffn, vocab = model["d_model"], model["n_layers"], model["ffn"], model["vocab"]
ctx, batch = train["ctx"], train["batch"]
flops_per_token = 6 * (layers * (4 * d * d + 3 * d * ffn) + vocab * d) + 6 * layers * ctx * d
m = re.search(r"f32 ([0-9.]+).*bf16 ([0-9.]+).*amx ([0-9.]+)", peak_line)
bf16_peak = (float(m.group(3)) or float(m.group(2))) if m else 0.0  # AMX where present
peak = (bf16_peak if dtype == "bf16" else float(m.group(1))) * 1e9 if m else 0.0
gib = lambda b: b / 2**30
mfu = lambda tps: f"{100 * tps * flops_per_token / peak:.0f}%" if peak and tps else "-"
later = rows[1:] or rows
tps = statistics.median(r["tokens_per_s"] for r in later)
ms = statistics.median(r["ms"] for r in later)
rss = max(r["peak_rss_bytes"] for r in rows)
t = json.loads(torch_json)
if fmt == "json":
    mfu_of = lambda tps: tps * flops_per_token / peak if peak and tps else None
    out = {"preset": preset, "dtype": dtype, "batch": batch, "ctx": ctx, "machine": machine,
           "peak_gflops": peak / 1e9 if peak else None, "tokens_per_s": tps, "ms_per_step": ms,
           "mfu": mfu_of(tps), "peak_rss_bytes": rss, "torch": None}
    if t:
        out["torch"] = {"tokens_per_s": t["tokens_per_s"], "ms_per_step": t["ms_per_step"],
                        "mfu": mfu_of(t["tokens_per_s"]), "peak_rss_bytes": t["peak_rss_bytes"],
                        "tokens_per_s_ratio": tps / t["tokens_per_s"],
                        "rss_ratio": rss / t["peak_rss_bytes"]}
    print(json.dumps(out))
elif t:
    print(f"| {preset} | {dtype} | {batch} x {ctx} | {tps:.0f} | {ms:.0f} | {mfu(tps)} | {gib(rss):.2f} GiB "
          f"| {t['tokens_per_s']:.0f} | {t['ms_per_step']:.0f} | {mfu(t['tokens_per_s'])} "
          f"| {gib(t['peak_rss_bytes']):.2f} GiB | {tps / t['tokens_per_s']:.2f} | {rss / t['peak_rss_bytes']:.2f} |")
else:
    print(f"| {preset} | {dtype} | {batch} x {ctx} | {tps:.0f} | {ms:.0f} | {mfu(tps)} | {gib(rss):.2f} GiB "
          f"| - | - | - | - | - | - |")
EOF
done
if [[ $format == json ]]; then
  echo "]"
elif [[ "${TORCH:-1}" != 0 ]]; then
  echo
  echo "PyTorch configuration: $(head -1 "$dir/$(echo "$1" | tr ' ' '-').torch.log")"
fi
exit 0
