#!/usr/bin/env bash
# Training in less memory than the run's data: each run in turn
#  - in RAM: nothing limited;
#  - beyond RAM: in a memory cgroup of LIMIT GiB, which counts the process's own memory and the
#    page cache it reads and writes alike, with `--mem-limit LIMIT`; the files it streams are
#    dropped from the page cache before (POSIX_FADV_DONTNEED), so they come from the disk.
# MODE lora (the default): a LoRA fine-tune of build/qwen2_3b.gguf (Qwen2.5-3B's shape, random
#   BF16 weights, 6.2 GB, benchmarks/make_model.py), its base read in place from the file, at
#   BATCH (2) x CTX (512) with per-layer checkpointing; LIMIT 3 by default. In RAM, the file's
#   pages are in the page cache beforehand.
# MODE offload: behemoth bf16 at 2 x 8 with per-layer checkpointing; beyond RAM with
#   --offload build/offload_state (masters, m and v in files on the disk of the build tree);
#   LIMIT 4 by default.
# A run's tokens/s is the median of its steps after the first; the medians over RUNS pairs
# (default 3) are printed, with each run's figure, the fraction pair by pair, and for the limited
# runs the cgroup's peak (RSS and page cache), the page cache at the end and the bytes the disk
# read and wrote. Each run's largest anonymous and file-backed RSS come from its metrics.jsonl.
# Needs root and a memory cgroup (v1 or v2) it may create below its own.
#   benchmarks/beyond_ram.sh [lora|offload]     (RUNS=3 STEPS=4, CPUTRAIN=build/cputrain)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-lora}
runs=${RUNS:-3}
steps=${STEPS:-4}
cputrain=${CPUTRAIN:-build/cputrain}
llamacpp=${CPUTRAIN_LLAMACPP_DIR:-$HOME/.cache/cputrain/llamacpp}
[[ -x $cputrain ]] || { echo "beyond_ram.sh: $cputrain: not built (tools/build.sh)" >&2; exit 1; }
case $mode in
  lora)
    limit=${LIMIT:-3}
    model=build/qwen2_3b.gguf
    data=build/finetune_bench.jsonl
    [[ -f $data ]] || { echo "beyond_ram.sh: $data: run benchmarks/finetune_bench.sh once" >&2; exit 1; }
    if [[ ! -f $model ]]; then
      /usr/bin/python3 benchmarks/make_model.py "$llamacpp/src/gguf-py" "$model.tmp" 3b
      mv "$model.tmp" "$model"
    fi
    streamed=("$model")
    args=(finetune --model "$model" --data "$data" --ctx "${CTX:-512}" --batch "${BATCH:-2}"
      --accum 1 --lora-rank 16 --dtype bf16)
    limited_args=()
    what="qwen2 3B shape (6.2 GB BF16 base), LoRA r16, bf16, ${BATCH:-2} x ${CTX:-512}"
    ;;
  offload)
    limit=${LIMIT:-4}
    state=build/offload_state
    streamed=("$state/masters.f32" "$state/adamw_m.f32" "$state/adamw_v.f32")
    args=(train --preset behemoth --dtype bf16 --batch 2 --accum 8)
    limited_args=(--offload "$state")
    what="behemoth bf16, 2 x 8, --offload $state"
    ;;
  *) echo "beyond_ram.sh: mode '$mode' is not lora or offload" >&2; exit 1 ;;
esac
tmp=$(mktemp -d -p build)

# A memory cgroup below this process's own, v2 or v1.
if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
  parent=/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
  echo +memory >"$parent/cgroup.subtree_control" 2>/dev/null || true
  limit_file=memory.max peak_file=memory.peak cache_key=file
else
  parent=/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)
  limit_file=memory.limit_in_bytes peak_file=memory.max_usage_in_bytes cache_key=total_cache
fi
cg=$parent/cputrain_bench
mkdir -p "$cg"
trap 'rm -rf "$tmp"; rmdir "$cg" 2>/dev/null || true' EXIT
[[ -w $cg/$limit_file ]] || { echo "beyond_ram.sh: $cg: cannot limit memory there" >&2; exit 1; }

drop_cache() {
  /usr/bin/python3 -c "
import os, sys
for path in sys.argv[1:]:
    if os.path.exists(path):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)" "$@"
}
disk=$(basename "$(df --output=source build | tail -1)")
# Bytes read and written by the build tree's disk so far.
disk_bytes() { awk -v d="$disk" '$3 == d {print $6 * 512, $10 * 512}' /proc/diskstats; }
# run NAME limited|free: one run; prints tokens/s, the largest RSS, anonymous RSS and file RSS
# (peak_rss_bytes where the run records it, else the largest rss_bytes of its steps), the budget.
run() {
  local out=$tmp/$1
  rm -rf "$out"
  local all=("${args[@]}" --steps "$steps" --checkpoint layer --save-every 0 --out "$out")
  if [[ $2 == limited ]]; then
    echo $((limit * 1024 * 1024 * 1024)) >"$cg/$limit_file"
    echo 0 >"$cg/$peak_file" 2>/dev/null || true
    sh -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$cputrain" "${all[@]}" \
      "${limited_args[@]}" --mem-limit "$limit" >"$out.log" 2>&1
  else
    if [[ $mode == lora ]]; then cat "${streamed[@]}" >/dev/null; fi
    "$cputrain" "${all[@]}" >"$out.log" 2>&1
  fi
  /usr/bin/python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if 'tokens_per_s' in l]
print('%.1f' % statistics.median(r['tokens_per_s'] for r in rows[1:]),
      max(r.get('peak_rss_bytes', r['rss_bytes']) for r in rows),
      max(r['rss_anon_bytes'] for r in rows), max(r['rss_file_bytes'] for r in rows),
      rows[-1]['budget_bytes'])" "$out/metrics.jsonl"
}
gib() { awk -v b="$1" 'BEGIN {printf "%.2f", b / 2^30}'; }
gb() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", (b - a) / 1e9}'; }
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
ram=() lim=() ratio=()
for ((i = 0; i < runs; i++)); do
  read -r rate rss anon file budget < <(run ram free)
  ram+=("$rate")
  echo "in RAM:     $rate tokens/s; RSS $(gib "$rss") GiB: anonymous $(gib "$anon") (budget $(gib "$budget")), files $(gib "$file")"
  drop_cache "${streamed[@]}"
  read -r read0 write0 < <(disk_bytes)
  read -r rate rss anon file budget < <(run limited limited)
  read -r read1 write1 < <(disk_bytes)
  lim+=("$rate")
  ratio+=("$(awk -v a="$rate" -v b="${ram[-1]}" 'BEGIN {printf "%.2f", a / b}')")
  peak=$(cat "$cg/$peak_file" 2>/dev/null || echo 0)
  cache=$(awk -v k="$cache_key" '$1 == k {print $2}' "$cg/memory.stat")
  echo "beyond RAM: $rate tokens/s (${ratio[-1]}); RSS $(gib "$rss") GiB: anonymous $(gib "$anon") (budget $(gib "$budget")), files $(gib "$file"); cgroup peak $(gib "$peak") of $limit GiB, page cache $(gib "$cache") GiB at the end; disk read $(gb "$read0" "$read1") GB, wrote $(gb "$write0" "$write1") GB"
done
echo "$what, per-layer checkpointing, median of $runs pairs"
echo "in RAM:     $(median "${ram[@]}") tokens/s (${ram[*]})"
echo "beyond RAM: $(median "${lim[@]}") tokens/s (${lim[*]}), $(median "${ratio[@]}") of in RAM (${ratio[*]}); cgroup and --mem-limit $limit GiB"
