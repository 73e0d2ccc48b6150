#!/usr/bin/env bash
# A preference step against a fine-tuning step of the same rows, in the same run: cputrain
# finetune --method METHOD (dpo or orpo) on 64 pairs of a 100-word prompt and two 150-word
# completions (benchmarks/bench_data.py --pairs: a pair a row of 512), and cputrain finetune on the
# same pairs as two prompt/completion examples each (--pairs-as-sft: the same lengths and
# targets), on build/SHAPE.gguf (random BF16 weights, benchmarks/make_model.py), LoRA rank 16 on
# the seven projections, bf16, batch 4 x 512, no checkpointing. Runs alternate, the fine-tune
# first, RUNS times; each run's tokens/s (positions a second) is the median of its steps after the
# first two, and the memory its steps held is compared with its budget; DPO's reference pass
# before the first step is timed from its log. Prints each pair's ratio and the medians.
#   benchmarks/preference_bench.sh          (SHAPE=qwen2-0.5b METHOD=dpo RUNS=3 STEPS=6)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
steps=${STEPS:-6}
method=${METHOD:-dpo}
threads=${THREADS:-$(nproc)}
shape=${SHAPE:-qwen2-0.5b}
source benchmarks/bench_model.sh
model=$(bench_model "$shape")
cputrain=${CPUTRAIN:-build/cputrain}
/usr/bin/python3 benchmarks/bench_data.py --pairs build/preference_bench.jsonl
/usr/bin/python3 benchmarks/bench_data.py --pairs-as-sft build/preference_bench_sft.jsonl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# One run: "tokens/s resident budget reference_s": the resident memory (bytes) the step lines
# compare with the budget, the most of any step (the anonymous part where the base is read in
# place, as the budget leaves its mapped file apart); DPO's reference pass before the first step,
# in seconds, from its log line (0 where there is none).
one() {
  rm -rf "$tmp/run"
  "$cputrain" finetune --model "$model" --out "$tmp/run" --ctx 512 --batch 4 --accum 1 \
    --steps "$steps" --lora-rank 16 --dtype bf16 --threads "$threads" "$@" >/dev/null 2>&1
  /usr/bin/python3 -c "
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if 'tokens_per_s' in l]
rates = [l['tokens_per_s'] for l in lines]
held = max(l['rss_anon_bytes'] if l['mapped_bytes'] > 0 else l['peak_rss_bytes'] for l in lines)
ref = [l for l in open(sys.argv[2]) if 'reference: the log-probabilities of' in l]
seconds = ref[0].split(' s; ')[0].rsplit(', ', 1)[1] if ref else 0
print(statistics.median(rates[2:] or rates), held, lines[-1]['budget_bytes'], seconds)" \
    "$tmp/run/metrics.jsonl" "$tmp/run/train.log"
}
sft=() pref=() ratios=()
printf '%s, LoRA r16, bf16, batch 4 x 512, %s threads: finetune vs --method %s\n' \
  "$shape" "$threads" "$method"
printf '%-6s %10s %12s %7s %14s %12s %14s\n' run "sft tok/s" "$method tok/s" ratio \
  "$method RSS GiB" "budget GiB" "reference s"
for ((i = 0; i < runs; i++)); do
  read -r a _ _ _ < <(one --data build/preference_bench_sft.jsonl)
  read -r b rss budget reference < <(one --method "$method" --data build/preference_bench.jsonl)
  sft+=("$a") pref+=("$b")
  ratio=$(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.3f", b / a}')
  ratios+=("$ratio")
  printf '%-6s %10.0f %12.0f %7s %14.3f %12.3f %14s\n' "$((i + 1))" "$a" "$b" "$ratio" \
    "$(awk -v x="$rss" 'BEGIN {print x / 2^30}')" "$(awk -v x="$budget" 'BEGIN {print x / 2^30}')" \
    "$reference"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
printf '%-6s %10.0f %12.0f %7s\n' median "$(median "${sft[@]}")" "$(median "${pref[@]}")" \
  "$(median "${ratios[@]}")"
