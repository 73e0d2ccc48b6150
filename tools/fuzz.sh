#!/usr/bin/env bash
# Fuzzes every file loader (checkpoint, weights, tokenizer model, run configuration, GGUF and
# safetensors files, Hugging Face configurations) with libFuzzer and AddressSanitizer: builds
# fuzz/fuzz_loaders with clang into build-fuzz/, writes valid seed files and damaged model files
# (each count of a GGUF file and of config.json at 0, 1, 2^31, 2^63 - 1 and -1), and runs for
# SECONDS (default 300). A finding stops the run with a report
# and a crash-* file to reproduce it (build-fuzz/fuzz_loaders crash-...).
#   tools/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh --fuzz
seconds=${1:-300}
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCPUTRAIN_FUZZ=ON \
  -DCPUTRAIN_BUILD_TESTS=OFF -DCPUTRAIN_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_loaders
rm -rf build-fuzz/seeds build-fuzz/corpus
CPUTRAIN_FUZZ_SEEDS=build-fuzz/seeds build-fuzz/fuzz_loaders
mkdir -p build-fuzz/corpus
cd build-fuzz
# One process: OpenMP threads, the tokenizer and the sanitizer share the machine's cores.
OMP_NUM_THREADS=1 ./fuzz_loaders -max_total_time="$seconds" -max_len=65536 -timeout=20 \
  -print_final_stats=1 corpus seeds
