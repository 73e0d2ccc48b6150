#!/usr/bin/env bash
# Installs the Debian packages cputrain builds and runs with, only those that are missing.
# Usage: tools/install_deps.sh [--torch | --fuzz]   (--torch adds what the PyTorch comparison
# needs, --fuzz clang and its libFuzzer runtime)
set -euo pipefail

packages=(g++ cmake make pkg-config libdnnl-dev libeigen3-dev libsentencepiece-dev
          libspdlog-dev libgtest-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev libxxhash-dev fortunes clang-format)
if [[ "${1:-}" == "--torch" ]]; then
  packages+=(python3 python3-torch libopenblas0-openmp libtcmalloc-minimal4)
fi
if [[ "${1:-}" == "--fuzz" ]]; then
  packages+=(clang libclang-rt-14-dev)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

echo "installing: ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
