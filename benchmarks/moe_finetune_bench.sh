#!/usr/bin/env bash
# A mixture of experts fine-tuned next to a dense model of its active size, in the same run:
# random-weight GGUFs of Qwen3-30B-A3B's shape in Q4_K_M and gpt-oss-20b's in MXFP4 (experts
# MXFP4, the rest Q8_0), and SmolLM3-3B's shape in Q4_K_M (benchmarks/make_model.py, quantised by
# llama.cpp's quantiser: build/llama_oracle quantize), each fine-tuned by cputrain finetune with
# LoRA rank 16 on attention (q, k, v, o), bf16, BATCH x 512 tokens, the base read in place.
# Runs alternate the models, RUNS times, each from a cold page cache; each run's tokens/s is the
# median of its steps after the first two; its memory the peak resident set (anonymous and the model file's pages), against the
# budget the run printed before its first step (anonymous, and with the file's pages).
#   benchmarks/moe_finetune_bench.sh   (RUNS=2 STEPS=5 BATCH=1 THREADS=all cores)
# The models take 19 GB (Qwen3-30B-A3B), 12 GB (gpt-oss-20b) and 1.9 GB on disk, and on the way
# a Q8_0 file of 32 GB that is removed once quantised; MODELS="qwen3-30b-a3b:q4_k_m" runs one.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-2}
steps=${STEPS:-5}
batch=${BATCH:-1}
threads=${THREADS:-$(nproc)}
models=(${MODELS:-qwen3-30b-a3b:q4_k_m gpt-oss-20b:mxfp4_moe smollm3-3b:q4_k_m})
source benchmarks/bench_model.sh
for m in "${models[@]}"; do
  shape=${m%%:*} type=${m##*:}
  if [[ ! -f build/$shape-$type.gguf ]]; then
    bench_quantised "$shape" "$type" >/dev/null
    rm -f "build/$shape.gguf"  # the BF16 or Q8_0 file it was quantised from
  fi
done
data=build/finetune_bench.jsonl
/usr/bin/python3 benchmarks/bench_data.py "$data"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%-24s %9s %11s %11s %11s %11s %8s\n' model tokens/s budget_GiB peak_GiB with_file_GiB \
  peak_GiB vs_budget
for ((i = 0; i < runs; i++)); do
  for m in "${models[@]}"; do
    shape=${m%%:*} type=${m##*:}
    rm -rf "$tmp/run"
    # Each run from a cold page cache (as root): its peak holds the file's pages it read, not
    # those another model's run left behind or evicted.
    [[ -w /proc/sys/vm/drop_caches ]] && sync && echo 3 >/proc/sys/vm/drop_caches
    build/cputrain finetune --model "build/$shape-$type.gguf" --data "$data" --out "$tmp/run" \
      --ctx 512 --batch "$batch" --accum 1 --steps "$steps" --lora-rank 16 \
      --lora-targets q,k,v,o --dtype bf16 --threads "$threads" >"$tmp/out" 2>&1 ||
      { cat "$tmp/out"; exit 1; }
    /usr/bin/python3 - "$tmp/run/metrics.jsonl" "$shape-$type" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
start = next(r for r in rows if "mapped_bytes" in r)
steps = [r for r in rows if "tokens_per_s" in r]
rate = statistics.median(r["tokens_per_s"] for r in steps[2:] or steps)
budget, mapped = steps[0]["budget_bytes"], start["mapped_bytes"]
anon = max(r["rss_anon_bytes"] for r in steps)
peak = max(r["peak_rss_bytes"] for r in steps)
G = 2 ** 30
print("%-24s %9.1f %11.2f %11.2f %11.2f %11.2f %+7.1f%%" % (
    sys.argv[2], rate, budget / G, anon / G, (budget + mapped) / G, peak / G,
    100 * (peak / (budget + mapped) - 1)))
PY
  done
done
echo "budget_GiB: anonymous, as the step line shows it; peak_GiB (first): the most anonymous RSS a"
echo "step line measured; with_file_GiB: the budget with the base's pages;"
echo "peak_GiB (second): the process's peak resident set, file pages included; vs_budget: it"
echo "against with_file"
