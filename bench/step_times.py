"""Offline prefill and decode times through each engine's own `LLM.generate`, the same script for
prefixkv and for vLLM (run it with each engine's Python): the time of one cold 478-token prompt
with one output token (prefix caching off), and the time per decode step at each of --batches (1
and 8) after --context-token prompts (256) ((time of 33 output tokens - time of 17) / 16, see
DECODE_STEPS). Prompts are random token ids (seeded), the same for both engines; every request
greedy unless --sampling gives SamplingParams fields (`--sampling temperature=0.7,top_p=0.9`: both
engines sample). Medians; one JSON line at the end.

    .venv/bin/python bench/step_times.py --dtype bfloat16
    peers/vllm/bin/python bench/step_times.py --engine vllm --dtype bfloat16

vLLM runs as `vllm serve` would on this machine (its compiled model, not eager), engine core in
the process, `VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1`; model: peers/smollm2-135m-hf
(bench/peers/README.md), the HF copy of the GGUF prefixkv embeds, or `--model DIR`, an HF folder
both engines load (bench/device/random_checkpoint.py writes model shapes users serve).

Side by side in one command (`--peer-vllm --rounds N`): each round runs both engines, each in a
fresh process of its own Python, the order rotated every round (so that the machine's drift falls
on both), and the table prints each figure's median over the rounds, every round's value and the
ratio prefixkv / vLLM. `--kernels-off` adds prefixkv with `PREFIXKV_CPU_KERNELS=0` (PyTorch's
kernels alone) to the same rounds, and the ratio prefixkv / kernels off; `--against TREE`
prefixkv at another tree (a worktree of the commit before a change), and the ratio to it:

    .venv/bin/python bench/step_times.py --dtype float32 --peer-vllm --rounds 5 --batches 1
    .venv/bin/python bench/step_times.py --dtype float32 --peer-vllm --kernels-off --rounds 6
    .venv/bin/python bench/step_times.py --dtype float32 --peer-vllm --against /tmp/base --rounds 3

Every figure also prints its fraction of this machine's ceiling (bench/ceiling.py, measured in
the same process first; `--no-ceiling` skips it): a prefill as FLOP/s achieved over the dtype's
GEMM FLOP/s, a decode step as the bytes it must read (every weight once, each sequence's K and V)
per second over the memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.ceiling import Ceiling, decode_bytes, fraction, measure, prefill_flops  # noqa: E402
from bench.machine import EMULATIONS, describe, emulate  # noqa: E402
from bench.peer_runner import DEFAULT_VLLM_MODEL, DEFAULT_VLLM_PYTHON, available  # noqa: E402


def hf_shape(folder: str) -> SimpleNamespace:
    """The shape fields bench/ceiling.py counts work with, from an HF folder's config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    return SimpleNamespace(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        num_hidden_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
    )


def ceiling_lines(
    result: dict, shape: SimpleNamespace, args: argparse.Namespace, batches: list[int], ceiling: Ceiling
) -> list[str]:
    """Each figure of `result` as a fraction of `ceiling` (bench/ceiling.py's measure())."""
    import torch

    dtype = getattr(torch, args.dtype)
    peak, bandwidth = ceiling.flops_of(dtype), ceiling.bytes_per_s
    flops = prefill_flops(shape, args.prompt) / (result[f"prefill_{args.prompt}_ms"] / 1e3)
    lines = [
        f"ceiling ({args.dtype} GEMM {peak / 1e9:.0f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s; bench/ceiling.py):",
        f"  prefill {args.prompt} tokens: {flops / 1e9:.0f} GFLOP/s, {fraction(flops, peak)}",
    ]
    for b in batches:
        rate = decode_bytes(shape, dtype, b, args.context) / (result[f"decode_batch{b}_ms"] / 1e3)
        lines.append(f"  decode batch {b}: reads {rate / 1e9:.1f} GB/s, {fraction(rate, bandwidth)}")
    return lines


def sampling_fields(text: str) -> dict[str, float | int]:
    """--sampling's "temperature=0.7,top_p=0.9" as SamplingParams fields."""
    fields: dict[str, float | int] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty"):
            raise argparse.ArgumentTypeError(f"--sampling: {key!r} is not a field this script passes")
        fields[key] = int(value) if key == "top_k" else float(value)
    return fields


