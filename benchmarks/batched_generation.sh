#!/usr/bin/env bash
# Batched generation against one sequence at a time: `cputrain sample --n 8` (eight continuations
# decoded together, each projection one GEMM over their rows) and `--n 1`, on a 0.5B model
# (Qwen2-0.5B's shape, random BF16 weights: benchmarks/make_model.py, written once to
# build/qwen2_05b.gguf), sampling at temperature 0.8 from BOS. The rate is every sequence's tokens
# after the first over the time after it. Runs alternate, one then eight, RUNS times; medians and
# the ratio of the medians printed.
#   benchmarks/batched_generation.sh      (RUNS=3 TOKENS=64 N=8 THREADS=all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
tokens=${TOKENS:-64}
n=${N:-8}
threads=${THREADS:-$(nproc)}
llamacpp=${CPUTRAIN_LLAMACPP_DIR:-$HOME/.cache/cputrain/llamacpp}
model=build/qwen2_05b.gguf
if [[ ! -f $model ]]; then
  /usr/bin/python3 benchmarks/make_model.py "$llamacpp/src/gguf-py" "$model.tmp" 0.5b
  mv "$model.tmp" "$model"
fi
rate() {
  build/cputrain sample --model "$model" --n "$1" --max-tokens "$tokens" --threads "$threads" \
    --stats 2>&1 >/dev/null | grep '^loaded' | sed -E 's/.* at ([0-9.]+) tokens\/s.*/\1/'
}
one=() many=()
for ((i = 0; i < runs; i++)); do
  one+=("$(rate 1)")
  many+=("$(rate "$n")")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
m1=$(median "${one[@]}") mn=$(median "${many[@]}")
printf 'qwen2 0.5B shape, BF16 GGUF, %s threads, %s tokens a sequence, median of %s runs\n' \
  "$threads" "$tokens" "$runs"
printf '%-12s %14s   %s\n' "sequences" "tokens/s" "runs"
printf '%-12s %14s   %s\n' 1 "$m1" "${one[*]}"
printf '%-12s %14s   %s\n' "$n" "$mn" "${many[*]}"
awk -v a="$m1" -v b="$mn" 'BEGIN {printf "ratio %.2f\n", b / a}'
