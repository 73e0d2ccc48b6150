#!/usr/bin/env bash
# The test command of the README: installs what is missing, builds with warnings as errors,
# and runs the whole GoogleTest suite through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
tools/build.sh -DCPUTRAIN_WERROR=ON
cd build
ctest --output-on-failure --timeout 900 "$@"
