"""Serving benchmark: streaming /v1/completions requests at a given rate against an OpenAI-compatible
server, reporting TTFT and time-per-output-token percentiles, throughput and prefix-cache hit rate.

Workloads (same text for every server, so the same tokenizer sees the same prompts):
  shared     every prompt = one long common prefix + a short unique question
  unique     prompts of the same length with nothing in common (no-sharing baseline)

By default it starts `prefixkv serve` on a free 127.0.0.1 port (or use --base-url for a running
server). --peer-vllm also starts `vllm serve` (the vLLM CPU build, bench/peer_runner.py's peers) on the same
model and runs the identical workload against it. Both expose vLLM's metric names, so the hit
rate is read the same way from both /metrics endpoints.

    .venv/bin/python bench/serve.py --num-requests 24 --request-rate 2 --peer-vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.peer_runner import DEFAULT_VLLM_MODEL as VLLM_MODEL  # noqa: E402
from bench.peer_runner import DEFAULT_VLLM_PYTHON as VLLM_PY  # noqa: E402

WORDS = (
    "river mountain quiet engine paper lantern violet harbor copper signal garden winter orbit marble "
    "thunder canvas meadow silver anchor falcon ember willow summit prism cedar glacier hollow beacon "
    "saddle quartz ribbon tundra velvet bramble cobalt dune fjord granite ivory jasper kettle"
).split()


def text_of(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_prompts(kind: str, n: int, prefix_words: int, suffix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    if kind == "shared":
        prefix = text_of(rng, prefix_words)
        return [f"{prefix}\nQuestion {i}: {text_of(rng, suffix_words)}?" for i in range(n)]
    if kind == "unique":
        return [f"{text_of(rng, prefix_words)}\nQuestion {i}: {text_of(rng, suffix_words)}?" for i in range(n)]
    raise ValueError(kind)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tpot: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def one_request(
    http: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int, sampling: dict[str, float]
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        **sampling,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage = None
    try:
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("choices") and obj["choices"][0].get("text") and ttft is None:
                    ttft = time.perf_counter() - t0
                if obj.get("usage"):
                    usage = obj["usage"]
    except httpx.HTTPError as e:
        return Result(False, error=repr(e))
    e2e = time.perf_counter() - t0
    if usage is None or ttft is None:
        return Result(False, error="no usage / no token")
    n = usage["completion_tokens"]
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return Result(True, ttft, e2e, (e2e - ttft) / max(1, n - 1), usage["prompt_tokens"], n, cached)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def scrape(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        m = re.match(r"^(vllm:[^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


async def run_workload(
    base: str,
    model: str,
    prompts: list[str],
    rate: float,
    max_tokens: int,
    seed: int,
    sampling: dict[str, float] | None = None,
) -> tuple[list[Result], float]:
    """`sampling`: the requests' sampling fields (default greedy, temperature 0)."""
    sampling = {"temperature": 0.0} if sampling is None else sampling
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        tasks = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(one_request(http, base, model, p, max_tokens, sampling)))
            if rate != float("inf") and i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


@dataclass
class Summary:
    server: str
    workload: str
    num_requests: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    mean_prompt_tokens: float = 0.0
    usage_hit_rate: float = 0.0  # cached_tokens / prompt_tokens from the responses
    metrics_hit_rate: float | None = None  # vllm:prefix_cache_hits / queries deltas from /metrics


