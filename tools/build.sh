#!/usr/bin/env bash
# Configures and builds cputrain into build/ (Release): every program, or with --target NAME
# that one alone (e.g. cputrain, the binary). Other arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
target=()
if [[ ${1:-} == --target ]]; then
  target=(--target "$2")
  shift 2
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)" "${target[@]}"
