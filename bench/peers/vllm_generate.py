"""Peer benchmark: end-to-end generation with vLLM (CPU) on the shared scenarios.

Run with the vLLM virtual environment:

    peers/vllm/bin/python bench/peers/vllm_generate.py --scenario seed --repeats 3
    peers/vllm/bin/python bench/peers/vllm_generate.py --scenario shared_prefix --repeats 3

(--model defaults to peers/smollm2-135m-hf, built by make_peer_model.py; $PREFIXKV_PEERS moves peers/)

Prompts come from bench/scenarios.py (the same prompts prefixkv's benchmarks use). Greedy
(temperature 0), float32, enforce_eager, max_model_len 4096. Prints one JSON line to stdout
(vLLM's own logging goes to stderr).

Environment defaults (set before vLLM is imported; override by exporting them):
VLLM_CPU_KVCACHE_SPACE=2, VLLM_CPU_OMP_THREADS_BIND=0-1, and VLLM_ENABLE_V1_MULTIPROCESSING=0
(engine core in this process: on a 2-core machine a separate busy engine-core process would
compete with the model for the cores; it also makes RequestOutput.metrics available directly).

Scenarios:
* seed: the vLLM docs' prefix-caching example. For each max_tokens in --max-tokens (100 and
  32), each repeat resets the prefix cache, then asks question 1 (John Doe; cold) and question
  2 (Zack Blue; the table should come from the cache). Per question: time to first token
  (RequestOutput.metrics.first_token_latency, measured by vLLM from arrival to first token),
  total llm.generate() wall time, num_cached_tokens, prompt/output token counts, output text.
* shared_prefix: 32 prompts sharing one ~1,600-token document submitted as one batch
  (llm.generate(list)), 16 output tokens each; total time and output tokens/s, with prefix
  caching on and off (each mode in its own engine, run as a child process of this script).
  The prefix cache is reset before every repeat.
A warm-up generation (an unrelated short prompt) runs after start-up and before any timing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import scenarios  # noqa: E402
from peer_common import PEERS_DIR, add_scenario_arguments, timed_repeats  # noqa: E402

DEFAULT_MODEL = str(PEERS_DIR / "smollm2-135m-hf")
ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # keep stdout for the JSON line
}


def _build(model: str, prefix_caching: bool, block_size: int | None):
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM
    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        enable_prefix_caching=prefix_caching,
        seed=0,
        disable_log_stats=False,  # fills RequestOutput.metrics (first-token latency)
        **({"block_size": block_size} if block_size else {}),
    )
    startup = time.perf_counter() - t1
    cfg = llm.llm_engine.vllm_config
    info = {
        "engine": "vllm",
        "version": vllm.__version__,
        "model": model,
        "dtype": "float32",
        "prefix_caching": prefix_caching,
        "block_size": cfg.cache_config.block_size,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "import_s": round(t_import, 3),
        "startup_s": round(startup, 3),
        "env": {k: os.environ.get(k) for k in ENV_DEFAULTS},
    }
    return llm, info


def _warmup(llm):
    from vllm import SamplingParams
    t0 = time.perf_counter()
    llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    return round(time.perf_counter() - t0, 3)


def _ttft(out) -> float:
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "first_token_latency", 0.0):
        # vLLM 0.32 fills metrics when disable_log_stats=False; older versions may not.
        raise RuntimeError("RequestOutput.metrics.first_token_latency missing in this vLLM")
    return m.first_token_latency


def run_seed(llm, repeats: int, max_tokens_list: list[int]) -> dict:
    from vllm import SamplingParams
    prompts = scenarios.seed_prompts()
    results = {}
    for max_tokens in max_tokens_list:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        runs = []
        for _ in range(repeats):
            assert llm.reset_prefix_cache(), "reset_prefix_cache failed"
            qs = []
            for prompt in prompts:
                t0 = time.perf_counter()
                out = llm.generate([prompt], sp, use_tqdm=False)[0]
                total = time.perf_counter() - t0
                ttft = _ttft(out)
                qs.append({
                    "ttft_s": round(ttft, 6),
                    "total_s": round(total, 6),
                    "prompt_tokens": len(out.prompt_token_ids),
                    "cached_tokens": out.num_cached_tokens,
                    "output_tokens": len(out.outputs[0].token_ids),
                    "finish_reason": out.outputs[0].finish_reason,
                    "text": out.outputs[0].text,
                })
            runs.append(qs)
        summary = scenarios.summarize_seed_runs(runs)
        results[str(max_tokens)] = summary
    return {"scenario": "seed", "repeats": repeats,
            "ttft_source": "RequestOutput.metrics.first_token_latency", "max_tokens": results}


def run_shared(llm, repeats: int, max_tokens: int, num_prompts: int) -> dict:
    from vllm import SamplingParams
    prompts = scenarios.shared_prefix_prompts(num_prompts)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def reset() -> None:
        assert llm.reset_prefix_cache(), "reset_prefix_cache failed"

    def run_once() -> list[dict]:
        return [{"text": o.outputs[0].text, "prompt_tokens": len(o.prompt_token_ids),
                 "output_tokens": len(o.outputs[0].token_ids), "cached_tokens": o.num_cached_tokens or 0,
                 "ttft_s": o.metrics.first_token_latency if o.metrics is not None else None}
                for o in llm.generate(prompts, sp, use_tqdm=False)]

    return {"scenario": "shared_prefix", "repeats": repeats, "num_prompts": len(prompts),
            "max_tokens": max_tokens, **timed_repeats(repeats, reset, run_once)}


def child(args) -> dict:
    llm, info = _build(args.model, args.prefix_caching == "on", args.block_size)
    info["warmup_s"] = _warmup(llm)
    if args.scenario == "seed":
        info.update(run_seed(llm, args.repeats, args.max_tokens or [scenarios.SEED_MAX_TOKENS,
                                                                    scenarios.SEED_MAX_TOKENS_SHORT]))
    else:
        info.update(run_shared(llm, args.repeats, (args.max_tokens or [scenarios.SHARED_MAX_TOKENS])[0],
                               args.num_prompts))
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description="vLLM end-to-end peer benchmark")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="HF model folder")
    add_scenario_arguments(ap, "default: on for seed, both for shared_prefix (each mode in a child process)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV block size (default: vLLM's CPU default, 128)")
    args = ap.parse_args(argv)
    if args.prefix_caching is None:
        args.prefix_caching = "on" if args.scenario == "seed" else "both"
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)

    if args.prefix_caching != "both":
        out = child(args)
        out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)  # shared machine: >2 = contention
        print(json.dumps(out), flush=True)
        return
    # Two engines in one process is fragile in vLLM; run each mode in a fresh child process.
    modes = {}
    for mode in ("on", "off"):
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--scenario",
               args.scenario, "--repeats", str(args.repeats), "--prefix-caching", mode,
               "--num-prompts", str(args.num_prompts)]
        if args.max_tokens:
            cmd += ["--max-tokens", *map(str, args.max_tokens)]
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        modes[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = modes["on"], modes["off"]
    combined = {"engine": "vllm", "version": on["version"], "scenario": args.scenario,
                "prefix_caching_on": on, "prefix_caching_off": off}
    if args.scenario == "shared_prefix":
        combined["speedup_on_vs_off"] = round(off["seconds_median"] / on["seconds_median"], 3)
        combined["texts_identical_on_off"] = on["texts"] == off["texts"]
    print(json.dumps(combined), flush=True)


if __name__ == "__main__":
    main()