def summarize(server: str, workload: str, results: list[Result], duration: float, before: dict, after: dict) -> Summary:
    ok = [r for r in results if r.ok]

    def ms(xs: list[float]) -> dict:
        return {f"p{p}": round(1000 * pct(xs, p), 1) for p in (50, 90, 99)} | {
            "mean": round(1000 * statistics.fmean(xs), 1) if xs else float("nan")
        }

    prompt = sum(r.prompt_tokens for r in ok)
    q = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    h = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    return Summary(
        server,
        workload,
        len(results),
        len(results) - len(ok),
        round(duration, 2),
        round(len(ok) / duration, 3),
        round(sum(r.completion_tokens for r in ok) / duration, 2),
        ms([r.ttft for r in ok]),
        ms([r.tpot for r in ok]),
        ms([r.e2e for r in ok]),
        round(prompt / max(1, len(ok)), 1),
        round(sum(r.cached_tokens for r in ok) / max(1, prompt), 4),
        round(h / q, 4) if q else None,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Managed:
    """A server subprocess on 127.0.0.1, waited on via /health, terminated on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None, timeout: float = 600) -> None:
        self.name, self.base = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode}); log: {self.log.name}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > timeout:
                self.close()
                raise RuntimeError(f"{name} not healthy after {timeout}s; log: {self.log.name}")
            time.sleep(0.5)
        self.startup_s = time.time() - t0
        print(f"[{name}] up on {self.base} after {self.startup_s:.1f}s (log {self.log.name})", file=sys.stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def model_name(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


def bench_server(label: str, base: str, args, seed: int | None = None) -> list[Summary]:
    """Every workload once against `base`; `seed` (default --seed) fixes the prompts and arrivals."""
    seed = args.seed if seed is None else seed
    model = model_name(base)
    out = []
    # warm-up (not measured): first-request overheads, with text unrelated to the workloads
    asyncio.run(run_workload(base, model, make_prompts("unique", 2, 20, 5, seed=999), float("inf"), 4, 0))
    for i, kind in enumerate(args.workloads):
        prompts = make_prompts(kind, args.num_requests, args.prefix_words, args.suffix_words, seed=seed + i)
        before = scrape(base)
        sampling = {"temperature": args.temperature, "top_p": args.top_p}
        results, duration = asyncio.run(
            run_workload(base, model, prompts, args.request_rate, args.max_tokens, seed, sampling)
        )
        s = summarize(label, kind, results, duration, before, scrape(base))
        errors = [r.error for r in results if not r.ok]
        if errors:
            print(f"[{label}] {len(errors)} failed, e.g. {errors[0]}", file=sys.stderr)
        print_summary(s)
        out.append(s)
    return out


def print_summary(s: Summary) -> None:
    hr = f"{s.metrics_hit_rate:.3f}" if s.metrics_hit_rate is not None else "n/a"
    print(
        f"{s.server:9s} {s.workload:7s} n={s.num_requests:<3d} fail={s.failed:<2d} {s.duration_s:7.1f}s "
        f"{s.request_throughput:6.2f} req/s {s.output_throughput:7.1f} tok/s | "
        f"TTFT p50/p90/p99 {s.ttft_ms['p50']:7.0f}/{s.ttft_ms['p90']:7.0f}/{s.ttft_ms['p99']:7.0f} ms | "
        f"TPOT p50/p90/p99 {s.tpot_ms['p50']:6.0f}/{s.tpot_ms['p90']:6.0f}/{s.tpot_ms['p99']:6.0f} ms | "
        f"hit rate {s.usage_hit_rate:.3f} (metrics {hr}) | prompt {s.mean_prompt_tokens:.0f} tok",
        flush=True,
    )


def prefixkv_variants(args: argparse.Namespace) -> list[tuple[str, int | None, str, str | None]]:
    """(label, token budget, CPU thread policy, cudagraph_mode) of each prefixkv server to start."""
    variants = []
    for graphs in args.cudagraph_mode or [None]:
        for policy in args.cpu_thread_policy:
            for budget in args.max_num_batched_tokens or [None]:
                notes = ([] if budget is None else [f"budget {budget}"]) + ([] if policy == "adaptive" else [policy])
                notes += [] if graphs is None else [f"graphs {graphs}"]
                variants.append(("prefixkv" + (f" ({', '.join(notes)})" if notes else ""), budget, policy, graphs))
    return variants


def start_prefixkv(
    args: argparse.Namespace, budget: int | None, policy: str = "adaptive", graphs: str | None = None
) -> Managed:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "prefixkv.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-memory-bytes",
        args.kv_cache_memory_bytes,
        "--max-model-len",
        "2048",
        "--dtype",
        args.dtype,
        "--disable-uvicorn-access-log",
    ] + ([args.model] if args.model else [])
    if budget is not None:
        cmd += ["--max-num-batched-tokens", str(budget)]
    cmd += ["--cpu-thread-policy", policy]
    if graphs not in (None, "default"):
        cmd += ["--compilation-config", json.dumps({"cudagraph_mode": graphs})]
    return Managed("prefixkv", cmd, port, timeout=300)


def start_vllm(args: argparse.Namespace) -> Managed:
    port = free_port()
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.vllm_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        "2048",
        "--dtype",
        args.dtype,
        "--disable-uvicorn-access-log",
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    return Managed("vllm", cmd, port, env=env, timeout=600)


def print_medians(rounds: list[list[Summary]]) -> None:
    """Per server and workload, the median over rounds of each round's p50 and p90."""
    print(f"\nmedians over {len(rounds)} rounds (each round: every server once, same prompts and arrivals):")
    keys = [(s.server, s.workload) for s in rounds[0]]
    for server, workload in keys:
        same = [s for r in rounds for s in r if (s.server, s.workload) == (server, workload)]

        def med(field: str, q: str, same: list[Summary] = same) -> float:
            return statistics.median(getattr(s, field)[q] for s in same)

        print(
            f"{server:9s} {workload:7s} TTFT p50 {med('ttft_ms', 'p50'):6.0f} p90 {med('ttft_ms', 'p90'):6.0f} ms | "
            f"TPOT p50 {med('tpot_ms', 'p50'):5.0f} p90 {med('tpot_ms', 'p90'):5.0f} ms | "
            f"req/s {statistics.median(s.request_throughput for s in same):5.2f} | "
            f"per round TTFT p50 {[round(s.ttft_ms['p50']) for s in same]}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="benchmark a running server instead of starting prefixkv")
    ap.add_argument("--model", default=None, help="model for the started prefixkv server (default: embedded)")
    ap.add_argument("--workloads", nargs="+", default=["shared", "unique"], choices=["shared", "unique"])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=2.0, help="requests/s, Poisson; inf = all at once")
    ap.add_argument("--prefix-words", type=int, default=400, help="~1.2 tokens per word (default 400 = ~500 tokens)")
    ap.add_argument("--suffix-words", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    ap.add_argument("--kv-cache-memory-bytes", default="1G", help="for the started prefixkv server")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        nargs="+",
        default=None,
        help="for the started prefixkv server (its default: 2048, as vLLM's on CPU); several values: "
        "one prefixkv server per value, one after the other, same workloads",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype of both started servers (default float32)",
    )
    ap.add_argument(
        "--cpu-thread-policy",
        nargs="+",
        default=["adaptive"],
        choices=["adaptive", "fixed"],
        help="for the started prefixkv server (its default: adaptive); several values: one server per value",
    )
    ap.add_argument(
        "--cudagraph-mode",
        nargs="+",
        default=None,
        help="for the started prefixkv server on a GPU (compilation_config's cudagraph_mode, or `default`: "
        "decode steps, and mixed steps up to where their replay timed faster on the card; FULL_DECODE_ONLY "
        "decode steps only; FULL every mixed step too); several values: one server per value",
    )
    ap.add_argument("--no-prefixkv", action="store_true", help="only run the peer")
    ap.add_argument("--peer-vllm", action="store_true", help=f"also run `vllm serve` from {VLLM_PY}")
    ap.add_argument("--vllm-python", default=VLLM_PY)
    ap.add_argument("--vllm-model", default=VLLM_MODEL)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with several: start every server first, then each round runs every workload on each server in "
        "turn (prompts and arrivals seeded --seed + 1000 x round), and print the medians over rounds - "
        "for a machine whose speed drifts",
    )
    ap.add_argument("--json", default=None, help="write all summaries to this file")
    args = ap.parse_args(argv)
    summaries: list[Summary] = []

    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    vllm_missing = not os.path.exists(args.vllm_python) or not os.path.isdir(args.vllm_model)
    if args.rounds > 1:
        if args.base_url:
            ap.error("--rounds starts its own servers: not with --base-url")
        if args.peer_vllm and vllm_missing:
            ap.error(f"--peer-vllm: {args.vllm_python} or {args.vllm_model} missing")
        servers: list[tuple[str, Managed]] = []
        try:
            if not args.no_prefixkv:
                for label, budget, policy, graphs in prefixkv_variants(args):
                    servers.append((label, start_prefixkv(args, budget, policy, graphs)))
            if args.peer_vllm:
                servers.append(("vllm", start_vllm(args)))
            rounds = []
            for r in range(args.rounds):
                print(f"-- round {r + 1} of {args.rounds}", file=sys.stderr)
                rounds.append(
                    [s for label, srv in servers for s in bench_server(label, srv.base, args, args.seed + 1000 * r)]
                )
                summaries += rounds[-1]
            print_medians(rounds)
        finally:
            for _, srv in servers:
                srv.close()
    elif args.base_url:
        summaries += bench_server("server", args.base_url.rstrip("/"), args)
    elif not args.no_prefixkv:
        for label, budget, policy, graphs in prefixkv_variants(args):
            srv = start_prefixkv(args, budget, policy, graphs)
            try:
                summaries += bench_server(label, srv.base, args)
            finally:
                srv.close()

    if args.peer_vllm and args.rounds == 1:
        if vllm_missing:
            print(f"--peer-vllm: {args.vllm_python} or {args.vllm_model} missing; skipped", file=sys.stderr)
        else:
            try:
                srv = start_vllm(args)
            except RuntimeError as e:
                print(f"--peer-vllm: {e}", file=sys.stderr)
            else:
                try:
                    summaries += bench_server("vllm", srv.base, args)
                finally:
                    srv.close()

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [asdict(s) for s in summaries]}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
