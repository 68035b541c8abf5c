"""KV tiers below the pool: time to first token and hit rate with the pool alone, + a CPU tier,
+ a Redis tier, a warm restart against a disk / Redis tier vs a cold start, and the time to load
a block from each tier vs the time to recompute it.

    .venv/bin/python bench/tiers.py [--repeats 3] [--turns 3] [--redis redis://host:port/0]

Scenarios (SmolLM2-135M, float32, greedy; the pool is sized so that it thrashes):

* long document - the seed scenario (a 1,514-token table, then two questions), with two
  unrelated documents (~900 tokens each) asked about in between, so the table has left a pool
  of 100 blocks (1,600 tokens) when question 2 arrives. TTFT of question 2 per configuration.
* multi-turn chat - 6 conversations, `--turns` turns each, taken in turn (each turn: ~120 new
  user tokens after the previous turn's prompt and answer): 6 growing contexts through the same
  100-block pool. Median TTFT of turns 2+ and the hit rate (cached / prompt tokens).
* warm restart - a new engine (weights already in memory, so only the cache is cold) against
  the disk or Redis tier a previous engine filled, asked question 1 first: TTFT vs a cold start
  (question 1 of the long-document runs).
* per block - reading + checking + copying one block in from each tier, vs the prefill time per
  block of the cold question 1; and what a write-through save costs the engine thread (copy out,
  checksum, and the CPU tier's put or the slow tiers' enqueue).
* async vs sync loads - a fresh engine decodes a request while question 1 arrives and loads its
  table from the Redis tier a previous engine filled, once with the default asynchronous loads
  (a loader thread) and once with `?load=sync` (on the engine thread at admission): TTFT of
  question 1 and the longest gap between two tokens of the decoding request while it loads.

Without --redis, a redis-server (Debian's package) is started on a free local port and stopped
at the end. Prints medians; the numbers depend on the machine's load (printed).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.scenarios import LONG_PROMPT, age_question  # noqa: E402
from prefixkv.engine.llm_engine import LLMEngine  # noqa: E402
from prefixkv.engine_args import EngineArgs  # noqa: E402
from prefixkv.model import load_model  # noqa: E402
from prefixkv.sampling_params import SamplingParams  # noqa: E402

POOL_BLOCKS = 100
MAX_TOKENS = 16
WORDS = (
    "river mountain quiet engine paper lantern violet harbor copper signal garden winter orbit marble "
    "thunder canvas meadow silver anchor falcon ember willow summit prism"
).split()


def filler(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def new_engine(loaded, **kw) -> LLMEngine:
    args = EngineArgs(num_blocks=POOL_BLOCKS, dtype="float32", device="cpu", **kw)
    return LLMEngine(args, loaded=loaded)


def generate(engine: LLMEngine, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.error is None
    m = final.metrics
    return {
        "ttft": m.first_token_time - m.arrival_time,
        "cached": final.num_cached_tokens,
        "prompt": len(final.prompt_token_ids),
        "ids": final.prompt_token_ids,
        "out": final.outputs[0].token_ids,
    }


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def configs(redis_url: str) -> dict[str, dict]:
    return {
        "pool only": {},
        "+ CPU tier (1 GiB)": {"kv_offloading_size": 1.0},
        "+ Redis tier": {"kv_tier": redis_url},
    }


def clear_redis(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()


def long_document(loaded, redis_url: str, repeats: int) -> dict[str, float]:
    q1, q2 = LONG_PROMPT + age_question("John Doe"), LONG_PROMPT + age_question("Zack Blue")
    others = [filler(seed, 850) + "\nQuestion: which word comes first?\nAnswer:" for seed in (7, 8)]
    print("long document: question 2 after two unrelated documents evicted the table", flush=True)
    ref = None
    result = {}
    colds: list[float] = []
    for name, kw in configs(redis_url).items():
        ttfts, cached = [], []
        for _ in range(repeats):
            clear_redis(redis_url)
            eng = new_engine(loaded, **kw)
            first = generate(eng, q1)
            colds.append(first["ttft"])
            for other in others:
                generate(eng, other)
            r = generate(eng, q2)
            if eng.tiers is not None:
                eng.tiers.close()
            ref = ref or r["out"]
            assert r["out"] == ref, "outputs differ between configurations"
            ttfts.append(r["ttft"])
            cached.append(r["cached"])
        result[name] = med(ttfts)
        print(
            f"  {name:<22} q2 TTFT {med(ttfts):6.3f} s  cached {cached[0]:>5}/{r['prompt']}"
            f"  (q1 cold {first['ttft']:.3f} s)",
            flush=True,
        )
    result["q1 cold"] = med(colds)
    return result


def multi_turn(loaded, redis_url: str, turns: int) -> None:
    print(f"multi-turn chat: 6 conversations x {turns} turns through a {POOL_BLOCKS}-block pool", flush=True)
    tok = loaded.tokenizer
    users = [[tok.encode(filler(100 * c + t, 90), add_special_tokens=False) for t in range(turns)] for c in range(6)]
    ref: list[list[int]] | None = None
    for name, kw in configs(redis_url).items():
        clear_redis(redis_url)
        eng = new_engine(loaded, **kw)
        contexts: list[list[int]] = [[] for _ in range(6)]
        ttfts, hit, total, outs = [], 0, 0, []
        for t in range(turns):
            for c in range(6):
                prompt = contexts[c] + users[c][t]
                r = generate(eng, prompt)
                contexts[c] = prompt + r["out"]
                outs.append(r["out"])
                if t:
                    ttfts.append(r["ttft"])
                    hit += r["cached"]
                    total += r["prompt"]
        ref = ref or outs
        assert outs == ref, "outputs differ between configurations"
        extra = ""
        if eng.tiers is not None:
            t = eng.get_stats().kv_tiers[0]
            extra = f"  tier hits {t.hits} blocks, saves {t.saves}"
            eng.tiers.close()
        print(f"  {name:<22} turns 2+: TTFT median {med(ttfts):6.3f} s  hit rate {hit / total:6.1%}{extra}", flush=True)


def warm_restart(loaded, redis_url: str, repeats: int, cold_ttft: float) -> None:
    q1 = LONG_PROMPT + age_question("John Doe")
    print("warm restart: question 1 on a fresh engine", flush=True)
    print(f"  {'cold start':<22} TTFT {cold_ttft:6.3f} s  (question 1 of the long-document runs)", flush=True)
    folder = tempfile.mkdtemp(prefix="prefixkv-bench-kv-")
    try:
        for name, spec in (("disk tier", f"disk:{folder}"), ("Redis tier", redis_url)):
            ttfts, cached = [], 0
            for _ in range(repeats):
                if spec is not None:  # a previous engine filled the tier
                    clear_redis(redis_url)
                    shutil.rmtree(folder, ignore_errors=True)
                    prev = new_engine(loaded, kv_tier=spec)
                    generate(prev, q1)
                    prev.tiers.close()  # flushes its writes
                eng = new_engine(loaded, **({"kv_tier": spec} if spec else {}))
                r = generate(eng, q1)
                ttfts.append(r["ttft"])
                cached = r["cached"]
                if eng.tiers is not None:
                    eng.tiers.close()
            print(f"  {name:<22} TTFT {med(ttfts):6.3f} s  cached {cached:>5}/{r['prompt']}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def per_block(loaded, redis_url: str, repeats: int, cold_ttft: float) -> None:
    q1 = LONG_PROMPT + age_question("John Doe")
    folder = tempfile.mkdtemp(prefix="prefixkv-bench-kv-")
    print("per block: load from a tier (read + check + copy in) vs recompute", flush=True)
    try:
        for name, kw in (
            ("CPU", {"kv_offloading_size": 1.0}),
            ("disk", {"kv_tier": f"disk:{folder}"}),
            ("Redis", {"kv_tier": redis_url}),
        ):
            clear_redis(redis_url)
            eng = new_engine(loaded, **kw)
            r = generate(eng, q1)
            eng.tiers.flush()
            kv, sched, tiers = eng.scheduler.kv_cache_manager, eng.scheduler, eng.tiers
            from prefixkv.request import Request

            req = Request("probe", r["ids"], sampling_params=SamplingParams())
            hashes = kv.get_block_hashes(req)
            extras = kv.get_block_chain(req).extras
            n = (len(r["ids"]) - 1) // eng.config.block_size
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                found = tiers.lookup(hashes, r["ids"], extras, eng.config.block_size, 0, n)
                eng.runner.kv_connector.load(tiers.load_plan(list(range(len(found))), found))
                times.append((time.perf_counter() - t0) / max(1, len(found)))
            # the write-through cost on the engine thread: copy out + seal + put (CPU) or enqueue
            saves = [tiers.plan_save(b, bytes([b]) * 32, r["ids"], extras, eng.config.block_size, 0) for b in range(n)]
            t0 = time.perf_counter()
            for saved in eng.runner.kv_connector.save([sv for sv in saves if sv is not None]).result():
                tiers.store(saved)
            save_s = (time.perf_counter() - t0) / n
            kv.free(req)
            assert len(found) == n, (name, len(found), n)
            tiers.close()
            del sched
            print(
                f"  {name:<6} load {med(times) * 1e3:7.3f} ms per block ({n} blocks); save on the engine thread"
                f" {save_s * 1e3:.3f} ms per block",
                flush=True,
            )
        bs = 16
        print(f"  recompute {cold_ttft / (len(r['ids']) / bs) * 1e3:7.3f} ms per block (cold prefill / blocks)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def async_vs_sync(loaded, redis_url: str, repeats: int) -> None:
    q1 = LONG_PROMPT + age_question("John Doe")
    print("async vs sync loads: question 1 from the Redis tier while another request decodes", flush=True)
    ref = None
    # a 5 s socket timeout: on a loaded machine the default 0.5 s can expire and take the tier down
    for name, spec in (
        ("sync (load=sync)", f"{redis_url}?timeout=5&load=sync"),
        ("async (default)", f"{redis_url}?timeout=5"),
    ):
        ttfts, gaps, steps = [], [], []
        for _ in range(repeats):
            clear_redis(redis_url)
            prev = new_engine(loaded, kv_tier=f"{redis_url}?timeout=5")
            generate(prev, q1)
            prev.tiers.close()  # flushes its writes
            eng = new_engine(loaded, kv_tier=spec)
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            decoding = eng.add_request("Once upon a time", params)
            last_token = None
            while last_token is None or len(steps) < 3:  # decoding, with a few steps timed
                if any(o.request_id == decoding for o in eng.step()):
                    now = time.perf_counter()
                    if last_token is not None:
                        steps.append(now - last_token)
                    last_token = now
            rid = eng.add_request(q1, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
            arrived, first, gap = time.perf_counter(), None, 0.0
            while first is None:
                outs = eng.step()
                now = time.perf_counter()
                for o in outs:
                    if o.request_id == decoding:
                        gap = max(gap, now - last_token)
                        last_token = now
                    elif o.request_id == rid:
                        first = now
                        out = o
            gap = max(gap, first - last_token)
            eng.abort_request(decoding)
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.request_id == rid:
                        out = o
            ref = ref or out.outputs[0].token_ids
            assert out.outputs[0].token_ids == ref, "outputs differ between sync and async loads"
            assert out.num_cached_tokens == 1520, f"question 1 cached {out.num_cached_tokens} tokens, not 1520"
            ttfts.append(first - arrived)
            gaps.append(gap)
            eng.tiers.close()
        print(
            f"  {name:<22} q1 TTFT {med(ttfts):6.3f} s  longest decode gap while it loads {med(gaps) * 1e3:6.1f} ms"
            f"  (decode step {med(steps) * 1e3:.1f} ms)",
            flush=True,
        )


def start_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: apt-get install redis-server, or pass --redis URL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="prefixkv-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0", workdir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--redis", help="an existing Redis database (flushed!) instead of starting redis-server")
    ap.add_argument("--skip", nargs="*", default=[], choices=["long", "chat", "restart", "block", "async"])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    proc = workdir = None
    url = args.redis
    if url is None:
        proc, url, workdir = start_redis()
    try:
        loaded = load_model(None, dtype=torch.float32, device="cpu")
        print(f"KV tiers, SmolLM2-135M float32, load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
        generate(new_engine(loaded), "Hello, my name is", 4)  # warm-up
        if "async" not in args.skip:
            async_vs_sync(loaded, url, args.repeats)
        cold = float("nan") if "long" in args.skip else long_document(loaded, url, args.repeats)["q1 cold"]
        if "block" not in args.skip:
            per_block(loaded, url, args.repeats, cold)
        if "restart" not in args.skip:
            warm_restart(loaded, url, args.repeats, cold)
        if "chat" not in args.skip:
            multi_turn(loaded, url, args.turns)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            shutil.rmtree(workdir or "", ignore_errors=True)


if __name__ == "__main__":
    main()
