# Sourced by the benchmark scripts (from the repository root): the model files they run on,
# made once into build/.
#   bench_model SHAPE          build/SHAPE.gguf, random BF16 weights (benchmarks/make_model.py)
#   bench_quantised SHAPE TYPE build/SHAPE-TYPE.gguf, by llama.cpp's quantiser (q8_0, q4_0,
#                              q4_k_m, ...; build/llama_oracle)
bench_model() {
  local model=build/$1.gguf
  if [[ ! -f $model ]]; then
    /usr/bin/python3 benchmarks/make_model.py \
      "${CPUTRAIN_LLAMACPP_DIR:-$HOME/.cache/cputrain/llamacpp}/src/gguf-py" "$model.tmp" "$1"
    mv "$model.tmp" "$model"
  fi
  echo "$model"
}

bench_quantised() {
  local model=build/$1-$2.gguf
  if [[ ! -f $model ]]; then
    build/llama_oracle quantize "$(bench_model "$1")" "$model.tmp" "$2" >/dev/null 2>&1
    mv "$model.tmp" "$model"
  fi
  echo "$model"
}
