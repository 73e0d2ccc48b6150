#!/usr/bin/env bash
# Installs the Debian packages cputrain builds and runs with, only those that are missing.
# Usage: tools/install_deps.sh [--torch] [--fuzz] [--llamacpp]   (--torch adds what the PyTorch
# comparison needs, --fuzz clang and its libFuzzer runtime, --llamacpp the llama.cpp the interop
# tests compare with: below)
set -euo pipefail

packages=(g++ cmake make pkg-config libdnnl-dev libeigen3-dev libsentencepiece-dev
          libspdlog-dev libgtest-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev libxxhash-dev libpcre2-dev libopenmpi-dev openmpi-bin fortunes
          clang-format)
llamacpp=0
for arg in "$@"; do
  case "$arg" in
    --torch) packages+=(python3 python3-torch libopenblas0-openmp libtcmalloc-minimal4) ;;
    --fuzz) packages+=(clang libclang-rt-14-dev) ;;
    --llamacpp) llamacpp=1; packages+=(git python3 python3-numpy python3-jinja2) ;;
    *) echo "install_deps.sh: unknown option $arg (--torch, --fuzz, --llamacpp)" >&2; exit 2 ;;
  esac
done
if [[ $llamacpp -eq 1 ]] && ! command -v npm >/dev/null; then
  packages+=(npm)
fi

# --llamacpp: a prebuilt llama.cpp (libllama and ggml, with their C API) from npm, and the source
# of that release (its headers, gguf-py and tokenizer test vectors), which the package ships as a
# git bundle. A test oracle, in its own folder: nothing of it enters the project.
install_llamacpp() {
  local dir=${CPUTRAIN_LLAMACPP_DIR:-${HOME}/.cache/cputrain/llamacpp}
  local bins=$dir/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
  if [[ -f $dir/src/include/llama.h && -n $(compgen -G "$bins/libllama*.so") ]]; then
    return 0
  fi
  echo "installing llama.cpp (node-llama-cpp 3.21.1) into $dir"
  mkdir -p "$dir"
  npm install --prefix "$dir" --ignore-scripts --omit=optional --no-audit --no-fund \
    node-llama-cpp@3.21.1 @node-llama-cpp/linux-x64@3.21.1 >/dev/null
  rm -rf "$dir/src"
  git -c advice.detachedHead=false clone -q "$dir/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$dir/src"
}

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  if [[ $llamacpp -eq 1 ]]; then install_llamacpp; fi
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
if [[ $llamacpp -eq 1 ]]; then install_llamacpp; fi
