"""Engine replicas on Ray Serve: 2 replicas vs 1, and the router policies, on a shared-prefix workload.

    python bench/replicas.py                       # 1 replica; 2 x round-robin / prefix / prefix-load
    python bench/replicas.py --configs 2:prefix-load --requests 16

Each configuration is the real `prefixkv serve --replicas N` application (prefixkv/replicas/app.py:
the ingress + N engine deployments) on one local Ray, driven over HTTP by a streaming client:
`--groups` system prompts of ~`--prefix-words` words, `--requests` questions spread over them in
turn (so round-robin scatters each group), `--concurrency` in flight. Printed per configuration:
median and p90 time to first token, requests/s and output tokens/s over the whole run, and the
fraction of prompt tokens served from a replica's cache (usage.prompt_tokens_details). The
machine's CPUs are split between replicas (torch threads = cores / N), so 2 vs 1 compares the
same hardware used two ways. Relative figures only: timings move with the machine's load, which
is printed at the start and the end, and the 1-minute load average after each configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOPICS = ["astronomy", "cooking", "gardening", "sailing", "chess", "pottery", "birdwatching", "cycling"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(group: int, words: int) -> str:
    topic = TOPICS[group % len(TOPICS)]
    sentence = f"You are a patient expert on {topic} number {group}; answer briefly and precisely. "
    text = ""
    while len(text.split()) < words:
        text += sentence
    return text


def workload(requests: int, groups: int, words: int, repeat: int) -> list[str]:
    """Questions over `groups` system prompts, in a shuffled order (seeded): a fixed cycle would let
    round-robin pin each group to one replica by accident. Each repeat has system prompts of its own."""
    prefixes = [system_prompt(repeat * groups + g, words) for g in range(groups)]
    order = list(range(requests))
    random.Random(repeat).shuffle(order)
    return [f"{prefixes[i % groups]}Question {i}: what matters most, and why?" for i in order]


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as res:
        if res.status_code != 200:
            raise RuntimeError(f"HTTP {res.status_code}: {(await res.aread())[:300]!r}")
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    assert ttft is not None and usage is not None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft, "prompt": usage["prompt_tokens"], "cached": cached, "out": usage["completion_tokens"]}


async def drive(base: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        # one warm-up request on a prompt of its own (first-call costs), not counted
        await one(client, model, "warm up " * 8, 2)

        async def gated(p: str) -> dict:
            async with gate:
                return await one(client, model, p, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": sum(r["out"] for r in results) / wall,
        "cached_fraction": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        "wall_s": wall,
    }


def run_config(replicas: int, router: str, a: argparse.Namespace) -> dict:
    from ray import serve

    from prefixkv.replicas.app import APP_NAME, build_application, parse_builder_args

    flags = {
        "replicas": replicas,
        "router": router if router != "-" else "round-robin",
        "max_model_len": a.max_model_len,
        "replica_num_cpus": 0,
        "disable_log_stats": True,
    }
    if a.model:
        flags["model"] = a.model
    args = parse_builder_args(flags)
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")
    base = f"http://127.0.0.1:{a.port}"
    deadline = time.time() + 300
    while httpx.get(base + "/health", timeout=10).status_code != 200:
        if time.time() > deadline:
            raise RuntimeError("the replicas never became healthy")
        time.sleep(0.5)
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    try:
        runs = [
            asyncio.run(
                drive(base, model, workload(a.requests, a.groups, a.prefix_words, rep), a.max_tokens, a.concurrency)
            )
            for rep in range(a.repeats)
        ]
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    finally:
        serve.delete(APP_NAME)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--configs",
        default="1:-,2:round-robin,2:prefix,2:prefix-load",
        help="comma-separated REPLICAS:ROUTER (ROUTER '-' for one replica)",
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--groups", type=int, default=5, help="distinct system prompts (shared prefixes)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (new prefixes each); medians")
    p.add_argument("--prefix-words", type=int, default=220, help="words per system prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    a = p.parse_args()
    a.port = free_port()

    import ray
    from ray import serve

    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, logging_level="warning", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port}, logging_config={"log_level": "WARNING"})
    rows = []
    try:
        for spec in a.configs.split(","):
            n, router = spec.split(":")
            r = run_config(int(n), router, a)
            r.update(replicas=int(n), router=router, load_1min=os.getloadavg()[0])
            rows.append(r)
            if a.json:
                print(json.dumps(r))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{a.requests} requests, {a.groups} shared prefixes of ~{a.prefix_words} words, "
        f"{a.max_tokens} output tokens, concurrency {a.concurrency}; medians of {a.repeats} runs"
    )
    base = rows[0]
    print(
        f"{'replicas':>8} {'router':<12} {'TTFT med':>9} {'TTFT p90':>9} {'req/s':>7} {'out tok/s':>9} "
        f"{'cached':>7} {'load':>5}"
    )
    for r in rows:
        print(
            f"{r['replicas']:>8} {r['router']:<12} "
            f"{r['ttft_median_s'] * 1000:>7.0f}ms {r['ttft_p90_s'] * 1000:>7.0f}ms "
            f"{r['requests_per_s']:>7.2f} {r['output_tokens_per_s']:>9.1f} "
            f"{r['cached_fraction']:>7.1%} {r['load_1min']:>5.1f}"
            f"   (x{r['requests_per_s'] / base['requests_per_s']:.2f} req/s vs the first row)"
        )


if __name__ == "__main__":
    main()
