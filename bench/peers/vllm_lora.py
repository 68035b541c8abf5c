"""Peer benchmark: vLLM (CPU) multi-LoRA throughput on the same adapters and traffic as
prefixkv's bench/lora.py (bench/lora_workload.py writes the same random rank-16 PEFT folders on all
seven linear targets and the same prompts, from the same seeds).

Run with the vLLM virtual environment, from the repo root:

    peers/vllm/bin/python bench/peers/vllm_lora.py --requests 16 --max-tokens 16 --repeats 3 --adapters 1,8

(--model defaults to peers/smollm2-135m-hf, built by make_peer_model.py; $PREFIXKV_PEERS moves peers/)

Two engines, each in its own child process (two vLLM engines in one process are fragile): the base
model without LoRA, and one with enable_lora=True, max_loras=N, max_lora_rank=--rank per adapter
count N. The parent alternates their passes (base, LoRA, base, LoRA, ...) so that load from other
processes on a shared machine hits both alike; every pass resets the prefix cache first, as
bench/lora.py does. Greedy, float32, enforce_eager, prefix caching on. Each child warms up on the
first N prompts (which also loads every adapter) before any timing.

Prints one JSON line (vLLM's own logging goes to stderr) and the markdown table bench/lora.py prints.
Environment defaults as vllm_generate.py: VLLM_CPU_KVCACHE_SPACE=1 (two engines at once),
VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from lora_workload import workload, write_random_adapter  # noqa: E402
from peer_common import PEERS_DIR  # noqa: E402

DEFAULT_MODEL = str(PEERS_DIR / "smollm2-135m-hf")
ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # keep stdout for the JSON lines
}


def child(args) -> None:
    """One engine; answers each command line on stdin ({"n": adapters, "prompts": k or null}) with
    one JSON line: generated and all tokens/s and the hit rate of one pass from an empty cache."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = args.child == "lora"
    kwargs = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank) if lora else {}
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        groups = workload(args.requests, cmd["n"], seed=cmd["n"])[: cmd.get("prompts") or None]
        prompts = [p for _, p in groups]
        loras = [LoRARequest(f"a{g}", g + 1, os.path.join(args.adapter_dir, f"adapter{g}")) for g, _ in groups]
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras if lora else None)
        dt = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        out = {"gen_tps": gen / dt, "all_tps": (gen + prompt_tokens) / dt, "hit": cached / prompt_tokens}
        print(json.dumps(out), flush=True)


class Engine:
    """A child engine process spoken to over its stdin/stdout."""

    def __init__(self, args, kind: str, max_loras: int) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--max-loras", str(max_loras)]
        for flag in ("model", "requests", "max_tokens", "rank", "adapter_dir"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()  # ready

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM child exited with {self.proc.wait()} (its log is on stderr above)")
        return json.loads(line)

    def run(self, n: int, prompts: int | None = None) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"n": n, "prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--adapters", default="1,4,8")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--child", choices=["base", "lora"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--max-loras", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--adapter-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    if args.child:
        child(args)
        return
    with open(os.path.join(args.model, "config.json")) as f:
        hf_config = json.load(f)
    counts = [int(x) for x in args.adapters.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="vllm-lora-bench-") as tmp:
        args.adapter_dir = tmp
        for i in range(max(counts)):
            write_random_adapter(os.path.join(tmp, f"adapter{i}"), hf_config, args.rank, seed=i)
        import vllm

        base = Engine(args, "base", 1)
        for n in counts:
            lora = Engine(args, "lora", n)
            base.run(n, prompts=n)  # warm up both (not timed)
            lora.run(n, prompts=n)  # and load every adapter once
            pairs = []
            for _ in range(args.repeats):
                pairs.append((base.run(n), lora.run(n)))
            lora.close()

            def med(side: int, key: str) -> float:
                return statistics.median(p[side][key] for p in pairs)  # noqa: B023

            pair_ratio = statistics.median(lo["gen_tps"] / b["gen_tps"] for b, lo in pairs)
            results.append(
                dict(
                    adapters=n,
                    base_gen_tps=med(0, "gen_tps"),
                    lora_gen_tps=med(1, "gen_tps"),
                    median_pair_ratio=pair_ratio,
                    base_all_tps=med(0, "all_tps"),
                    lora_all_tps=med(1, "all_tps"),
                    base_hit=med(0, "hit"),
                    lora_hit=med(1, "hit"),
                )
            )
        base.close()
    print(
        json.dumps(
            {
                "engine": "vllm",
                "version": vllm.__version__,
                "model": args.model,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "rank": args.rank,
                "repeats": args.repeats,
                "results": results,
                "loadavg_end": os.getloadavg(),
            }
        ),
        flush=True,
    )
    print("| adapters | base gen tok/s | LoRA gen tok/s | ratio | median pair ratio | base all tok/s | LoRA all tok/s "
          "| hit rate |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['adapters']} | {r['base_gen_tps']:.1f} | {r['lora_gen_tps']:.1f} "
            f"| {r['lora_gen_tps'] / r['base_gen_tps']:.2f}x | {r['median_pair_ratio']:.2f}x "
            f"| {r['base_all_tps']:.0f} | {r['lora_all_tps']:.0f} | {r['lora_hit']:.1%} (base {r['base_hit']:.1%}) |"
        )


if __name__ == "__main__":
    main()
