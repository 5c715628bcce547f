#!/usr/bin/env bash
# Developer build: compiles the extension modules with CMake and copies them into jax_msa/, so that
# `PYTHONPATH=$PWD python -m pytest` runs against the source tree. Incremental.
#   PYTHON=/path/to/python  JAX_MSA_CUDA=AUTO|ON|OFF  JAX_MSA_CUDA_ARCHS=90a-real (faster than the default list)  BUILD_DIR=build/inplace
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build/inplace}
cmake -S . -B "$BUILD_DIR" -G Ninja -DPython_EXECUTABLE="$(command -v "$PY")" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j"${JOBS:-2}"
for so in "$BUILD_DIR"/_jax_msa_*.so; do  # copy then rename: never rewrite a module a live process has mapped
  cp "$so" "jax_msa/.$(basename "$so").tmp" && mv -f "jax_msa/.$(basename "$so").tmp" "jax_msa/$(basename "$so")"
done
echo "built: $(ls jax_msa/_jax_msa_*.so | xargs -n1 basename | tr '\n' ' ')"
