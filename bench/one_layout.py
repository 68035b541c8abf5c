"""A model with no room for a second copy of its weights (the bound forced down): oneDNN's layout
alone (what such a model ran before the many-row native linear) against the native layout alone
(NativeLinear), two engines in one process, their prefill (478 tokens) and decode steps (batch 1
and 8, 256-token prompts, (time of 17 tokens - time of 1) / 16) timed alternately, 5 rounds, medians.

    .venv/bin/python bench/one_layout.py bfloat16 /var/tmp/ckpt/llama1b
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["PREFIXKV_KERNEL_CHOICE"] = "measure"  # each engine times for itself
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.model import llama
from prefixkv.model.kernels import choice as kernel_choice
from prefixkv.model.kernels import ops

# the choices made under the patch below are kept in a folder of this run's, not the machine's cache
choices = Path(tempfile.mkdtemp(prefix="one-layout-"))
kernel_choice._file = lambda shapes: choices / f"{abs(hash(shapes))}.json"

dtype, folder = sys.argv[1], sys.argv[2]
llama.DUAL_LAYOUT_MAX_BYTES = 0
llama.DUAL_LAYOUT_MEMORY_SHARE = 0.0
real = ops.blocked_linear_available
engines = {}
for mode in ("packed", "native"):
    ops.blocked_linear_available = (lambda dtype=None: False) if mode == "packed" else real
    kernel_choice._made.clear()
    engines[mode] = LLM(
        model=folder,
        dtype=dtype,
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
        cpu_thread_policy="fixed",
    )
    layer = engines[mode].llm_engine.runner.model.layers[0].mlp.down_proj
    print(mode, type(layer).__name__, ops.choice(getattr(torch, dtype)), flush=True)
ops.blocked_linear_available = real
g = torch.Generator().manual_seed(0)
prompts = {
    b: [{"prompt_token_ids": torch.randint(100, 40000, (256,), generator=g).tolist()} for _ in range(b)] for b in (1, 8)
}
long = [{"prompt_token_ids": torch.randint(100, 40000, (478,), generator=g).tolist()}]


def t(llm, ps, n):
    s = time.perf_counter()
    llm.generate(ps, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - s


res = {m: {"prefill": [], 1: [], 8: []} for m in engines}
for _rep in range(5):
    for m, llm in engines.items():
        res[m]["prefill"].append(t(llm, long, 1) * 1e3)
        for b in (1, 8):
            res[m][b].append((t(llm, prompts[b], 17) - t(llm, prompts[b], 1)) / 16 * 1e3)
for m in engines:
    print(
        m,
        {k: round(statistics.median(v), 1) for k, v in res[m].items()},
        {k: [round(x) for x in v] for k, v in res[m].items()},
    )
