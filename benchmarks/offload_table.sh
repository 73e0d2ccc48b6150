#!/usr/bin/env bash
# What full bf16 training of Llama-shaped models needs in RAM, with and without --offload, from
# `cputrain budget` (the real code in its measuring mode: nothing is allocated, nothing trains),
# and whether it fits in 16, 32 and 64 GiB. One sequence of CTX (default 2048) tokens a
# micro-batch, per-layer checkpointing. The disk column is what --offload keeps in files; the
# bandwidth column is what hides the files' traffic (24 bytes a parameter a step: masters, m and
# v read and written) behind a step of TOKENS (default 16384) tokens, and of CTX tokens (one
# micro-batch of one sequence), at PEAK (default 1000) GFLOP/s, 6 FLOPs a parameter a token:
# 24 P / (6 P TOKENS / PEAK) = 4 PEAK / TOKENS, whatever the size.
#   benchmarks/offload_table.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ctx=${CTX:-2048}
tokens=${TOKENS:-16384}
peak=${PEAK:-1000}
corpus=$(mktemp)
trap 'rm -f "$corpus"' EXIT
echo "a corpus of one line" >"$corpus"
# name, then the shape flags (Llama 3.2 1B and 3B, Llama 2 7B and 13B).
shapes=(
  "1B|--d-model 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --tie-embeddings"
  "3B|--d-model 3072 --layers 28 --heads 24 --kv-heads 8 --ffn 8192 --vocab 128256 --tie-embeddings"
  "7B|--d-model 4096 --layers 32 --heads 32 --ffn 11008 --vocab 32000"
  "13B|--d-model 5120 --layers 40 --heads 40 --ffn 13824 --vocab 32000"
)
budget() {
  build/cputrain budget $1 --ctx "$ctx" --batch 1 --accum 1 --dtype bf16 --checkpoint layer \
    --corpus "$corpus" --mem-limit 100000 --json $2
}
field() { python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
gib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 2^30}'; }
fits() { awk -v b="$1" 'BEGIN {printf "%s %s %s", (b <= 16 * 2^30 ? "yes" : "no"), (b <= 32 * 2^30 ? "yes" : "no"), (b <= 64 * 2^30 ? "yes" : "no")}'; }
bandwidth() { awk -v p="$peak" -v t="$1" 'BEGIN {printf "%.0f", 4 * p * 1e9 / t / 1e6}'; }
echo "| shape | parameters | in RAM | fits 16 / 32 / 64 GiB | --offload: in RAM | fits 16 / 32 / 64 GiB | on disk | disk MB/s, $tokens / $ctx tokens a step |"
echo "|---|---|---|---|---|---|---|---|"
for s in "${shapes[@]}"; do
  name=${s%%|*}
  flags=${s#*|}
  plain=$(budget "$flags" "")
  off=$(budget "$flags" "--offload /nonexistent")
  params=$(field parameters <<<"$plain")
  ram=$(field total_bytes <<<"$plain")
  oram=$(field total_bytes <<<"$off")
  disk=$(field disk_bytes <<<"$off")
  printf '| %s | %s | %s GiB | %s | %s GiB | %s | %s GiB | %s / %s |\n' "$name" \
    "$(awk -v p="$params" 'BEGIN {printf "%.2fB", p / 1e9}')" "$(gib "$ram")" \
    "$(fits "$ram" | sed 's/ / \/ /g')" "$(gib "$oram")" "$(fits "$oram" | sed 's/ / \/ /g')" \
    "$(gib "$disk")" "$(bandwidth "$tokens")" "$(bandwidth "$ctx")"
done
