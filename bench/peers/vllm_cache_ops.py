"""Peer benchmark: vLLM's own KV-cache manager replaying the shared cache-manager traces.

Run with the vLLM virtual environment (not prefixkv's):

    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \\
        peers/vllm/bin/python bench/peers/vllm_cache_ops.py --trace reference --repeats 5

It wraps ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (one FullAttentionSpec group, the
trace's block size and block count, prefix caching on, sha256 block hashes with NONE_HASH set up
by ``init_none_hash`` exactly as vLLM's EngineCore does) in bench/workload.py's
``ManagerAdapter`` and replays the trace with ``workload.drive`` - the very loop prefixkv's
benchmark uses. Only ``drive`` is timed: trace generation and manager construction are not.

Each request is a real ``vllm.v1.request.Request`` built with vLLM's request block hasher, so the
timed work includes vLLM's per-request block hashing (vLLM does it when the engine core admits
the request; prefixkv's adapter likewise hashes inside ``start``/``lookup``).

Hit statistics come from vLLM's own ``PrefixCacheStats`` (``log_stats=True``), recorded the way
vLLM's scheduler records them: once per admitted request, at admission
(``record_prefix_cache_stats``). Lookups whose allocation is then refused are not counted by
vLLM; the adapter also counts every lookup itself (``hit_rate_all_lookups``), which is how
prefixkv's manager counts. With one request in flight (reference trace) the two are identical.

Prints one JSON line to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/

import workload  # noqa: E402
from workload import TRACES, Trace, TraceRequest  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the JSON line

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

HASH_ALGO = "sha256"  # vLLM's default CacheConfig.prefix_caching_hash_algo


class VllmAdapter:
    """workload.ManagerAdapter over vLLM's KVCacheManager."""

    def __init__(self, trace: Trace, max_model_len: int):
        bs = trace.block_size
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)  # as EngineCore.__init__ does (PYTHONHASHSEED unset -> fixed seed)
        self.block_hasher = get_request_block_hasher(bs, hash_fn)
        # SmolLM2-135M's attention shape; the manager never touches memory, only block ids.
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=3, head_size=64, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=trace.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        )
        self.mgr = KVCacheManager(
            kv_cache_config=config,
            max_model_len=max_model_len,
            scheduler_block_size=bs,
            hash_block_size=bs,
            enable_caching=True,
            log_stats=True,
        )
        # One SamplingParams per output length, built outside the timed region (vLLM builds them
        # in the front-end process, not in the engine core where the manager lives).
        self.params = {
            n: SamplingParams(temperature=0.0, max_tokens=n)
            for n in {len(r.output) for r in trace.requests}
        }
        self.lookup_queries = 0
        self.lookup_hits = 0

    # -- ManagerAdapter ----------------------------------------------------------------------
    def start(self, req: TraceRequest) -> Request:
        return Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt,
            sampling_params=self.params[len(req.output)],
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=self.block_hasher,
        )

    def lookup(self, handle: Request):
        blocks, num_hit, _boundary = self.mgr.get_computed_blocks(handle)
        self.lookup_queries += handle.num_tokens
        self.lookup_hits += num_hit
        return blocks, num_hit

    def allocate(self, handle: Request, num_new_tokens: int, computed, num_hit: int) -> bool:
        if computed is None:  # decode step
            return self.mgr.allocate_slots(handle, num_new_tokens) is not None
        out = self.mgr.allocate_slots(handle, num_new_tokens, num_hit, computed)
        if out is None:
            return False
        # What Scheduler.schedule does on admitting a waiting request.
        self.mgr.record_prefix_cache_stats(handle, num_hit)
        handle.status = RequestStatus.RUNNING
        return True

    def advance(self, handle: Request, num_tokens: int, token: int | None) -> None:
        handle.num_computed_tokens += num_tokens
        if token is not None:
            handle.append_output_token_ids(token)  # also hashes any newly full block

    def free(self, handle: Request) -> None:
        self.mgr.free(handle)

    def stats(self) -> tuple[int, int]:
        s = self.mgr.prefix_cache_stats
        return s.queries, s.hits


def run(trace_name: str, repeats: int, requests: int | None) -> dict:
    trace = TRACES[trace_name]() if requests is None else TRACES[trace_name](num_requests=requests)
    longest = max(len(r.prompt) + len(r.output) for r in trace.requests)
    max_model_len = max(4096, longest)
    load_before = os.getloadavg()[0]
    times, cpu_times, results, lookups = [], [], [], []
    for _ in range(repeats):
        adapter = VllmAdapter(trace, max_model_len)
        c0, t0 = time.process_time(), time.perf_counter()
        res = workload.drive(trace, adapter)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        results.append(res)
        lookups.append((adapter.lookup_queries, adapter.lookup_hits))
    med = statistics.median(times)
    res = results[0]
    assert all((r.rejected_allocations, r.hit_tokens, r.queried_tokens)
               == (res.rejected_allocations, res.hit_tokens, res.queried_tokens) for r in results)
    lq, lh = lookups[0]
    return {
        "engine": "vllm",
        "version": vllm.__version__,
        "trace": trace.name,
        "requests": res.requests,
        "block_size": trace.block_size,
        "num_blocks": trace.num_blocks,
        "max_running": trace.max_running,
        "hash": HASH_ALGO,
        "seconds_median": round(med, 6),
        "requests_per_s": round(res.requests / med, 1),
        "us_per_prompt_block": round(med / res.prompt_blocks * 1e6, 3),
        "prompt_blocks": res.prompt_blocks,
        "hit_rate": round(res.hit_rate, 6),
        "queried_tokens": res.queried_tokens,
        "hit_tokens": res.hit_tokens,
        "hit_rate_all_lookups": round(lh / lq, 6) if lq else 0.0,
        "rejected_allocations": res.rejected_allocations,
        "seconds_min": round(min(times), 6),
        # CPU time of this process: less sensitive than wall time to other jobs on a shared box
        "cpu_seconds_median": round(statistics.median(cpu_times), 6),
        "requests_per_cpu_s": round(res.requests / statistics.median(cpu_times), 1),
        "us_cpu_per_prompt_block": round(statistics.median(cpu_times) / res.prompt_blocks * 1e6, 3),
        "requests_per_s_best": round(res.requests / min(times), 1),
        "repeats": [round(t, 6) for t in times],
        "python": sys.version.split()[0],
        # 1-minute load average before/after: the machine is shared, >2 means contention on 2 cores
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", choices=sorted(TRACES), default="reference")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=None, help="override the trace's request count")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.trace, args.repeats, args.requests)), flush=True)


if __name__ == "__main__":
    main()
