#!/usr/bin/env bash
# The test command of the README: installs what is missing, checks that the sources are formatted
# as .clang-format says, builds with warnings as errors, runs the whole GoogleTest suite through
# ctest, then runs it again with each GEMM implementation forced (CPUTRAIN_GEMM), since every
# path this CPU has must pass it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
find engine kernels models tools tests benchmarks fuzz \( -name '*.cpp' -o -name '*.h' \) -print0 |
  xargs -0 clang-format --dry-run --Werror
echo "format: the sources match .clang-format"
tools/build.sh -DCPUTRAIN_WERROR=ON
cd build
ctest --output-on-failure --timeout 900 "$@"
backends=(onednn eigen reference)
if grep -qw avx512f /proc/cpuinfo; then
  backends=(avx512 "${backends[@]}")
fi
if grep -qw amx_bf16 /proc/cpuinfo; then
  backends=(amx "${backends[@]}")
fi
for backend in "${backends[@]}"; do
  echo "== the suite again with CPUTRAIN_GEMM=${backend}"
  CPUTRAIN_GEMM=${backend} ctest --output-on-failure --timeout 900 "$@"
done
