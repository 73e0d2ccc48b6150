#!/usr/bin/env bash
# The test command of the README: installs what is missing, checks that the sources are formatted
# as .clang-format says, builds with warnings as errors, runs the whole GoogleTest suite through
# ctest, then runs the tests that compute again under each lower ISA level and with each GEMM
# that is only taken when forced, since every path this CPU has must pass them.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh --llamacpp  # llama.cpp, the oracle of the interop tests
find engine kernels models tools tests benchmarks fuzz \( -name '*.cpp' -o -name '*.h' \) -print0 |
  xargs -0 clang-format --dry-run --Werror
echo "format: the sources match .clang-format"
tools/build.sh -DCPUTRAIN_WERROR=ON
cd build
# The first pass runs at the CPU's own level: the default, except where AVX512_BF16 comes without
# AMX, whose default can be avx512 (kernels/cpu/dispatch.h), so that level is named. Every lower
# ISA level as the ceiling then runs each kernel family's builds for that level. oneDNN and the
# reference GEMM are taken only when forced.
flags=$(grep -m1 '^flags' /proc/cpuinfo)
levels=()
first=()
has() { [[ " ${flags} " == *" $1 "* ]]; }
if has avx512f; then levels+=(avx2); fi
if has avx512_bf16; then levels+=(avx512); fi
if has amx_bf16; then levels+=(avx512_bf16); elif has avx512_bf16; then first=(CPUTRAIN_ISA=avx512_bf16); fi
echo "== the suite at the CPU's own level ${first[*]}"
env "${first[@]}" ctest --output-on-failure --timeout 900 "$@"
# The passes again leave out the tests of what a command does with its input, files and signals
# (bad model files, refusals, interruptions, run directories), which compute the same whatever
# kernel runs; every test that computes runs in each pass.
again=(-E '^(BadModels|ModelBounds|FinetuneCli\.(AStopSignal|ADamaged|AResume|AnExport|BadInput|ANonFinite|Epochs|Exports)|PreferenceCli\.(AnInterrupted|AStopSignal|BadInput)|GrpoCli\.(AnInterrupted|AFailing|BadInput)|DataParallelCli\.(AStoppedOrKilled|BadInputIsSaidOnce)|Cli\.(UnknownPreset|NonPositive|OutOfRange|MissingAndEmpty|Unwritable|SampleFromMissing|ARunDirectoryIsNever|RunsResumeFromAny|ASecondProcess|WhatARunCannot|InterruptWhilePreparing|SecondInterrupt|BadDtypeAnd|BudgetThatDoesNotFit|ParityHelp))')
for level in "${levels[@]}"; do
  echo "== the suite again with CPUTRAIN_ISA=${level}"
  CPUTRAIN_ISA=${level} ctest --output-on-failure --timeout 900 "${again[@]}" "$@"
done
# The reference GEMM is the plain loop the kernel tests check every other GEMM against: under it,
# the budget runs of the mini preset and the commands that train several runs to compare them
# (a resume, an interrupt, offload, a run as a base, fine-tunes over bases read in place) take most
# of the pass's time and check nothing their tiny-preset and first-pass runs do not.
reference_also='|^Configurations/BudgetVsMeasured\..*/mini_|^Cli\.(ARunIsABaseToFineTune|InterruptSavesAndResume|ResumeIsBitwise|OffloadedRunIsBitwise)|^FineTune\.ABaseReadInPlace|^LlamaCppLora\.AnAdapterTrainedOverAQuantisedBase'
echo "== the suite again with CPUTRAIN_GEMM=onednn"
CPUTRAIN_GEMM=onednn ctest --output-on-failure --timeout 900 "${again[@]}" "$@"
echo "== the suite again with CPUTRAIN_GEMM=reference"
CPUTRAIN_GEMM=reference ctest --output-on-failure --timeout 900 -E "${again[1]}${reference_also}" "$@"
