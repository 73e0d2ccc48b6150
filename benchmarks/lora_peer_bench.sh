#!/usr/bin/env bash
# LoRA fine-tuning over the same Q8_0 and Q4_0 files next to qvac-fabric-llm.cpp's
# llama-finetune-lora (a llama.cpp fork that trains LoRA over quantised bases), in the same run.
# Build the peer from its public source first and give its binary as QVAC:
#   cmake -S qvac-fabric-llm.cpp -B qvac-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
#     -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
#   cmake --build qvac-build --target llama-finetune-lora -j
#   QVAC=qvac-build/bin/llama-finetune-lora benchmarks/lora_peer_bench.sh
# The model is build/SHAPE-TYPE.gguf (benchmarks/bench_model.sh makes it); the text is
# bench_data.py's, as plain text for the peer (windows of 512 tokens every 256: about 5 steps)
# and as JSON Lines for cputrain. Both: LoRA rank 16, alpha 32, the seven projections, 512-token
# windows, THREADS threads. The peer takes one window a step and computes in f32 (its
# activations quantised to 8 bits for the products over the quantised base); cputrain is run at
# one window a step (batch 1) and at its default four, in bf16. tokens/s: the peer's windows
# times 512 over its training time; cputrain's the median of its steps after the first two.
# Memory: each process's peak resident set.
#   QVAC=... benchmarks/lora_peer_bench.sh      (SHAPE=qwen2-0.5b THREADS=2 STEPS=5)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${QVAC:?give the path of llama-finetune-lora as QVAC}"
threads=${THREADS:-2}
steps=${STEPS:-5}
shape=${SHAPE:-qwen2-0.5b}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 benchmarks/bench_data.py "$tmp/data.jsonl"
# About 2,100 tokens of the same texts: 6 windows, 5 of them trained.
/usr/bin/python3 -c "
import json, sys
texts = [json.loads(l)['text'] for l in open(sys.argv[1])]
open(sys.argv[2], 'w').write(' '.join(texts)[:11000])" "$tmp/data.jsonl" "$tmp/data.txt"
printf '%-8s %-28s %10s %14s\n' base program tokens/s peak_rss_GiB
source benchmarks/bench_model.sh
for type in q8_0 q4_0; do
  model=$(bench_quantised "$shape" "$type")
  /usr/bin/time -f '%M' -o "$tmp/rss" "$QVAC" -m "$model" -f "$tmp/data.txt" -c 512 -b 512 \
    -ub 512 -t "$threads" -fa off -nr --lora-rank 16 --lora-alpha 32 \
    --lora-modules attn_q,attn_k,attn_v,attn_o,ffn_gate,ffn_up,ffn_down --num-epochs 1 \
    --learning-rate 1e-4 --checkpoint-save-steps 0 --output-adapter "$tmp/peer.gguf" \
    >"$tmp/peer.log" 2>&1
  rate=$(tr '\r' '\n' <"$tmp/peer.log" | /usr/bin/python3 -c "
import re, sys
last = [l for l in sys.stdin if l.startswith('train:')][-1]
done = int(re.search(r'data=(\d+)/', last).group(1))
h, m, s = map(int, re.search(r't=(\d+):(\d+):(\d+)', last).groups())
print(done * 512 / (3600 * h + 60 * m + s))")
  printf '%-8s %-28s %10.1f %14.2f\n' "$type" llama-finetune-lora "$rate" \
    "$(/usr/bin/python3 -c "print($(cat "$tmp/rss") * 1024 / 2**30)")"
  for batch in 1 4; do
    rm -rf "$tmp/run"
    /usr/bin/time -f '%M' -o "$tmp/rss" build/cputrain finetune --model "$model" \
      --data "$tmp/data.jsonl" --out "$tmp/run" --ctx 512 --batch "$batch" --accum 1 \
      --steps "$steps" --lora-rank 16 --dtype bf16 --threads "$threads" >/dev/null 2>&1
    rate=$(/usr/bin/python3 -c "
import json, statistics, sys
r = [json.loads(l)['tokens_per_s'] for l in open(sys.argv[1]) if 'tokens_per_s' in l]
print(statistics.median(r[2:] or r))" "$tmp/run/metrics.jsonl")
    printf '%-8s %-28s %10.1f %14.2f\n' "$type" "cputrain finetune, batch $batch" "$rate" \
      "$(/usr/bin/python3 -c "print($(cat "$tmp/rss") * 1024 / 2**30)")"
  done
done
