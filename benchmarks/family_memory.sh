#!/usr/bin/env bash
# The memory budget of a LoRA fine-tune of each architecture family at a published model's shape
# (random BF16 weights, benchmarks/make_model.py, written once to build/SHAPE.gguf) against the
# memory measured while it runs: `cputrain finetune` for STEPS steps (LoRA r16 on the seven
# projections, bf16, BATCH x CTX, no checkpointing), its base read in place from the file, so
# the budget stands for the anonymous part of the resident set. One Markdown row per shape:
# the budget, the largest anonymous RSS of the steps, the gap, the file's pages resident and the
# median tokens/s of the steps after the first.
#   benchmarks/family_memory.sh [SHAPE...]   (default: qwen3-0.6b llama3.2-1b smollm3-3b
#                                             phi4-mini; STEPS=3 BATCH=2 CTX=512)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-3}
batch=${BATCH:-2}
ctx=${CTX:-512}
llamacpp=${CPUTRAIN_LLAMACPP_DIR:-$HOME/.cache/cputrain/llamacpp}
shapes=("$@")
[[ ${#shapes[@]} -gt 0 ]] || shapes=(qwen3-0.6b llama3.2-1b smollm3-3b phi4-mini)
data=build/family_memory.jsonl
/usr/bin/python3 benchmarks/bench_data.py "$data"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| shape | parameters | batch x ctx | budget | anonymous RSS (largest) | gap | file resident | tokens/s |"
echo "|---|---|---|---|---|---|---|---|"
for shape in "${shapes[@]}"; do
  model=build/$shape.gguf
  if [[ ! -f $model ]]; then
    /usr/bin/python3 benchmarks/make_model.py "$llamacpp/src/gguf-py" "$model.tmp" "$shape"
    mv "$model.tmp" "$model"
  fi
  rm -rf "$tmp/run"
  build/cputrain finetune --model "$model" --data "$data" --out "$tmp/run" --ctx "$ctx" \
    --batch "$batch" --accum 1 --steps "$steps" --lora-rank 16 --dtype bf16 --val-fraction 0 \
    >"$tmp/log" 2>&1 || { echo "| $shape | failed: $(tail -1 "$tmp/log") |"; continue; }
  params=$(build/cputrain inspect "$model" --json | /usr/bin/python3 -c \
    "import json, sys; print(json.load(sys.stdin)['config']['parameters'])")
  /usr/bin/python3 - "$tmp/run/metrics.jsonl" "$shape" "$params" "$batch x $ctx" <<'EOF'
import json, statistics, sys
path, shape, params, size = sys.argv[1:]
rows = [json.loads(line) for line in open(path) if '"tokens_per_s"' in line]
gib = lambda b: b / 2**30
budget = rows[-1]["budget_bytes"]
anon = max(r["rss_anon_bytes"] for r in rows)
files = max(r["rss_file_bytes"] for r in rows)
tps = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
print(f"| {shape} | {int(params) / 1e9:.2f}B | {size} | {gib(budget):.2f} GiB | {gib(anon):.2f} GiB "
      f"| {100 * (anon / budget - 1):+.1f}% | {gib(files):.2f} GiB | {tps:.0f} |")
EOF
done
