#!/usr/bin/env bash
# Data-parallel scaling on one machine: PRESET (mega) in bf16 at BATCH (4) x ACCUM (2) sequences
# a rank, one OpenMP thread a rank, run in turn as one process and as RANKS (2) ranks of
# `mpirun -np RANKS` (each bound to a core of its own), RUNS (3) pairs back to back. The job of
# RANKS ranks draws RANKS times the sequences a step: the same work a rank, so tokens/s scale by
# RANKS where nothing is lost to communication.
# A run's tokens/s is the median of its steps after the first; printed for each run, with the
# ratio pair by pair and its median, and for the job each rank's time summing the gradients (most
# of it behind the backward pass), what of it was left after the backward pass, the time
# gathering the updated weights (none of it hidden), and the peak RSS of the largest rank against
# the budget of one rank (the run's own, as `cputrain budget --ranks RANKS` gives it).
#   benchmarks/data_parallel.sh     (RUNS=3 STEPS=4 RANKS=2 PRESET=mega, CPUTRAIN=build/cputrain)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
steps=${STEPS:-4}
ranks=${RANKS:-2}
cputrain=${CPUTRAIN:-build/cputrain}
[[ -x $cputrain ]] || { echo "data_parallel.sh: $cputrain: not built (tools/build.sh)" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "data_parallel.sh: mpirun: not installed (tools/install_deps.sh)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
shape=(--preset "${PRESET:-mega}" --batch "${BATCH:-4}" --accum "${ACCUM:-2}" --threads 1
  --dtype bf16)
args=("${shape[@]}" --steps "$steps" --eval-every 1000000 --eval-windows 1 --sample-tokens 0
  --save-every 0)
export OMP_NUM_THREADS=1

# The median over steps 2.. of a run's tokens/s, and of the job's figures per rank.
summary() {
  python3 - "$1" <<'EOF'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
steps = [l for l in lines if l["step"] > 1] or lines
med = lambda xs: statistics.median(xs)
out = {"tokens_per_s": med([l["tokens_per_s"] for l in steps]),
       "peak_rss": max(l.get("peak_rss_bytes", l["rss_bytes"]) for l in lines),
       "budget": lines[-1].get("budget_bytes", 0)}
if "ranks" in steps[0]:
    n = len(steps[0]["ranks"])
    for key in ("reducing_ms", "comm_ms", "gather_ms", "ms"):
        out[key] = [med([l["ranks"][r][key] for l in steps]) for r in range(n)]
    out["peak_rss"] = max(r["peak_rss_bytes"] for l in lines for r in l["ranks"])
print(json.dumps(out))
EOF
}

echo "$(nproc --all) cores; ${PRESET:-mega} bf16, ${BATCH:-4} x ${ACCUM:-2} a rank, 1 thread a rank"
ones=() jobs=() ratios=()
for i in $(seq "$runs"); do
  "$cputrain" "${args[@]}" --out "$out/one$i" >/dev/null 2>&1
  mpirun --allow-run-as-root -np "$ranks" --bind-to core "$cputrain" "${args[@]}" --out "$out/job$i" \
    >/dev/null 2>&1
  one=$(summary "$out/one$i/metrics.jsonl")
  job=$(summary "$out/job$i/metrics.jsonl")
  python3 - "$one" "$job" "$i" <<'EOF'
import json, sys
one, job, i = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
fmt = lambda xs: "/".join(f"{x:.0f}" for x in xs)
print(f"pair {i}: 1 rank {one['tokens_per_s']:.0f} tok/s, {len(job['ms'])} ranks {job['tokens_per_s']:.0f} tok/s, "
      f"x{job['tokens_per_s'] / one['tokens_per_s']:.3f}; step {fmt(job['ms'])} ms, summing gradients "
      f"{fmt(job['reducing_ms'])} ms ({fmt(job['comm_ms'])} after the backward pass), gathering weights "
      f"{fmt(job['gather_ms'])} ms; peak RSS {job['peak_rss'] / 2**20:.0f} MiB, budget {job['budget'] / 2**20:.0f} "
      f"(1 rank: {one['peak_rss'] / 2**20:.0f}, budget {one['budget'] / 2**20:.0f})")
EOF
  ones+=("$(python3 -c "import json; print(json.loads('$one')['tokens_per_s'])")")
  jobs+=("$(python3 -c "import json; print(json.loads('$job')['tokens_per_s'])")")
done
python3 - "${ones[*]}" "${jobs[*]}" <<'EOF'
import statistics, sys
ones = [float(x) for x in sys.argv[1].split()]
jobs = [float(x) for x in sys.argv[2].split()]
ratios = [j / o for o, j in zip(ones, jobs)]
print(f"median: 1 rank {statistics.median(ones):.0f} tok/s, job {statistics.median(jobs):.0f} tok/s; "
      f"ratio pair by pair {', '.join(f'{r:.3f}' for r in ratios)}, median {statistics.median(ratios):.3f}")
EOF
