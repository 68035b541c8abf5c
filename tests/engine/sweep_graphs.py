"""A differential sweep of the GPU's step path: the same requests through an engine whose every
step takes the CUDA graphs' buffers (cudagraph_mode FULL, scheduled ahead; captured on a GPU,
uncaptured under Triton's interpreter on a CPU) and through an eager in-order one, across model
families and the features a request can ask for. Outside the suite (minutes, not seconds): run it
after changing the graphs' path, and turn what it finds into a test; `bench/device/gpu_checks.sh`
runs it on a lent card (its `sweep` step).

    .venv/bin/python -m tests.engine.sweep_graphs [--families llama,qwen3,...] [--scenarios greedy,...] [--ahead-only]

`--ahead-only` takes the graphs out: the same engine scheduled ahead, every step eager, against
in order (async scheduling alone, as a CPU runs it when asked).

Per family and scenario it compares each output's tokens, finish reason, stop reason, cached
prompt tokens, logprobs (within 1e-4) and prompt logprobs, and checks every KV block free after
both engines. A sampled token may differ where the two paths' logits differ in the last bits and a
draw falls between them: such a row is reported with the largest logprob difference before it,
which tells rounding (~1e-6) from a wrong block (~1e-1). Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.arg_types import names
from prefixkv import LLM, SamplingParams
from prefixkv.sampling_params import StructuredOutputsParams

from ..model.test_model_hf_folder import _make as make_dense
from ..model.test_model_hf_folder import _write_tokenizer
from ..model.triton_interpreter import device, kernels_module

BLOCK = 8


DENSE = ("llama", "qwen3", "qwen2", "mistral", "smollm3", "granite", "olmo2", "olmo3", "phi3", "ernie4_5", "glm4")


def _family(name: str) -> Callable[[], Any]:
    if name in DENSE:
        return lambda: make_dense(name)
    if name in ("gemma2", "gemma3"):
        from .test_hybrid_attention import _make as make_hybrid

        return lambda: make_hybrid(name)
    if name in ("qwen3_moe", "qwen2_moe"):
        from .test_moe_architectures import make_moe

        return lambda: make_moe(name)
    if name == "mamba2":
        from .test_mamba2 import make_mamba2

        return make_mamba2
    if name == "falcon_h1":
        from .test_falcon_h1 import make_falcon_h1

        return make_falcon_h1
    if name == "bamba":
        from .test_bamba import make_bamba

        return make_bamba
    if name == "qwen3_next":
        from .test_qwen3_next import make_qwen3_next

        return lambda: make_qwen3_next(mlp_only_layers=[0, 1, 2, 3])
    if name == "qwen3_5":  # the released layout: its language model under a vision encoder
        from .test_qwen3_5 import make

        return lambda: make("vl")
    if name == "granite_hybrid":
        from .test_granite_hybrid import make_granite_hybrid

        return make_granite_hybrid
    if name in ("lfm2", "lfm2_moe"):
        from .test_lfm2 import make_lfm2, make_lfm2_moe

        return make_lfm2 if name == "lfm2" else make_lfm2_moe
    if name in ("glm4_moe", "minimax_m2"):
        from .test_glm4_moe import make_glm4_moe, make_minimax_m2

        return make_glm4_moe if name == "glm4_moe" else make_minimax_m2
    if name in ("deepseek_v3", "deepseek_v3_wide", "glm4_moe_lite"):  # (wide: the released 576-wide latent head)
        from .test_deepseek import make_deepseek

        return lambda: make_deepseek("glm_lite" if name == "glm4_moe_lite" else "v3", wide_latent=name.endswith("wide"))
    if name in ("gemma4", "gemma4_moe"):  # (no graphs: its layers run eager; the caching fuzz takes it)
        from .test_gemma4 import make_gemma4

        return lambda: make_gemma4("moe" if name == "gemma4_moe" else "small")
    if name == "gpt_oss":  # (no graphs: its sinks run eager; the caching fuzz takes it)
        from ..model.test_model_gpt_oss import make_gpt_oss

        return make_gpt_oss
    raise SystemExit(f"unknown family {name!r}")


FAMILIES = [
    "llama", "qwen3", "ernie4_5", "glm4", "gemma2", "gemma3", "qwen3_moe", "mamba2", "falcon_h1", "bamba", "qwen3_next",
    "lfm2", "lfm2_moe", "glm4_moe", "minimax_m2", "deepseek_v3",
    "deepseek_v3_wide", "glm4_moe_lite", "lora", "llava",
]  # fmt: skip
# a request: (the prompt as generate takes it, its params, its adapter's name or None)
Request = tuple[Any, SamplingParams, str | None]


def _prompts(seed: str, n: int, shared: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 14))] for _ in range(n)]


def _scenarios() -> dict[str, tuple[dict[str, Any], list[tuple[list[int], SamplingParams]]]]:
    """name -> (engine settings beyond the defaults, [(prompt ids, params)]); each run in two
    rounds, the second over what the first cached."""
    out: dict[str, tuple[dict[str, Any], list[tuple[list[int], SamplingParams]]]] = {}
    ps = _prompts("greedy", 5)
    out["greedy"] = (
        {"max_num_batched_tokens": 16},
        [
            (p, SamplingParams(temperature=0, max_tokens=7 + i, ignore_eos=True, logprobs=2, prompt_logprobs=i % 2))
            for i, p in enumerate(ps)
        ],
    )
    ps = _prompts("sampled", 4)
    out["sampled"] = (
        {},
        [
            (p, SamplingParams(temperature=0.9, top_p=0.85, top_k=12, seed=7 + i, n=2, max_tokens=8, logprobs=1))
            for i, p in enumerate(ps)
        ],
    )
    ps = _prompts("stops", 5)
    out["stops"] = (
        {"max_num_batched_tokens": 24},
        [
            (ps[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ps[0][-1], 17, 40, 99], logprobs=0)),
            (ps[1], SamplingParams(temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=[5, 6, 7, 8, 9])),
            (ps[2], SamplingParams(temperature=0.7, seed=3, max_tokens=12, stop=["a", "e", "o"])),
            (ps[3], SamplingParams(temperature=0, max_tokens=3)),
            (ps[4], SamplingParams(temperature=0, max_tokens=12, stop=["x"], include_stop_str_in_output=True)),
        ],
    )
    ps = _prompts("penalties", 3)
    out["penalties"] = (
        {},
        [
            (ps[0], SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, logprobs=0)),
            (
                ps[1],
                SamplingParams(temperature=0.8, seed=11, max_tokens=10, presence_penalty=0.7, frequency_penalty=0.3),
            ),
            (ps[2], SamplingParams(temperature=0, max_tokens=10, logit_bias={65: 3.0, 66: -2.0})),
        ],
    )
    # penalties alone run ahead (the token in flight counted from the previous step's copy)
    out["penalties_ahead"] = (
        {},
        [
            (ps[0], SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.5, logprobs=1)),
            (ps[1], SamplingParams(temperature=0.8, seed=12, max_tokens=10, frequency_penalty=1.0, n=2)),
            (ps[2], SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.5)),
        ],
    )
    ps = _prompts("structured", 3)
    out["structured"] = (
        {},
        [
            (
                ps[0],
                SamplingParams(
                    temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-c]{2,5}x")
                ),
            ),
            (
                ps[1],
                SamplingParams(
                    temperature=0.8,
                    seed=5,
                    max_tokens=12,
                    structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
                ),
            ),
            (ps[2], SamplingParams(temperature=0, max_tokens=8, logprobs=1)),  # beside them, unconstrained
        ],
    )
    # penalties and constraints without logprobs: drawn by the draws' graph from its logits edited in place
    ps = _prompts("constrained", 4)
    allowed = list(range(30, 140))
    out["constrained"] = (
        {},
        [
            (ps[0], SamplingParams(temperature=0, max_tokens=10, allowed_token_ids=allowed, min_tokens=4)),
            (
                ps[1],
                SamplingParams(
                    temperature=0.9,
                    top_k=20,
                    seed=8,
                    max_tokens=10,
                    logit_bias={40: 5.0, 41: -5.0},
                    frequency_penalty=1.0,
                ),
            ),
            (
                ps[2],
                SamplingParams(
                    temperature=0, max_tokens=10, bad_words=["a", "the"], ignore_eos=True, repetition_penalty=1.4
                ),
            ),
            (
                ps[3],
                SamplingParams(
                    temperature=0.7,
                    seed=9,
                    max_tokens=10,
                    structured_outputs=StructuredOutputsParams(regex="[a-f ]{3,9}"),
                ),
            ),
        ],
    )
    # the same with logprobs: the raw logits' scores (kept aside before the edit), the draws the edited logits'
    settings, constrained = out["constrained"]
    out["constrained_scored"] = (
        settings,
        [(p, params.clone(logprobs=k)) for (p, params), k in zip(constrained, (2, 0, 5, None))],
    )
    ps = _prompts("tight", 6, shared=12)
    out["tight"] = (
        {"num_blocks": 14, "max_model_len": 48},
        [(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)) for p in ps],
    )
    return out


def _lora_scenarios(adapters: dict[str, str]) -> dict[str, tuple[dict[str, Any], list[Request]]]:
    """Adapters beside base rows in one batch, in mixed steps (chunks of 16) and decodes."""
    names = [None, *adapters, None, *adapters]
    ps = _prompts("lora", len(names))
    greedy = [
        ({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), name)
        for p, name in zip(ps, names, strict=True)
    ]
    sampled = [
        ({"prompt_token_ids": p}, SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=8, logprobs=0), name)
        for i, (p, name) in enumerate(zip(ps, names, strict=True))
    ]
    settings = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "max_num_batched_tokens": 16}
    return {"greedy": (settings, greedy), "sampled": ({**settings, "max_num_batched_tokens": 64}, sampled)}


def _llava_scenarios() -> dict[str, tuple[dict[str, Any], list[Request]]]:
    """Prompts with one and two images and an image alone, chunked across steps."""
    from ..multimodal.conftest import make_image

    texts = [
        ("USER: <image>\nWhat is shown here? ASSISTANT:", [1]),
        ("USER: <image>\n<image>\nWhich of the two is brighter? ASSISTANT:", [2, 3]),
        ("<image>", [4]),
        ("USER: describe <image> briefly. ASSISTANT:", [1]),  # the first image again, other text
    ]
    prompts = [{"prompt": t, "multi_modal_data": {"image": [make_image(s) for s in seeds]}} for t, seeds in texts]
    greedy = [
        (p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=i % 2), None)
        for i, p in enumerate(prompts)
    ]
    sampled = [
        (p, SamplingParams(temperature=0.8, top_p=0.9, seed=i, n=2, max_tokens=8, logprobs=0), None)
        for i, p in enumerate(prompts)
    ]
    return {
        "greedy": ({"max_num_batched_tokens": 16, "num_blocks": 128, "max_model_len": 256}, greedy),
        "sampled": ({"max_num_batched_tokens": 32, "num_blocks": 128, "max_model_len": 256}, sampled),
    }


def _run(llm: LLM, requests: list[Request], adapters: dict[str, str]) -> list[Any]:
    from prefixkv.lora import LoRARequest

    ids = {name: i + 1 for i, name in enumerate(adapters)}
    loras = [None if name is None else LoRARequest(name, ids[name], adapters[name]) for _, _, name in requests]
    outs = llm.generate(
        [prompt for prompt, _, _ in requests],
        [params for _, params, _ in requests],
        use_tqdm=False,
        lora_request=loras if any(loras) else None,
    )
    return list(outs)


def _checkpoint(family: str, folder: Path) -> tuple[dict[str, tuple[dict[str, Any], list[Request]]], dict[str, str]]:
    """Writes the family's checkpoint (and adapters) under `folder`; its scenarios and adapters."""
    if family == "llava":
        from ..multimodal.llava_builder import build_llava

        build_llava(folder)
        return _llava_scenarios(), {}
    if family == "lora":
        from ..lora.conftest import ADAPTERS, write_adapter

        base = folder / "base"
        hf = make_dense("llama")
        hf.save_pretrained(base, safe_serialization=True)
        _write_tokenizer(base)
        adapters = {}
        for i, name in enumerate(["qv", "all"]):
            write_adapter(base, folder / name, seed=100 + i, **ADAPTERS[name])
            adapters[name] = str(folder / name)
        return _lora_scenarios(adapters), adapters
    hf = _family(family)()
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    plain = {
        name: (settings, [({"prompt_token_ids": p}, params, None) for p, params in requests])
        for name, (settings, requests) in _scenarios().items()
    }
    plain["edges"] = _edges()
    return plain, {}


