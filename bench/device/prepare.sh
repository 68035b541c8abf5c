#!/usr/bin/env bash
# Run here (not on the GPU machine): puts into .device/ (ignored by git) what a session with a lent
# GPU carries there - the wheels of bench/device/wheels.txt for its Python 3.12, and the default
# model's GGUF (94 MiB: over the 64 MiB a call may carry) in three parts, one per call.
# The calls themselves: docs/benchmarks.md, "CUDA: the day a GPU is lent".
set -euo pipefail
cd "$(dirname "$0")/../.."
# .device/ is in .gitignore: it travels only as a carried path
rm -rf .device && mkdir -p .device/whl
grep -v '^#' bench/device/wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp -d .device/whl \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
model=$(.venv/bin/python -c "from prefixkv.model import default_model_path; print(default_model_path())")
for i in 0 1 2; do mkdir -p ".device/model-$i"; done
split -n 3 -d -a 1 "$model" .device/part-
for i in 0 1 2; do mv ".device/part-$i" ".device/model-$i/"; done
cp "$(dirname "$model")/__init__.py" .device/model-0/
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > .device/model-0/SHA256SUMS
du -sh .device/whl .device/model-*
