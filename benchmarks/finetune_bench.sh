#!/usr/bin/env bash
# LoRA fine-tuning of a small model next to PyTorch, in the same run: cputrain finetune on
# build/SHAPE.gguf (SHAPE qwen2-0.5b, Qwen2.5-0.5B's, qwen3-0.6b, Qwen3-0.6B's, or gemma3-1b; random BF16
# weights, benchmarks/make_model.py) and benchmarks/finetune_torch.py (the same shape, a plain
# LoRA module, PyTorch's fastest
# configuration), both LoRA rank 16 on the seven projections, bf16, batch 4 x 512 tokens, no
# gradient checkpointing. Runs alternate, cputrain then PyTorch, RUNS times; each run's tokens/s
# is the median of its steps after the first two, its memory the peak resident set; medians of
# the runs printed. PROMPT_HALF=1: prompt/completion pairs with about half of each row prompt,
# which carries no target (benchmarks/bench_data.py --prompt-half), instead of texts that are all
# target. TORCH=0 leaves PyTorch out; CPUTRAIN names another build's binary (build/cputrain).
#   benchmarks/finetune_bench.sh            (SHAPE=qwen2-0.5b RUNS=3 STEPS=6 THREADS=all cores)
#   PROMPT_HALF=1 TORCH=0 benchmarks/finetune_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
steps=${STEPS:-6}
threads=${THREADS:-$(nproc)}
shape=${SHAPE:-qwen2-0.5b}
source benchmarks/bench_model.sh
model=$(bench_model "$shape")
cputrain=${CPUTRAIN:-build/cputrain}
if [[ "${PROMPT_HALF:-0}" != 0 ]]; then
  data=build/finetune_bench_half.jsonl
  /usr/bin/python3 benchmarks/bench_data.py --prompt-half "$data"
else
  data=build/finetune_bench.jsonl
  /usr/bin/python3 benchmarks/bench_data.py "$data"
fi
ours_rate=() ours_rss=() theirs_rate=() theirs_rss=()
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for ((i = 0; i < runs; i++)); do
  rm -rf "$tmp/run"
  /usr/bin/time -f '%M' -o "$tmp/rss" "$cputrain" finetune --model "$model" --data "$data" \
    --out "$tmp/run" --ctx 512 --batch 4 --accum 1 --steps "$steps" --lora-rank 16 \
    --dtype bf16 --threads "$threads" >/dev/null 2>&1
  ours_rate+=("$(/usr/bin/python3 -c "
import json, statistics, sys
rates = [json.loads(l)['tokens_per_s'] for l in open(sys.argv[1]) if 'tokens_per_s' in l]
print(statistics.median(rates[2:] or rates))" "$tmp/run/metrics.jsonl")")
  ours_rss+=("$(($(cat "$tmp/rss") * 1024))")
  [[ "${TORCH:-1}" == 0 ]] && continue
  read -r rate rss < <(/usr/bin/python3 benchmarks/finetune_torch.py --shape "$shape" --steps "$steps" \
    --threads "$threads" --json 2>/dev/null | /usr/bin/python3 -c "
import json, sys
r = json.load(sys.stdin)
print(r['tokens_per_s'], r['peak_rss_bytes'])")
  theirs_rate+=("$rate")
  theirs_rss+=("$rss")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
gib() { awk -v b="$1" 'BEGIN {printf "%.2f", b / 2^30}'; }
ours=$(median "${ours_rate[@]}") ours_mem=$(median "${ours_rss[@]}")
printf '%s shape, LoRA r16' "$shape"
printf ' on q,k,v,o,gate,up,down, bf16, batch 4 x 512, %s threads, ' "$threads"
printf 'median of %s runs\n' "$runs"
printf '%-10s %12s %14s\n' "" "tokens/s" "peak RSS GiB"
printf '%-10s %12.0f %14s\n' cputrain "$ours" "$(gib "$ours_mem")"
[[ "${TORCH:-1}" == 0 ]] && exit 0
theirs=$(median "${theirs_rate[@]}") theirs_mem=$(median "${theirs_rss[@]}")
printf '%-10s %12.0f %14s\n' pytorch "$theirs" "$(gib "$theirs_mem")"
awk -v a="$ours" -v b="$theirs" -v m="$ours_mem" -v n="$theirs_mem" \
  'BEGIN {printf "cputrain: %.2fx the tokens/s, %.2fx the memory\n", a / b, m / n}'
