#!/usr/bin/env bash
# Trains a few steps of each configuration given as arguments and prints one Markdown row per
# run: the analytic budget against the measured peak RSS, the activations budgeted and
# measured, and tokens/s. Each argument is "<preset> <dtype> <checkpoint> <batch>", e.g.
#   benchmarks/memory_table.sh "mini fp32 none 8" "mega bf16 layer 4"
# Runs share one run directory (CPUTRAIN_MEMORY_DIR, default runs/memory) so the tokenizer and
# token cache of the corpus are made once. STEPS (default 3) steps each, accumulation 1, ctx
# as the preset; tokens/s is the median of the steps after the first. EXTRA adds flags to every
# run (e.g. EXTRA="--save-every 0" to skip the per-step checkpoints of a short run).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${CPUTRAIN_MEMORY_DIR:-runs/memory}
steps=${STEPS:-3}
echo "| preset | dtype | checkpoint | batch x ctx | budget | peak RSS | gap | activations budget | activations measured | tokens/s | command |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for row in "$@"; do
  read -r preset dtype checkpoint batch <<<"$row"
  cmd="build/cputrain --preset $preset --dtype $dtype --checkpoint $checkpoint --batch $batch --accum 1 --steps $steps --eval-windows 1 --sample-tokens 1 --overwrite --out $dir${EXTRA:+ $EXTRA}"
  if ! $cmd >"$dir.log" 2>&1; then
    echo "| $preset | $dtype | $checkpoint | $batch | failed: $(tail -1 "$dir.log") | | | | | | \`$cmd\` |"
    continue
  fi
  python3 - "$dir/metrics.jsonl" "$preset" "$dtype" "$checkpoint" "$batch" "$cmd" <<'EOF'
import json, statistics, sys
path, preset, dtype, checkpoint, batch, cmd = sys.argv[1:]
rows = [json.loads(line) for line in open(path)]
gib = lambda b: b / 2**30
budget = rows[-1]["budget_bytes"]
rss = max(r["peak_rss_bytes"] for r in rows)
act_budget = rows[-1]["activations_budget_bytes"]
act = max(r["activations_peak_bytes"] for r in rows)
tps = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
ctx = round(rows[0]["tokens_per_s"] * rows[0]["ms"] / 1000 / int(batch))
print(f"| {preset} | {dtype} | {checkpoint} | {batch} x {ctx} | {gib(budget):.2f} GiB | {gib(rss):.2f} GiB "
      f"| {100 * (rss / budget - 1):+.1f}% | {gib(act_budget):.2f} GiB | {gib(act):.2f} GiB | {tps:.0f} | `{cmd}` |")
EOF
done
