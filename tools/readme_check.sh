#!/usr/bin/env bash
# Runs every command of the README's ```sh blocks, in order, in a scratch folder, against small
# stand-ins, and exits non-zero if any fails. ```console and ```text blocks (downloads, other
# programs, transcripts) are not run.
#
#   tools/readme_check.sh            (needs build/cputrain; CPUTRAIN_BIN names another binary)
#
# The stand-ins: the README's names on the left become what this script runs.
#   model.gguf                       -> $CPUTRAIN_SHARED/models/stories260K.gguf
#                                       (CPUTRAIN_SHARED defaults to ../shared from the repository)
#   --preset mini|mega|behemoth|titan -> --preset tiny
#   train.jsonl                      -> a small file of prompt/completion pairs written here
#   pairs.jsonl                      -> a small file of preference pairs written here
#   prompts.jsonl, score.py          -> a small file of prompts with answers, and a reward
#                                       command scoring a completion's length, written here
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
shared=$(cd "${CPUTRAIN_SHARED:-$repo/../shared}" && pwd)
bin=${CPUTRAIN_BIN:-$repo/build/cputrain}
model=$shared/models/stories260K.gguf
substitute() {
  sed -E -e "s#(^|[ =])model\.gguf#\1${model}#g" \
    -e 's#--preset (mini|mega|behemoth|titan)#--preset tiny#g' <<<"$1"
}

[[ -x $bin ]] || { echo "readme_check: no binary at $bin (build first: tools/build.sh)" >&2; exit 2; }
[[ -f $model ]] || { echo "readme_check: no $model (set CPUTRAIN_SHARED)" >&2; exit 2; }

# The README's sh blocks, one command an entry (lines ending in \ joined; comment lines dropped).
commands=()
in_block=0
pending=""
while IFS= read -r line; do
  if [[ $in_block -eq 0 ]]; then
    [[ $line == '```sh' ]] && in_block=1
    continue
  fi
  if [[ $line == '```' ]]; then
    in_block=0
    continue
  fi
  [[ -z $pending && ( $line =~ ^[[:space:]]*$ || $line =~ ^[[:space:]]*# ) ]] && continue
  if [[ $line == *'\' ]]; then
    pending+="${line%\\} "
    continue
  fi
  commands+=("$pending$line")
  pending=""
done <"$repo/README.md"
[[ ${#commands[@]} -gt 0 ]] || { echo "readme_check: no sh blocks in README.md" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/readme_check.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/build"
ln -s "$bin" "$work/build/cputrain"
ln -s "$repo/tools" "$work/tools"
for i in $(seq 1 64); do
  printf '{"prompt": "Q: What is %d plus %d?\\nA:", "completion": " %d."}\n' "$i" "$i" $((2 * i))
done >"$work/train.jsonl"
for i in $(seq 1 64); do
  printf '{"prompt": "Q: What is %d plus %d?\\nA:", "chosen": " %d.", "rejected": " %d."}\n' \
    "$i" "$i" $((2 * i)) $((2 * i + 1))
done >"$work/pairs.jsonl"
for i in $(seq 1 64); do
  printf '{"prompt": "Q: What is %d plus %d?\\nA:", "answer": "%d"}\n' "$i" "$i" $((2 * i))
done >"$work/prompts.jsonl"
cat >"$work/score.py" <<'PY'
import json, sys
for line in sys.stdin:
    print(len(json.loads(line)["completion"]) % 7 / 7, flush=True)
PY

failed=0
for command in "${commands[@]}"; do
  run=$(substitute "$command")
  echo "== $command"
  [[ $run == "$command" ]] || echo "   as: $run"
  start=$SECONDS
  if (cd "$work" && timeout 600 bash -o pipefail -c "$run") >"$work/.out" 2>&1; then
    echo "   ok ($((SECONDS - start)) s)"
  else
    status=$?
    echo "   FAILED with status $status ($((SECONDS - start)) s); its last lines:"
    tail -n 20 "$work/.out" | sed 's/^/   | /'
    failed=$((failed + 1))
  fi
done
echo "readme_check: ${#commands[@]} commands, $failed failed"
[[ $failed -eq 0 ]]
