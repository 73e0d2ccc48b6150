#!/usr/bin/env bash
# What exporting a fine-tune merged holds: a random-weight SmolLM3-3B of its shape in Q4_K_M
# (benchmarks/make_model.py, llama.cpp's quantiser) fine-tuned STEPS steps with LoRA rank 16 on
# q, k, v, o (bf16, 1 x 512), then exported with the adapter merged as a Q4_K GGUF and as a BF16
# Hugging Face folder, each export RUNS times from a cold page cache. Prints each command's
# median peak resident set (/usr/bin/time's %M) and wall time, beside the model's size in FP32.
#   benchmarks/export_memory_bench.sh   (RUNS=3 STEPS=2 THREADS=all cores)
# SHAPE=qwen3-30b-a3b TYPE=q4_k_m runs it on another of make_model.py's shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
steps=${STEPS:-2}
threads=${THREADS:-$(nproc)}
shape=${SHAPE:-smollm3-3b}
type=${TYPE:-q4_k_m}
source benchmarks/bench_model.sh
model=build/$shape-$type.gguf
if [[ ! -f $model ]]; then
  bench_quantised "$shape" "$type" >/dev/null
  rm -f "build/$shape.gguf"  # the file it was quantised from
fi
data=build/finetune_bench.jsonl
/usr/bin/python3 benchmarks/bench_data.py "$data"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cold() { [[ -w /proc/sys/vm/drop_caches ]] && sync && echo 3 >/proc/sys/vm/drop_caches || true; }
# Runs "$@" from a cold page cache, appending "peak_kib seconds" to $tmp/$name.
measure() {
  local name=$1
  shift
  cold
  /usr/bin/time -o "$tmp/time" -f "%M %e" "$@" >"$tmp/out" 2>&1 || { cat "$tmp/out"; exit 1; }
  cat "$tmp/time" >>"$tmp/$name"
}
measure finetune build/cputrain finetune --model "$model" --data "$data" --out "$tmp/run" \
  --ctx 512 --batch 1 --accum 1 --steps "$steps" --lora-rank 16 --lora-targets q,k,v,o \
  --dtype bf16 --threads "$threads"
for ((i = 0; i < runs; i++)); do
  measure gguf_q4_k build/cputrain export --model "$tmp/run" --merge --type q4_k \
    --out "$tmp/merged.gguf" --overwrite
  measure hf_bf16 build/cputrain export --model "$tmp/run" --merge --type bf16 \
    --out "$tmp/merged_hf" --overwrite
done
params=$(build/cputrain inspect "$model" | grep -o "[0-9]* parameters" | head -1 | cut -d" " -f1)
/usr/bin/python3 - "$tmp" "$params" <<'PY'
import statistics, sys
G = 2 ** 30
print("%-30s %5s %14s %10s" % ("what", "runs", "peak_RSS_GiB", "seconds"))
for name, what in (("finetune", "fine-tune"), ("gguf_q4_k", "export --merge --type q4_k"),
                   ("hf_bf16", "export --merge --type bf16 (HF)")):
    rows = [tuple(map(float, l.split())) for l in open(f"{sys.argv[1]}/{name}")]
    print("%-30s %5d %14.2f %10.0f" % (what, len(rows), statistics.median(r[0] for r in rows) * 1024 / G,
                                       statistics.median(r[1] for r in rows)))
print("%-30s %5s %14.2f" % ("the model in FP32", "", int(sys.argv[2]) * 4 / G))
PY
