"""Cache-manager throughput: prefixkv's KVCacheManager vs vLLM's on the same synthetic traces.

    .venv/bin/python bench/cache_ops.py [--trace reference|pressure|all] [--repeats 5]
        [--vllm-python /path/to/vllm-venv/bin/python]

Prints requests/s, microseconds per prompt block and token hit rate (medians over repeats) for
prefixkv in two modes - exact keys only (the default: content hashes are computed only for
external consumers) and exact keys plus sha256_cbor content hashes of every block (what vLLM
always pays) - and, when a Python with vLLM is given (or found at $VLLM_PYTHON), runs
bench/peers/vllm_cache_ops.py there on the same trace and prints the ratio.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from workload import TRACES, Trace, TraceRequest, drive  # noqa: E402

from bench.machine import describe  # noqa: E402
from prefixkv.cache import KVCacheManager  # noqa: E402
from prefixkv.request import Request  # noqa: E402


class PrefixKVAdapter:
    def __init__(self, trace: Trace, content_hashes: bool, hash_algo: str) -> None:
        self.mgr = KVCacheManager(
            num_blocks=trace.num_blocks, block_size=trace.block_size, enable_caching=True, hash_algo=hash_algo
        )
        self.content_hashes = content_hashes

    def start(self, treq: TraceRequest) -> Request:
        return Request(treq.request_id, treq.prompt)

    def lookup(self, req: Request):
        if self.content_hashes:  # pay for every block's external hash, as vLLM does
            self.mgr.get_block_hashes(req)
        return self.mgr.get_computed_blocks(req, record_stats=False)

    def allocate(self, req: Request, num_new: int, computed, num_hit: int) -> bool:
        ok = self.mgr.allocate_slots(req, num_new, computed) is not None
        if ok and computed is not None:  # admitted: count its lookup once, as the scheduler does
            self.mgr.stats.record(req.num_tokens, num_hit)
        if ok and self.content_hashes and num_new == 1:
            self.mgr.get_block_hashes(req)
        return ok

    def advance(self, req: Request, num_tokens: int, token: int | None) -> None:
        req.num_computed_tokens += num_tokens
        if token is not None:
            req.append_output_token_ids(token)

    def free(self, req: Request) -> None:
        self.mgr.free(req)

    def stats(self):
        return self.mgr.stats.queries, self.mgr.stats.hits


def run_prefixkv(trace: Trace, repeats: int, content_hashes: bool, hash_algo: str) -> dict:
    times, result = [], None
    for _ in range(repeats):
        adapter = PrefixKVAdapter(trace, content_hashes, hash_algo)
        t0 = time.perf_counter()
        result = drive(trace, adapter)
        times.append(time.perf_counter() - t0)
        assert adapter.mgr.num_free_blocks == trace.num_blocks, "blocks leaked"
    return summarize("prefixkv", trace, times, result)


def summarize(engine: str, trace: Trace, times: list[float], result) -> dict:
    med = statistics.median(times)
    return {
        "engine": engine,
        "trace": trace.name,
        "requests": result.requests,
        "seconds_median": med,
        "requests_per_s": result.requests / med,
        "us_per_prompt_block": med / result.prompt_blocks * 1e6,
        "hit_rate": result.hit_rate,
        "rejected_allocations": result.rejected_allocations,
        "repeats": times,
    }


def run_vllm(python: str, trace_name: str, repeats: int) -> dict | None:
    script = HERE / "peers" / "vllm_cache_ops.py"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    proc = subprocess.run(
        [python, str(script), "--trace", trace_name, "--repeats", str(repeats)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        print(f"  vLLM run failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def show(row: dict, label: str) -> None:
    print(
        f"  {label:<34} {row['requests_per_s']:>9.0f} req/s  {row['us_per_prompt_block']:>6.2f} us/prompt block"
        f"  hit rate {row['hit_rate']:.2%}  rejected {row['rejected_allocations']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="all", choices=[*TRACES, "all"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--json", action="store_true", help="also print one JSON line per result")
    args = ap.parse_args()
    print(describe(), flush=True)
    for name in TRACES if args.trace == "all" else [args.trace]:
        trace = TRACES[name]()
        print(
            f"trace {name}: {len(trace.requests)} requests, block size {trace.block_size}, "
            f"{trace.num_blocks} blocks, {trace.max_running} in flight; medians of {args.repeats}"
        )
        rows = {
            "exact": run_prefixkv(trace, args.repeats, False, "sha256_cbor"),
            "exact+sha256": run_prefixkv(trace, args.repeats, True, "sha256_cbor"),
        }
        show(rows["exact"], "prefixkv (exact keys)")
        show(rows["exact+sha256"], "prefixkv (exact keys + sha256_cbor)")
        if args.vllm_python:
            vrow = run_vllm(args.vllm_python, name, args.repeats)
            if vrow is not None:
                rows["vllm"] = vrow
                show(vrow, f"vLLM {vrow.get('version', '')} (sha256)")
                for key, row in rows.items():
                    if key != "vllm":
                        print(
                            f"  ratio prefixkv ({key}) / vLLM: {row['requests_per_s'] / vrow['requests_per_s']:.2f}x"
                            f"  (hit rates {row['hit_rate']:.2%} vs {vrow['hit_rate']:.2%})"
                        )
        else:
            print("  vLLM: not measured (pass --vllm-python or set VLLM_PYTHON to a Python with vllm installed)")
        if args.json:
            for row in rows.values():
                print(json.dumps(row))


if __name__ == "__main__":
    main()
