#!/usr/bin/env bash
# LoRA fine-tuning over a quantised base next to the same model over its BF16 file, in the same
# run: build/SHAPE.gguf (random BF16 weights, benchmarks/make_model.py) and its Q8_0 and Q4_K_M
# quantisations by llama.cpp's own quantiser (build/llama_oracle quantize), each fine-tuned by
# cputrain finetune with LoRA rank 16 on the seven projections, bf16, BATCH x 512 tokens, no
# gradient checkpointing. Runs alternate bf16, q8_0, q4_k_m, RUNS times; each run's tokens/s is
# the median of its steps after the first two, its memory the peak resident set (anonymous and
# the model file's pages); medians of the runs printed, with the ratio to bf16.
#   benchmarks/quant_finetune_bench.sh   (SHAPE=qwen2-0.5b RUNS=3 STEPS=6 BATCH=4 THREADS=all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
steps=${STEPS:-6}
batch=${BATCH:-4}
threads=${THREADS:-$(nproc)}
shape=${SHAPE:-qwen2-0.5b}
source benchmarks/bench_model.sh
model=$(bench_model "$shape")
for type in q8_0 q4_k_m; do bench_quantised "$shape" "$type" >/dev/null; done
data=build/finetune_bench.jsonl
/usr/bin/python3 benchmarks/bench_data.py "$data"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
declare -A rates rss
for ((i = 0; i < runs; i++)); do
  for type in bf16 q8_0 q4_k_m; do
    file=$model
    [[ $type != bf16 ]] && file=build/$shape-$type.gguf
    rm -rf "$tmp/run"
    /usr/bin/time -f '%M' -o "$tmp/rss" build/cputrain finetune --model "$file" --data "$data" \
      --out "$tmp/run" --ctx 512 --batch "$batch" --accum 1 --steps "$steps" --lora-rank 16 \
      --dtype bf16 --threads "$threads" >/dev/null 2>&1
    rates[$type]+="$(/usr/bin/python3 -c "
import json, statistics, sys
r = [json.loads(l)['tokens_per_s'] for l in open(sys.argv[1]) if 'tokens_per_s' in l]
print(statistics.median(r[2:] or r))" "$tmp/run/metrics.jsonl") "
    rss[$type]+="$(($(cat "$tmp/rss") * 1024)) "
  done
done
median() { /usr/bin/python3 -c "import statistics, sys; print(statistics.median(map(float, sys.argv[1:])))" "$@"; }
base=$(median ${rates[bf16]})
echo "$shape, LoRA r16, bf16, batch $batch x 512, $threads threads, $runs runs (medians)"
printf '%-8s %12s %10s %14s   %s\n' base tokens/s vs_bf16 peak_rss_GiB "runs' tokens/s"
for type in bf16 q8_0 q4_k_m; do
  r=$(median ${rates[$type]})
  m=$(median ${rss[$type]})
  printf '%-8s %12.1f %10.2f %14.2f   %s\n' "$type" "$r" "$(/usr/bin/python3 -c "print($r / $base)")" \
    "$(/usr/bin/python3 -c "print($m / 2**30)")" "${rates[$type]}"
done
