#!/usr/bin/env bash
# GRPO with a reward a program checks, two figures:
#  1. It learns: stories260K (../shared/models) given prompts that name a character (a name and a
#     kind of animal or child, in one of four openings), rewarded 1 where the completion names the
#     character again (`--reward regex --reward-pattern '\b{name}\b'`), 160 prompts to train on and
#     32 held out (names and openings drawn apart from one seed). Validation generates 8 completions
#     of each held-out prompt before the first step and every 20 steps; printed: the held-out mean
#     reward at each, for SEEDS runs. (Held-out prompts are other texts; their names are among the
#     twenty the training prompts have.)
#  2. Its time: a GRPO step of a 0.5B model (Qwen2-0.5B's shape, random BF16 weights, written once
#     to build/qwen2_05b.gguf as benchmarks/batched_generation.sh writes it), LoRA rank 16, one
#     prompt x 8 completions of 32 tokens (`--reward length`: random weights never stop early),
#     the generation and the update of each of STEPS steps; medians printed.
#   benchmarks/grpo_bench.sh        (SEEDS="1 2 3" STEPS=4 THREADS=all cores; PART=learn|time)
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${SEEDS:-1 2 3}
steps=${STEPS:-4}
threads=${THREADS:-$(nproc)}
part=${PART:-all}
shared=${CPUTRAIN_SHARED_MODELS:-../shared/models}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ $part == all || $part == learn ]]; then
  /usr/bin/python3 - "$work" <<'PY'
import json, random, sys
work = sys.argv[1]
rng = random.Random(7)
names = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Tim", "Lucy", "Sam", "Mia", "Jack", "Amy",
         "Bob", "Sara", "Leo", "Kim", "Joe", "Zoe", "Dan", "Ella"]
kinds = ["girl", "boy", "dog", "cat", "bird", "bunny", "bear", "fish"]
openings = ["Once upon a time, there was a little {k} named {n}.",
            "One day, a {k} named {n} went to the park.", "There was a happy {k} called {n}.",
            "{n} was a little {k} who loved to play."]
rows = [{"prompt": o.format(n=n, k=k), "name": n} for n in names for o in openings for k in kinds]
rng.shuffle(rows)
for name, part in (("train", rows[:160]), ("val", rows[160:192])):
    with open(f"{work}/{name}.jsonl", "w") as f:
        for r in part:
            f.write(json.dumps(r) + "\n")
PY
  echo "stories260K, GRPO, reward: the completion names the prompt's character again"
  echo "160 prompts, 32 held out x 8 completions; 100 steps of 2 prompts x 8 completions"
  printf '%-6s %s\n' seed "held-out mean reward at steps 0 20 40 60 80 100"
  for seed in $seeds; do
    build/cputrain finetune --method grpo --model "$shared/stories260K.gguf" \
      --data "$work/train.jsonl" --val "$work/val.jsonl" --reward regex \
      --reward-pattern '\b{name}\b' --generations 8 --batch 16 --accum 1 --ctx 64 \
      --max-completion-length 24 --steps 100 --lr 2e-3 --eval-every 20 --seed "$seed" \
      --threads "$threads" --out "$work/run$seed" >"$work/log$seed" 2>&1 || { cat "$work/log$seed"; exit 1; }
    printf '%-6s %s\n' "$seed" "$(grep -o '"val_reward":[0-9.e-]*' "$work/run$seed/metrics.jsonl" |
      cut -d: -f2 | awk '{printf "%.3f ", $1}')"
  done
fi

if [[ $part == all || $part == time ]]; then
  llamacpp=${CPUTRAIN_LLAMACPP_DIR:-$HOME/.cache/cputrain/llamacpp}
  model=build/qwen2_05b.gguf
  if [[ ! -f $model ]]; then
    /usr/bin/python3 benchmarks/make_model.py "$llamacpp/src/gguf-py" "$model.tmp" 0.5b
    mv "$model.tmp" "$model"
  fi
  for i in $(seq 1 16); do
    printf '{"prompt": "Question %d: what is %d plus %d? Answer:"}\n' "$i" "$i" "$((i + 3))"
  done >"$work/questions.jsonl"
  build/cputrain finetune --method grpo --model "$model" --data "$work/questions.jsonl" \
    --reward length --generations 8 --batch 8 --accum 1 --ctx 128 --max-completion-length 32 \
    --steps "$steps" --threads "$threads" --out "$work/time" >/dev/null 2>&1
  median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
  gen=$(grep -o '"generation_ms":[0-9.e+-]*' "$work/time/metrics.jsonl" | cut -d: -f2)
  upd=$(grep -o '"update_ms":[0-9.e+-]*' "$work/time/metrics.jsonl" | cut -d: -f2)
  printf 'qwen2 0.5B shape, BF16 GGUF, LoRA rank 16, %s threads: a step of 1 prompt x 8 ' "$threads"
  printf 'completions of 32 tokens, median of %s steps\n' "$steps"
  printf '  generation %.0f ms (%s)\n' "$(echo "$gen" | median)" "$(echo $gen | xargs printf '%.0f ')"
  printf '  update     %.0f ms (%s)\n' "$(echo "$upd" | median)" "$(echo $upd | xargs printf '%.0f ')"
fi
