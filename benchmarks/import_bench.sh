#!/usr/bin/env bash
# A 0.5B model from a GGUF file, against llama.cpp on the same file and threads: the time until
# the model is ready to compute, and greedy decoding's tokens/s after the first token. The file is
# Qwen2-0.5B's shape with random BF16 weights (benchmarks/make_model.py, written once to
# build/qwen2_05b.gguf). Runs alternate, cputrain then llama.cpp, RUNS times; medians printed.
#   benchmarks/import_bench.sh            (RUNS=3 TOKENS=64 THREADS=all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
tokens=${TOKENS:-64}
threads=${THREADS:-$(nproc)}
llamacpp=${CPUTRAIN_LLAMACPP_DIR:-$HOME/.cache/cputrain/llamacpp}
model=build/qwen2_05b.gguf
if [[ ! -x build/llama_oracle ]]; then
  echo "import_bench: build/llama_oracle is missing (tools/install_deps.sh --llamacpp, then build)" >&2
  exit 1
fi
if [[ ! -f $model ]]; then
  /usr/bin/python3 benchmarks/make_model.py "$llamacpp/src/gguf-py" "$model.tmp" 0.5b
  mv "$model.tmp" "$model"
fi
ours_load=() ours_rate=() theirs_load=() theirs_rate=()
for ((i = 0; i < runs; i++)); do
  line=$(build/cputrain sample --model "$model" --temperature 0 --max-tokens "$tokens" \
    --threads "$threads" --stats 2>&1 >/dev/null | grep '^loaded')
  ours_load+=("$(sed -E 's/.* in ([0-9.]+) s; prompt.*/\1/' <<<"$line")")
  ours_rate+=("$(sed -E 's/.* at ([0-9.]+) tokens\/s.*/\1/' <<<"$line")")
  read -r load rate < <(build/llama_oracle generate "$model" "$tokens" "$threads" | tail -1)
  theirs_load+=("$load")
  theirs_rate+=("$rate")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
printf 'qwen2 0.5B shape, BF16 GGUF, %s threads, %s tokens, median of %s runs\n' "$threads" "$tokens" "$runs"
printf '%-10s %14s %14s\n' "" "ready (s)" "decode tok/s"
printf '%-10s %14s %14s\n' cputrain "$(median "${ours_load[@]}")" "$(median "${ours_rate[@]}")"
printf '%-10s %14s %14s\n' llama.cpp "$(median "${theirs_load[@]}")" "$(median "${theirs_rate[@]}")"
