"""Speculative decoding's n-gram drafts against plain decoding, on chat prompts whose answers
repeat their input more or less: editing a code listing (most of the answer is the listing),
quoting a manual, answering a question about it, and a story with no document at all.

    .venv/bin/python bench/spec_decode.py [--rounds 3] [--max-tokens 128] [--dtype float32]
        [--batch 1] [--spec '{"method": "ngram", ...}'] [--peer-vllm]

The default model, greedy; each round runs every prompt on both engines in turn (plain first in
odd rounds, drafts first in even ones). Prints, per prompt, the milliseconds per output token after
the first (the decode phase) - medians over the rounds - their ratio, the drafts kept, and whether
both engines' tokens are equal (they must be). With --peer-vllm, vLLM-CPU (bench/peers/README.md)
runs the same token ids with the same speculative_config in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe  # noqa: E402
from bench.peer_runner import DEFAULT_VLLM_PYTHON, available, run_peer  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
LISTING = '''def moving_average(values, window):
    """The mean of each run of `window` values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def clamp(x, low, high):
    """x, kept within [low, high]."""
    if x < low:
        return low
    if x > high:
        return high
    return x
'''


def conversations() -> dict[str, list[dict[str, str]]]:
    manual = (ROOT / "examples" / "manual.md").read_text()
    return {
        "edit code": [
            {
                "role": "user",
                "content": f"{LISTING}\nRename `values` to `samples` in this code. Reply with all of it.",
            }
        ],
        "quote manual": [
            {"role": "user", "content": f"{manual}\nQuote the first section of the manual above, word for word."}
        ],
        "question on manual": [{"role": "user", "content": f"{manual}\nHow do I pair the outdoor sensor?"}],
        "story, no document": [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    }


def prompt_ids(llm: LLM) -> dict[str, list[int]]:
    tok = llm.llm_engine.tokenizer
    return {
        name: tok.encode(
            tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        for name, conv in conversations().items()
    }


def decode_ms_per_token(llm: LLM, ids: list[int], params: SamplingParams, batch: int) -> tuple[float, list[int]]:
    """Wall time after the first token over the tokens after it (the batch's slowest request)."""
    outs = llm.generate([{"prompt_token_ids": ids}] * batch, params, use_tqdm=False)
    end = time.time()  # the clock of the outputs' metrics
    first = max(o.metrics.first_token_time or end for o in outs)
    n = max(len(o.outputs[0].token_ids) for o in outs)
    return 1000 * (end - first) / max(n - 1, 1), list(outs[0].outputs[0].token_ids)


def vllm_side(prompts: dict[str, list[int]], args: argparse.Namespace) -> dict[str, dict]:
    """vLLM-CPU's runs of the same token ids, plain and with the same speculative_config, each
    engine in a child process (bench/peers/vllm_spec_decode.py); {} where the peer is not set up."""
    if args.dtype != "float32" or args.batch != 1:
        print("vLLM's side runs float32 at batch 1 only: skipped", file=sys.stderr)
        return {}
    if not available(DEFAULT_VLLM_PYTHON):
        print(f"no vLLM peer at {DEFAULT_VLLM_PYTHON} (bench/peers/README.md): skipped", file=sys.stderr)
        return {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    out: dict[str, dict] = {}
    for mode in ("base", "spec"):
        flags = [
            "--prompts",
            f.name,
            "--mode",
            mode,
            "--rounds",
            str(args.rounds),
            "--max-tokens",
            str(args.max_tokens),
        ]
        got = run_peer(DEFAULT_VLLM_PYTHON, "vllm_spec_decode.py", [*flags, "--spec", json.dumps(args.spec)])
        if got is None:
            return {}
        out[mode] = got["prompts"]
    os.unlink(f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", type=json.loads, default=SPEC)
    ap.add_argument("--peer-vllm", action="store_true")
    args = ap.parse_args()
    print(describe(), flush=True)
    print(
        f"speculative_config {json.dumps(args.spec)}; {args.dtype}; batch {args.batch}; greedy, "
        f"{args.max_tokens} tokens at most"
    )
    plain = LLM(model=None, dtype=args.dtype)
    spec = LLM(model=None, dtype=args.dtype, speculative_config=args.spec)
    prompts = prompt_ids(plain)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {"plain": plain, "drafts": spec}
    times: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list[int]] = {}
    kept: dict[str, tuple[int, int]] = {}
    for llm in engines.values():  # warm: kernels chosen, caches filled
        llm.generate(
            [{"prompt_token_ids": prompts["story, no document"]}], SamplingParams(max_tokens=4), use_tqdm=False
        )
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name, ids in prompts.items():
            for engine in order:
                llm = engines[engine]
                stats = llm.llm_engine.scheduler.spec_stats
                before = (stats.num_accepted_tokens, stats.num_draft_tokens)
                llm.reset_prefix_cache()
                ms, out = decode_ms_per_token(llm, ids, params, args.batch)
                times.setdefault((name, engine), []).append(ms)
                tokens[(name, engine)] = out
                if engine == "drafts":
                    kept[name] = (stats.num_accepted_tokens - before[0], stats.num_draft_tokens - before[1])
                print(f"round {r + 1} {name:20s} {engine:6s} {ms:6.2f} ms/token, {len(out)} tokens", flush=True)
    peer: dict[str, dict] = {}
    if args.peer_vllm:
        peer = vllm_side(prompts, args)
    print()
    if peer:
        print("| prompt | vLLM plain ms/token | vLLM drafts ms/token | vLLM speed-up | vLLM drafts kept | vLLM equal |")
        print("|---|---:|---:|---:|---:|---|")
        for name in prompts:
            a, b = peer["base"][name], peer["spec"][name]
            c = b["counters"]
            kept_d = (
                f"{c.get('vllm:spec_decode_num_accepted_tokens', 0)}/{c.get('vllm:spec_decode_num_draft_tokens', 0)}"
            )
            same = "yes" if a["tokens"] == b["tokens"] else "NO"
            ratio = a["ms_per_token"] / b["ms_per_token"]
            print(f"| {name} | {a['ms_per_token']:.2f} | {b['ms_per_token']:.2f} | {ratio:.2f}x | {kept_d} | {same} |")
        print()
    print("| prompt | tokens | plain ms/token | drafts ms/token | speed-up | drafts kept | equal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in prompts:
        a, b = statistics.median(times[(name, "plain")]), statistics.median(times[(name, "drafts")])
        k, d = kept[name]
        same = tokens[(name, "plain")] == tokens[(name, "drafts")]
        n = len(tokens[(name, "plain")])
        print(f"| {name} | {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {k}/{d} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
