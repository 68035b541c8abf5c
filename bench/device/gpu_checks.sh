#!/usr/bin/env bash
# Run on the lent GPU machine, from the repository root, right after `bash bench/device/stage.sh 1`
# (docs/benchmarks.md, "CUDA: the day a GPU is lent"): the CUDA checks of issue 16 in one command,
# most telling first, each bounded so that the whole ends by $BUDGET seconds (default 540) and
# every log lands in $OUT:
#   1. the CUDA-vs-CPU model equality and tests/engine/test_cuda.py (engine on the GPU vs the
#      transformers oracle, caching on and off, blocks freed)
#   2. bench/model_speed.py on the GPU in bfloat16: prefill tok/s, decode ms/step at 1/32/256
#   3. bench/shared_prefix.py (the LLM picks the GPU, bfloat16)
#   4. the whole suite with CUDA present (pytest-xdist over the machine's cores; no redis-server
#      or Ray there, so those are left out)
#   5. with what time is left, model_speed again beside transformers on the same GPU
set -u
BUDGET=${BUDGET:-540}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $((BUDGET - (SECONDS - start))); }
bounded() {  # bounded SECONDS LOG CMD...: run CMD for at most SECONDS (less if the budget is short)
    local want=$1 log=$2
    shift 2
    local t
    t=$(left)
    [ "$want" -lt "$t" ] && t=$want
    if [ "$t" -lt 15 ]; then
        echo "skipped (budget spent): $*" | tee -a "$out/$log"
        return
    fi
    echo "== $* (at most ${t}s)" | tee -a "$out/$log"
    timeout "$t" "$@" 2>&1 | tee -a "$out/$log"
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$out/$log"
}
{
    nvidia-smi -L
    nproc
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/env.log"
bounded 150 cuda_tests.log python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/model/test_model_hf_folder.py::test_cuda_matches_cpu tests/engine/test_cuda.py
bounded 100 model_speed.log python3 bench/model_speed.py --device cuda --dtype bfloat16 --batches 1,32,256 --no-hf
bounded 100 shared_prefix.log python3 bench/shared_prefix.py --repeats 3
bounded 240 tests.log python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --timeout 150 \
    --continue-on-collection-errors --ignore=tests/replicas -k "not redis"
bounded 120 model_speed_hf.log python3 bench/model_speed.py --device cuda --dtype bfloat16 --batches 1,32,256
