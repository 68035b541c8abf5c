#!/usr/bin/env bash
# Run here (not on the GPU machine): puts into .device/ (ignored by git) what a session with a lent
# GPU carries there - the wheels of bench/device/wheels.txt for its Python 3.12, and the default
# model's GGUF (94 MiB: over the 64 MiB a call may carry, the working tree included), compressed
# with xz (83 MiB) and cut in two parts, one per call: the first call carries the wheels and one
# part, the second the other part (and .device/base), the cut placed so that both calls carry about
# as much. Two calls, not three, because the machine stays warm only 30 s after a call and staging
# must not go cold.
# The calls themselves: docs/benchmarks.md, "CUDA: the day a GPU is lent".
# BASE=<commit>: also that commit's prefixkv and bench/ in .device/base (carried by the second
# call), for gpu_checks.sh's host_ab step: this tree's host work against that commit's, on the card.
set -euo pipefail
cd "$(dirname "$0")/../.."
# .device/ is in .gitignore: it travels only as a carried path
rm -rf .device && mkdir -p .device/whl
grep -v '^#' bench/device/wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp -d .device/whl \
    --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
model=$(.venv/bin/python -c "from prefixkv.model import default_model_path; print(default_model_path())")
for i in 0 1; do mkdir -p ".device/model-$i"; done
if [ -n "${BASE:-}" ]; then
    mkdir -p .device/base && git archive "$BASE" prefixkv bench | tar -x -C .device/base
    # the same measuring scripts in both trees (they run against older ones): only prefixkv differs
    cp bench/host_overhead.py bench/loglikelihood.py .device/base/bench/
fi
# quantized weights still compress by about a tenth: the headroom the two calls need
xz -6 -T0 -c "$model" > .device/model.xz
cp "$(dirname "$model")/__init__.py" .device/model-0/
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > .device/model-0/SHA256SUMS
# the cut: call 1 (wheels + part 0) and call 2 (part 1 + base) carry the same, the tree in both
whl=$(du -sb .device/whl .device/model-0 | awk '{s += $1} END {print s}')
base=$( [ -n "${BASE:-}" ] && du -sb .device/base | cut -f1 || echo 0)
cut=$(( ($(stat -c %s .device/model.xz) + base - whl) / 2 ))
head -c "$cut" .device/model.xz > .device/model-0/part-0
tail -c +$(( cut + 1 )) .device/model.xz > .device/model-1/part-1
rm .device/model.xz
du -sh .device/whl .device/model-* ${BASE:+.device/base}
# what each call carries, the tracked working tree included, against the 64 MiB a call may carry
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
first=$(( tree + $(du -sb .device/whl .device/model-0 | awk '{s += $1} END {print s}') ))
second=$(( tree + $(du -sbc .device/model-1 ${BASE:+.device/base} | tail -1 | cut -f1) ))
echo "call 1 carries $(( first >> 20 )) MiB, call 2 $(( second >> 20 )) MiB (limit 64)"
[ "$first" -lt $(( 62 << 20 )) ] && [ "$second" -lt $(( 62 << 20 )) ] || { echo "a call would carry too much" >&2; exit 1; }