def _edges() -> tuple[dict[str, Any], list[Request]]:
    """A one-token prompt, one token out, a prompt longer than the largest captured mixed step
    (an eager step between replays), and the same prompt under two cache salts (no hit across)."""
    rng = random.Random("edges")
    salted = [rng.randrange(256) for _ in range(26)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    return (
        {"max_model_len": 256, "num_blocks": 96},
        [
            ({"prompt_token_ids": [rng.randrange(256)]}, greedy, None),
            ({"prompt_token_ids": [rng.randrange(256) for _ in range(200)]}, greedy, None),
            ({"prompt_token_ids": salted, "cache_salt": "tenant-a"}, greedy, None),
            ({"prompt_token_ids": salted, "cache_salt": "tenant-b"}, greedy, None),
            ({"prompt_token_ids": salted[:9]}, SamplingParams(temperature=0, max_tokens=1, logprobs=2), None),
        ],
    )


def _lp(entry: Any) -> list[float]:
    return [] if entry is None else [next(iter(d.values())).logprob for d in entry if d]


def _compare(name: str, got: list[Any], want: list[Any]) -> list[str]:
    problems = []
    for r, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.num_cached_tokens != b.num_cached_tokens:
            problems.append(f"{name} request {r}: cached {a.num_cached_tokens} != {b.num_cached_tokens}")
        pa, pb = a.prompt_logprobs, b.prompt_logprobs
        if (pa is None) != (pb is None):
            problems.append(f"{name} request {r}: prompt logprobs present in one engine only")
        elif pa is not None:
            da = [x for x in pa if x] or []
            db = [x for x in pb if x] or []
            worst = max(
                (abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) for x, y in zip(da, db)),
                default=0.0,
            )
            if len(da) != len(db) or worst > 1e-4:
                problems.append(f"{name} request {r}: prompt logprobs differ by {worst:.2e}")
        for c, (x, y) in enumerate(zip(a.outputs, b.outputs, strict=True)):
            lx, ly = _lp(x.logprobs), _lp(y.logprobs)
            same = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), None)
            upto = len(lx) if same is None else same
            worst = max((abs(s - t) for s, t in zip(lx[:upto], ly[:upto])), default=0.0)
            if x.token_ids != y.token_ids:
                problems.append(
                    f"{name} request {r}.{c}: tokens differ at {same} ({x.token_ids} vs {y.token_ids}); "
                    f"logprobs before it within {worst:.2e}"
                )
            elif worst > 1e-4:
                problems.append(f"{name} request {r}.{c}: logprobs differ by {worst:.2e}")
            if x.text != y.text and x.token_ids == y.token_ids:
                problems.append(f"{name} request {r}.{c}: the same tokens, other text ({x.text!r} vs {y.text!r})")
            if (x.finish_reason, x.stop_reason) != (y.finish_reason, y.stop_reason):
                problems.append(
                    f"{name} request {r}.{c}: finish {x.finish_reason}/{x.stop_reason!r}"
                    f" vs {y.finish_reason}/{y.stop_reason!r}"
                )
    return problems


