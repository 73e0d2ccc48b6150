#!/usr/bin/env bash
# Training beside another job on the same cores. PRESET (mega) in bf16, THREADS (all cores)
# threads, accumulation 1, trains STEPS (5) steps alone, then two such trainings start together;
# RUNS (2) rounds, alone then together. A run's tokens/s is the median of its steps after the
# first; printed per round, with each of the pair's against the round's alone.
# Where a waiting thread held its core, each of the pair would get a small fraction of its
# tokens/s alone; where it sleeps, each gets near half, and the pair near all.
#   benchmarks/contention.sh       (RUNS=2 STEPS=5 PRESET=mega THREADS=$(nproc),
#                                   CPUTRAIN=build/cputrain)
# Data parallelism over the same cores: benchmarks/data_parallel.sh (PRESET=mini).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-2}
steps=${STEPS:-5}
preset=${PRESET:-mega}
threads=${THREADS:-$(nproc)}
cputrain=${CPUTRAIN:-build/cputrain}
[[ -x $cputrain ]] || { echo "contention.sh: $cputrain: not built (tools/build.sh)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
args=(--preset "$preset" --dtype bf16 --threads "$threads" --accum 1 --checkpoint none
  --eval-every 1000000 --eval-windows 1 --sample-tokens 0 --save-every 0
  --overwrite)
# The tokenizer and token cache, made once and shared by every run.
"$cputrain" "${args[@]}" --steps 1 --out "$out/setup" >/dev/null 2>&1 ||
  { echo "contention.sh: the set-up run failed" >&2; exit 1; }

rate() {
  python3 - "$1/metrics.jsonl" <<'EOF'
import json, statistics, sys
rates = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if '"loss"' in l]
print(statistics.median(rates[1:] or rates))
EOF
}
train() {
  cp -r "$out/setup" "$out/$1" &&
    "$cputrain" "${args[@]}" --steps "$steps" --out "$out/$1" >"$out/$1.log" 2>&1
}

echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $preset bf16, $threads threads each"
echo "| round | alone tokens/s | first of two | second of two | first / alone | second / alone | pair / alone |"
echo "|---|---|---|---|---|---|---|"
for ((i = 1; i <= runs; i++)); do
  train alone
  train first &
  train second
  wait
  read -r line < <(python3 - "$(rate "$out/alone")" "$(rate "$out/first")" "$(rate "$out/second")" "$i" <<'EOF'
import sys
alone, a, b, i = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
print(f"| {i} | {alone:.0f} | {a:.0f} | {b:.0f} | {a / alone:.2f} | {b / alone:.2f} | {(a + b) / alone:.2f} |")
EOF
)
  echo "$line"
  rm -rf "$out/alone" "$out/first" "$out/second"
done