def sampling_text(fields: dict[str, float | int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fields.items()) if fields else "greedy"


# A decode step is timed as (time of 33 output tokens - time of 17) / 16, past every prompt's
# prefill, not against one output token: a scheduler that prefills in chunks (vLLM: 4,096 tokens a
# step on a CPU) runs the first sequences' decode steps inside the later prompts' prefill steps,
# and those steps then cost nothing in the difference (docs/benchmarks.md, "Zen 3 again").
DECODE_STEPS = 16

KERNELS_OFF = "prefixkv, kernels off"
AGAINST = "prefixkv, --against"


def side_by_side(args: argparse.Namespace, batches: list[int]) -> None:
    """--peer-vllm: the engines, each round in fresh processes, the order rotated every round."""
    if not available(args.vllm_python):
        sys.exit(f"--peer-vllm: no vLLM Python at {args.vllm_python} (bench/peers/README.md)")
    common = ["--dtype", args.dtype, "--prompt", str(args.prompt), "--reps", str(args.reps)]
    common += ["--batches", args.batches, "--context", str(args.context), "--no-ceiling"]
    if args.sampling:
        common += ["--sampling", ",".join(f"{k}={v}" for k, v in args.sampling.items())]
    ours = [sys.executable, os.path.abspath(__file__), "--model", args.model, *common]
    theirs = [args.vllm_python, os.path.abspath(__file__), "--engine", "vllm", "--model", args.model, *common]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    contenders = {"prefixkv": (ours, env), "vllm": (theirs, env)}
    if args.kernels_off:  # the same engine on PyTorch's kernels alone: what the native ones must beat
        contenders[KERNELS_OFF] = (ours, dict(env, PREFIXKV_CPU_KERNELS="0"))
    if args.against:  # prefixkv at another tree (a commit's worktree): what a change bought
        script = os.path.join(os.path.abspath(args.against), "bench", "step_times.py")
        contenders[AGAINST] = ([sys.executable, script, "--model", args.model, *common], env)
    names = list(contenders)
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            command, name_env = contenders[name]
            proc = subprocess.run(command, capture_output=True, text=True, env=name_env, timeout=3600)
            if proc.returncode != 0:
                sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rounds[name].append(result)
            print(f"round {r + 1} {name}: {proc.stdout.strip().splitlines()[-2]}", flush=True)
    keys = [f"prefill_{args.prompt}_ms"] + [f"decode_batch{b}_ms" for b in batches]
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in rounds.items()}
    how = f"{args.dtype}, {sampling_text(args.sampling)}"
    print(f"\n{how}, medians of {args.rounds} rounds (each round's figure is itself a median):")
    off = [KERNELS_OFF] * args.kernels_off + [AGAINST] * bool(args.against)
    header = ["figure", "prefixkv", "vLLM-CPU", *off, "prefixkv / vLLM"]
    header += [f"prefixkv / {name.removeprefix('prefixkv, ')}" for name in off] + [f"rounds, {name}" for name in names]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (3 + 2 * len(off)) + "---|" * len(names))
    for k in keys:
        m = {name: medians[name][k] for name in names}
        cells = [f"{m['prefixkv']:.1f}", f"{m['vllm']:.1f}"] + [f"{m[name]:.1f}" for name in off]
        cells += [f"{m['prefixkv'] / m['vllm']:.3f}"] + [f"{m['prefixkv'] / m[name]:.3f}" for name in off]
        cells += [", ".join(f"{x[k]:.1f}" for x in rounds[name]) for name in names]
        print(f"| {k} | " + " | ".join(cells) + " |")
    loads = [x["load_average"] for rs in rounds.values() for x in rs]
    print(f"load average at the runs' ends: {min(loads):.2f}-{max(loads):.2f}")
    if args.ceiling:  # one measurement for every engine's figures
        import torch

        shape, ceiling = hf_shape(args.model), measure((getattr(torch, args.dtype),), quick=True)
        for name in names:
            print(name, "- " + "\n".join(ceiling_lines(medians[name], shape, args, batches, ceiling)))
    print(json.dumps({"dtype": args.dtype, "medians": medians, "rounds": rounds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="prefixkv", choices=["prefixkv", "vllm"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=478)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence")
    ap.add_argument(
        "--model",
        default=DEFAULT_VLLM_MODEL,
        help="an HF folder both engines load (default: the HF copy of the embedded model; prefixkv reads the GGUF)",
    )
    ap.add_argument("--peer-vllm", action="store_true", help="both engines side by side, --rounds times")
    ap.add_argument("--rounds", type=int, default=None, help="with --peer-vllm: rounds of both engines (3)")
    ap.add_argument("--vllm-python", default=None, help=f"with --peer-vllm: vLLM's Python ({DEFAULT_VLLM_PYTHON})")
    ap.add_argument(
        "--kernels-off",
        action="store_true",
        help="with --peer-vllm: prefixkv with PREFIXKV_CPU_KERNELS=0 as a third contender in the same rounds",
    )
    ap.add_argument(
        "--against",
        metavar="TREE",
        help="with --peer-vllm: prefixkv at another tree (git worktree add /tmp/base COMMIT) in the same rounds",
    )
    ap.add_argument(
        "--emulate",
        choices=sorted(EMULATIONS),
        help="run prefixkv as on a CPU with only these instructions (bench/machine.py; not with --peer-vllm)",
    )
    ap.add_argument(
        "--sampling",
        type=sampling_fields,
        default={},
        metavar="K=V,...",
        help="SamplingParams fields of every request, both engines (e.g. temperature=0.7,top_p=0.9); default greedy",
    )
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip the ceiling fractions")
    args = ap.parse_args()
    if args.emulate and (args.peer_vllm or args.engine != "prefixkv"):
        sys.exit("--emulate applies to prefixkv alone: vLLM's own build uses every instruction of this CPU")
    emulate(args.emulate)
    print(describe(), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    if args.peer_vllm:
        if args.engine != "prefixkv":
            sys.exit("--peer-vllm runs both engines: not with --engine")
        args.rounds = 3 if args.rounds is None else args.rounds
        args.vllm_python = args.vllm_python or DEFAULT_VLLM_PYTHON
    elif args.rounds is not None or args.vllm_python is not None or args.kernels_off:
        sys.exit("--rounds, --vllm-python and --kernels-off apply only with --peer-vllm")
    if (
        args.reps < 1
        or args.prompt < 1
        or args.context < 1
        or min(batches) < 1
        or (args.rounds is not None and args.rounds < 1)
    ):
        sys.exit("--reps, --prompt, --context, --rounds and every batch must be at least 1")
    if args.peer_vllm:
        side_by_side(args, batches)
        return

    max_len = max(2048, args.prompt + 64)
    if args.engine == "vllm":
        for key, value in {
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        }.items():
            os.environ.setdefault(key, value)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max_len, enable_prefix_caching=False)

        def as_prompt(ids: list[int]) -> object:
            return TokensPrompt(prompt_token_ids=ids)

        def generate(prompts: list[object], max_tokens: int) -> None:
            params = SamplingParams(**{"temperature": 0, **args.sampling}, max_tokens=max_tokens, ignore_eos=True)
            llm.generate(prompts, params, use_tqdm=False)
    else:
        from prefixkv import LLM, SamplingParams

        # the default HF folder is vLLM's copy of the GGUF prefixkv embeds: prefixkv loads its own
        model = None if args.model == DEFAULT_VLLM_MODEL else args.model
        llm = LLM(model=model, dtype=args.dtype, max_model_len=max_len, enable_prefix_caching=False)

        def as_prompt(ids: list[int]) -> object:
            return {"prompt_token_ids": ids}

        def generate(prompts: list[object], max_tokens: int) -> None:
            params = SamplingParams(**{"temperature": 0, **args.sampling}, max_tokens=max_tokens, ignore_eos=True)
            llm.generate(prompts, params)

    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    generate([as_prompt(ids(args.prompt))], 1)  # warm-up
    prefill = []
    for _ in range(args.reps):
        prompt = as_prompt(ids(args.prompt))
        t0 = time.perf_counter()
        generate([prompt], 1)
        prefill.append(time.perf_counter() - t0)
    result = {"engine": args.engine, "dtype": args.dtype, f"prefill_{args.prompt}_ms": statistics.median(prefill) * 1e3}
    for batch in batches:
        steps = []
        for _ in range(3):
            prompts = [as_prompt(ids(args.context)) for _ in range(batch)]
            t0 = time.perf_counter()
            generate(prompts, 1 + DECODE_STEPS)
            first = time.perf_counter() - t0
            prompts = [as_prompt(ids(args.context)) for _ in range(batch)]
            t0 = time.perf_counter()
            generate(prompts, 1 + 2 * DECODE_STEPS)
            steps.append((time.perf_counter() - t0 - first) / DECODE_STEPS)
        result[f"decode_batch{batch}_ms"] = statistics.median(steps) * 1e3
    steps_text = ", ".join(f"batch {b} {result[f'decode_batch{b}_ms']:.1f} ms" for b in batches)
    print(
        f"{args.engine} {args.dtype} ({sampling_text(args.sampling)}): "
        f"prefill {args.prompt} tokens {result[f'prefill_{args.prompt}_ms']:.1f} ms; "
        f"decode step ({args.context}-token prompts) {steps_text}"
    )
    result["load_average"] = os.getloadavg()[0]
    if args.ceiling:
        import torch

        shape = hf_shape(args.model) if args.engine == "vllm" else llm.llm_engine.model_config
        ceiling = measure((getattr(torch, args.dtype),), quick=True)
        print("\n".join(ceiling_lines(result, shape, args, batches, ceiling)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
