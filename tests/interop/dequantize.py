#!/usr/bin/python3
"""The values of a GGUF file's quantised tensors by gguf-py's own dequantisation, for the tests.

Usage: dequantize.py GGUF_PY_DIR FILE OUT
Writes OUT.txt (one line per quantised tensor: its name and element count, in file order) and
OUT.f32 (their values as little-endian float32, one tensor after another).
"""
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402

QUANTISED = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_0,
             gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.Q8_0,
             gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
             gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.MXFP4}

reader = gguf.GGUFReader(sys.argv[2])
with open(sys.argv[3] + ".txt", "w") as index, open(sys.argv[3] + ".f32", "wb") as values:
    for t in reader.tensors:
        if t.tensor_type not in QUANTISED:
            continue
        v = gguf.quants.dequantize(t.data, t.tensor_type).astype("<f4").reshape(-1)
        index.write(f"{t.name} {v.size}\n")
        values.write(v.tobytes())
