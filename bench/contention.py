"""prefixkv under a noisy neighbour: each OpenMP wait policy with and without a fixed background load.

A production CPU server shares its cores with tokenizers, HTTP handling and other processes. With
OpenMP's default waiting, torch's worker threads spin between parallel regions; when another
process needs the core, the spinning threads and the neighbour take turns and every parallel
region waits for its slowest thread. This script runs the same workload in a fresh process per
configuration (the policy must be set before torch loads its OpenMP runtime), alone and beside a
neighbour process that keeps `--load` of one core busy (a Python loop on a 10 ms duty cycle),
alternating the configurations, and prints per configuration the median time of each phase and
the slowdown factor (with load / alone).

Phases: `prefill` (one ~1,000-token prompt, caching off, 1 output token), `decode` (one short
prompt, 64 greedy output tokens, time per output token), `batch` (8 prompts sharing a ~600-token
prefix, 16 output tokens each, caching on).

    .venv/bin/python bench/contention.py [--repeats 3] [--load 0.7] [--policies default,passive,spin]

Policies: `default` (what torch does with no setting), `passive` (OMP_WAIT_POLICY=PASSIVE),
`spin` (GOMP_SPINCOUNT=10000: a short spin, then sleep), `one` (one torch thread).
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

POLICIES = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin": {"GOMP_SPINCOUNT": "10000"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "one": {"OMP_NUM_THREADS": "1"},
}

WORKLOAD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from prefixkv import LLM, SamplingParams
words = "river mountain quiet engine paper lantern violet harbor copper signal garden winter".split()
def text(n, seed):
    return " ".join(words[(i * 7 + seed) % len(words)] for i in range(n))
llm = LLM(enable_prefix_caching=False, max_model_len=2048)
llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
out = {}
t = time.perf_counter()
llm.generate([text(760, 1)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
out["prefill"] = time.perf_counter() - t
t = time.perf_counter()
r = llm.generate(["Tell me a story."], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
out["decode"] = (time.perf_counter() - t) / len(r[0].outputs[0].token_ids)
del llm
llm = LLM(enable_prefix_caching=True, max_model_len=2048)
llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
shared = text(450, 2)
t = time.perf_counter()
llm.generate([shared + f" Question {i}: why?" for i in range(8)],
             SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
out["batch"] = time.perf_counter() - t
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


def run_once(policy: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(POLICIES[policy])
    proc = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(ROOT)], env=env, capture_output=True, text=True, check=True
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of one core the neighbour keeps busy")
    ap.add_argument("--policies", default="default,passive,spin")
    args = ap.parse_args()
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            sys.exit(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for r in range(args.repeats):
        for loaded in (False, True):
            neighbour = None
            if loaded:
                neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(args.load)])
                time.sleep(0.5)
            try:
                for p in policies:
                    res = run_once(p)
                    results.setdefault((p, loaded), []).append(res)
                    phases = ", ".join(f"{k} {v * (1000 if k == 'decode' else 1):.2f}" for k, v in res.items())
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


if __name__ == "__main__":
    main()
