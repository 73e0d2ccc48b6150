#!/usr/bin/env bash
# The main job of the README: installs what is missing, builds the binary (not the tests and
# benchmarks: tools/run_tests.sh builds those), and trains the mini preset on the default corpus
# (Debian's fortunes), printing samples at the end. Extra arguments are passed to `cputrain`
# (e.g. --steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
tools/build.sh --target cputrain
exec build/cputrain --preset mini --out runs/mini --overwrite "$@"
