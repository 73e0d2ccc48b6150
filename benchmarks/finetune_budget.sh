#!/usr/bin/env bash
# The budget against what a fine-tune holds, step by step: LoRA rank 16, bf16, 2 x 256 rows, on
# random models of Qwen2.5-0.5B's and Llama-3.2-1B's shapes (benchmarks/make_model.py), each as
# BF16 and as Q4_K_M (llama.cpp's quantiser), base read in place; every step's anonymous RSS
# against the budget the step line shows. Then the quickstart's run (the mini preset, 30 steps):
# every step's peak RSS against its budget, MINI_RUNS times (default 1) of MINI_STEPS steps
# (default 30). STEPS (default 5) steps a fine-tune; ONLY_MINI=1 runs the mini runs alone; SHAPES
# names other shapes of make_model.py (SHAPES="qwen35-0.8b qwen35-2b").
#   benchmarks/finetune_budget.sh
#   ONLY_MINI=1 MINI_RUNS=10 MINI_STEPS=4 benchmarks/finetune_budget.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/bench_model.sh
steps=${STEPS:-5}
data=build/finetune_bench.jsonl
/usr/bin/python3 benchmarks/bench_data.py "$data"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
deviations() {  # RUN_DIR KEY: the budget and each step's KEY against it
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
gaps = [100 * (r[sys.argv[2]] / r["budget_bytes"] - 1) for r in rows]
print("budget %.1f MiB | %s" % (rows[0]["budget_bytes"] / 2**20, " ".join("%+.1f%%" % g for g in gaps)))
PY
}
shapes=(${SHAPES:-qwen2-0.5b llama3.2-1b})
[[ "${ONLY_MINI:-0}" != 0 ]] && shapes=()
for shape in "${shapes[@]}"; do
  for model in "$(bench_model "$shape")" "$(bench_quantised "$shape" q4_k_m)"; do
    rm -rf "$tmp/run"
    build/cputrain finetune --model "$model" --data "$data" --out "$tmp/run" --ctx 256 --batch 2 \
      --accum 1 --steps "$steps" --lora-rank 16 --dtype bf16 >/dev/null 2>&1
    printf '%-34s %s\n' "$(basename "$model")" "$(deviations "$tmp/run" rss_anon_bytes)"
  done
done
for ((i = 0; i < ${MINI_RUNS:-1}; i++)); do
  rm -rf "$tmp/run"
  build/cputrain --preset mini --steps "${MINI_STEPS:-30}" --out "$tmp/run" >/dev/null 2>&1
  printf '%-34s %s\n' "mini (quickstart), peak RSS" "$(deviations "$tmp/run" peak_rss_bytes)"
done