def _free(llm: LLM) -> bool:
    engine = llm.llm_engine
    return engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", type=names(FAMILIES), default=FAMILIES)
    ap.add_argument("--scenarios", default=None, help="comma-separated (default: all)")
    ap.add_argument(
        "--ahead-only",
        action="store_true",
        help="no graphs: steps scheduled ahead, eagerly, against in order (what a CPU runs when asked)",
    )
    args = ap.parse_args()
    kernels_module()
    on = device()
    os.environ["PREFIXKV_CUDA_GRAPHS"] = "static" if on.type == "cpu" else "capture"
    logging.getLogger("prefixkv").setLevel(logging.ERROR)  # the thread policy's notice, once an engine
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            folder = Path(tmp) / family
            scenarios, adapters = _checkpoint(family, folder)
            model = folder / "base" if family == "lora" else folder
            for name in args.scenarios.split(",") if args.scenarios else list(scenarios):
                if name not in scenarios:
                    continue
                settings, requests = scenarios[name]
                kwargs = dict(
                    dtype="float32", device=str(on), num_blocks=64, block_size=BLOCK, max_model_len=64, max_num_seqs=8
                )
                kwargs.update(settings)
                start = time.perf_counter()
                steps: dict[str, Any] = (
                    {"enforce_eager": True}
                    if args.ahead_only
                    else {
                        "compilation_config": {
                            "cudagraph_mode": "FULL",
                            "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128],
                        }
                    }
                )
                graphs = LLM(str(model), **kwargs, async_scheduling=True, **steps)
                graphs.llm_engine.runner.constraint_masks = True  # as on a GPU: one bitmask a step
                eager = LLM(str(model), **kwargs, enforce_eager=True, async_scheduling=False)
                found = []
                for rnd in range(2):  # the second round over what the first cached
                    got, want = _run(graphs, requests, adapters), _run(eager, requests, adapters)
                    found += _compare(f"{family}/{name}/round {rnd}", got, want)
                for label, llm in (("graphs", graphs), ("eager", eager)):
                    if not _free(llm):
                        found.append(f"{family}/{name}: blocks left held by the {label} engine")
                g = graphs.llm_engine.runner.graphs
                ran = "no graphs" if g is None else f"{g.replays} decode, {g.mixed_replays} mixed replays"
                ran += f", {graphs.llm_engine.num_steps_ahead} steps ahead"
                if g is not None and g.draws:
                    ran += f", {g.draws} draws in graphs"
                if g is not None and g.lora_replays:
                    ran += f", {g.lora_replays} with adapters"
                if g is not None and g.image_rows is not None:
                    ran += f", {g.image_rows.steps} with images"
                preempted = graphs.llm_engine.scheduler.num_preemptions
                if preempted:
                    ran += f", {preempted} preemptions"
                print(
                    f"{family:11s} {name:10s} {'ok' if not found else 'DIFFERS':8s} "
                    f"({ran}; {time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
                for line in found:
                    print("    " + line, flush=True)
                problems += found
                del graphs, eager
                if on.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"{len(problems)} difference(s) on {on.type}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
