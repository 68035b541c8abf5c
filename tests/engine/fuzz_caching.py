"""A differential fuzz of prefix caching: random traffic through an engine with caching off and one
with it on, the same settings otherwise, on a tiny random checkpoint of each family - plain
attention (SmolLM3's with layers that have no rotary, Granite's multipliers, OLMo 2's post-norm
blocks, Phi-3's partial rotary), sliding windows beside full layers (Gemma 2 and 3, gpt-oss with
its sinks, OLMo 3; Gemma 4's with two head sizes, per-layer inputs and layers reading earlier
layers' K/V), routed experts, recurrent state (Mamba2, Falcon-H1, Bamba, Qwen3-Next: a hit restores
the state saved at a block's end), adapters beside their base model, LLaVA's images.

The traffic is what a cache must get right: a conversation's next turn (the earlier prompt, the
model's own answer to it, new tokens), prompts repeated whole, prefixes ending anywhere in a
block, the same prompt under two cache salts, the same words with other images or adapters,
preemption in a small pool, chunked prefill, arrivals between steps, each eviction policy, a
pinned prefix, a CPU tier, the stage-output cache and speculative decoding's n-gram drafts (half
the seeds of the families that take them) with the cache. Greedy and seeded requests,
logprobs, n=2, prompt logprobs, an embedding's prompt hidden states.

Each greedy request's tokens, finish and logprobs, each seeded one's lengths and finishes, prompt
logprobs and hidden states (floats within 2e-3) must be equal; each greedy request of the base
model must also equal its tokens alone; every KV block must be free after both. fuzz_ahead.py
compares two schedules with the same caching, so a cache wrong the same way in both passes there.
Outside the suite (about a second a seed); the suite runs a few seeds (test_correctness.py):

    .venv/bin/python -m tests.engine.fuzz_caching [--families llama,qwen3_next] [--first 0] [--count 40]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from bench.arg_types import names
from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine_args import POLICIES
from prefixkv.lora import LoRARequest

from ..model.test_model_hf_folder import _write_tokenizer
from .fuzz_ahead import MAX_STEPS, close
from .sweep_graphs import _family

FAMILIES = [
    "llama", "smollm3", "granite", "olmo2", "phi3", "olmo3", "ernie4_5", "glm4", "gemma2", "gemma3", "gemma4",
    "gemma4_moe", "qwen3_moe",
    "glm4_moe", "minimax_m2", "deepseek_v3", "glm4_moe_lite", "gpt_oss", "mamba2",
    "falcon_h1", "bamba", "qwen3_next", "qwen3_5", "lfm2", "lfm2_moe", "granite_hybrid", "lora",
    "llava",
]  # fmt: skip
KV_CACHE_GROUPS = {"gemma2": 2, "gemma3": 2, "gpt_oss": 2, "olmo3": 2}  # a checkpoint's folder is named by its family
# no KV tier under them (refused)
RECURRENT = {"mamba2", "falcon_h1", "bamba", "qwen3_next", "qwen3_5", "lfm2", "lfm2_moe", "granite_hybrid"}
ADAPTERS = ("qv", "all")  # the lora family's, beside its base model (tests/lora/conftest.py)
MAX_MODEL_LEN = 96
# (step it arrives before, id, prompt (token ids; llava's: its text and image seeds), params,
# cache salt, adapter folder or None, the first position whose prompt hidden states it asks for, an
# embedding's, or None)
Arrival = tuple[int, str, Any, SamplingParams, str | None, str | None, int | None]
DRAFTS_KEPT = [0]  # speculative decoding's kept drafts over the engines served (main's report)
PIN = "pin"  # a case's key for the token ids the engine with caching pins first (not an engine setting)
LLAVA_WORDS = ("USER: ", "what is ", "this", " and ", "<image>", "<image>", "? ASSISTANT:", "\n")


def checkpoint(family: str, parent: Path) -> Path:
    """The family's tiny random checkpoint and a byte-level tokenizer, in a folder of `parent`
    named by the family."""
    folder = parent / family
    if family == "llava":  # a vision tower's 25 image tokens an image, its encoder cache, image hashes
        from ..multimodal.llava_builder import build_llava

        build_llava(folder)
        return folder
    _family("llama" if family == "lora" else family)().save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    if family == "lora":  # two random adapters of the base, in folders beside it
        from ..lora.conftest import ADAPTERS as KINDS
        from ..lora.conftest import write_adapter

        for i, name in enumerate(ADAPTERS):
            write_adapter(folder, parent / f"lora-{name}", seed=100 + i, **KINDS[name])
    return folder


def _params(rng: random.Random) -> SamplingParams:
    most = rng.randrange(1, 13)
    kind = rng.randrange(6)
    if kind == 0:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(99), max_tokens=most, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0, max_tokens=most, logprobs=2, ignore_eos=True)
    if kind == 2:
        return SamplingParams(temperature=0.9, seed=rng.randrange(99), n=2, max_tokens=most, ignore_eos=True)
    if kind == 3:  # scores its prompt: reads no cached block (but the stage-output cache's rows)
        return SamplingParams(temperature=0, max_tokens=most, prompt_logprobs=1, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=most, ignore_eos=True)


def case(seed: int, model: Path) -> tuple[dict[str, Any], list[Arrival]]:
    """Seed `seed`'s engine settings and traffic, in arrival order."""
    rng = random.Random(seed)
    bs, num_blocks = rng.choice([4, 8, 16]), rng.choice([14, 20, 32, 96])
    # a small pool preempts; one request always fits (Gemma's windows: two KV-cache groups share it)
    pool_tokens = bs * num_blocks // KV_CACHE_GROUPS.get(model.name, 1)
    max_len = min(MAX_MODEL_LEN, pool_tokens)
    cfg: dict[str, Any] = dict(
        dtype="float32",
        device="cpu",
        block_size=bs,
        num_blocks=num_blocks,
        max_model_len=max_len,
        max_num_batched_tokens=rng.choice([8, 16, 48, 256]),
        max_num_seqs=rng.choice([1, 2, 4, 8]),
        eviction_policy=rng.choice(list(POLICIES)),
    )
    if cfg["max_num_batched_tokens"] < max_len:
        cfg["enable_chunked_prefill"] = True
    # drawn apart, so that the seeds drawn before keep their cases: a CPU tier under the cache (the
    # engine with caching off has none), adapters whose blocks no other adapter may read
    extra = random.Random(f"tier-{seed}")
    if model.name not in RECURRENT and extra.random() < 0.4:
        cfg["kv_offloading_size"] = 0.004  # GiB: a few hundred of the tiny models' blocks
    # the stage-output cache: cached blocks' hidden states, read back for prompt logprobs and an
    # embedding's prompt hidden states (computed again with caching off)
    if extra.random() < 0.4:
        cfg["enable_stage_output_cache"] = True
    # speculative decoding under the cache: n-gram drafts, verified in one step, whose K/V rows and
    # stage outputs are the request's only up to the drafts kept (refused by recurrent models)
    drafts = random.Random(f"spec-{seed}")
    if model.name not in RECURRENT and drafts.random() < 0.5:
        lookup = drafts.randrange(1, 4)
        cfg["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": drafts.randrange(1, 6),
            "prompt_lookup_min": drafts.randrange(1, lookup + 1),
            "prompt_lookup_max": lookup,
            "by_measured_cost": False,  # every draft: a seed's steps do not hang on step times
        }
    adapters: list[str | None] = [None]
    if model.name == "lora":
        cfg.update(enable_lora=True, max_loras=2, max_lora_rank=8)
        adapters += [str(model.parent / f"lora-{name}") for name in ADAPTERS]
    if model.name == "llava":  # a pool of one longest request (images of 25 tokens, words of 1-12)
        cfg.update(num_blocks=128 // bs, max_model_len=128)
        return cfg, _llava_traffic(rng, extra)
    shared = [rng.randrange(256) for _ in range(rng.randrange(2 * bs, 5 * bs))]
    pins = random.Random(f"pin-{seed}")
    # the shared prefix, some of it, pinned in the cache before the traffic, where the pool still
    # holds the longest request beside it (else that request is refused, by name, with caching only)
    room = pool_tokens - max_len
    if pins.random() < 0.3 and min(room, len(shared)) >= bs:
        cfg[PIN] = shared[: pins.randrange(bs, min(room, len(shared)) + 1)]
    answers = _Answers(model)
    traffic: list[Arrival] = []
    prompts: list[list[int]] = []
    for i in range(rng.randrange(3, 13)):
        step = rng.randrange(8)
        shape = rng.randrange(5)
        if shape == 0 and prompts:  # a conversation's next turn: an earlier prompt, its answer, more
            earlier = rng.choice(prompts)
            prompt = earlier + answers.greedy(earlier, rng.randrange(1, 9)) + _tokens(rng, rng.randrange(1, 9))
        elif shape == 1 and prompts:  # an earlier prompt again, whole
            prompt = list(rng.choice(prompts))
        elif shape == 2:  # the shared prefix cut anywhere, then its own tokens
            prompt = shared[: rng.randrange(1, len(shared) + 1)] + _tokens(rng, rng.randrange(0, 6))
        elif shape == 3:  # the shared prefix to a block's end exactly
            prompt = shared[: max(bs, len(shared) // bs * bs)]
        else:
            prompt = _tokens(rng, rng.randrange(1, 40))
        prompt = prompt[: max_len - 13] or [1]  # room for its 12 tokens at most
        prompts.append(prompt)
        salt = rng.choice([None, None, None, "tenant-a", "tenant-b"])
        hidden_from = extra.randrange(len(prompt)) if extra.random() < 0.2 else None
        traffic.append((step, f"r{i}", prompt, _params(rng), salt, extra.choice(adapters), hidden_from))
    traffic.sort(key=lambda t: t[0])
    return cfg, traffic


def _llava_traffic(rng: random.Random, extra: random.Random) -> list[Arrival]:
    """Prompts of words and images from a few seeds: the same image at other places and beside
    other text, other images at the same place, prompts repeated whole, cut short, salted."""
    shared = "".join(rng.choice(LLAVA_WORDS) for _ in range(rng.randrange(1, 5)))
    traffic: list[Arrival] = []
    prompts: list[str] = []
    for i in range(rng.randrange(3, 10)):
        if prompts and rng.random() < 0.3:
            text = rng.choice(prompts)
        else:
            text = shared if rng.random() < 0.6 else ""
            text += "".join(rng.choice(LLAVA_WORDS) for _ in range(rng.randrange(1, 5)))
        while text.count("<image>") > 3:
            text = text.replace("<image>", "", 1)
        prompts.append(text)
        images = [extra.randrange(4) for _ in range(text.count("<image>"))]
        salt = rng.choice([None, None, "tenant-a"])
        traffic.append((rng.randrange(8), f"r{i}", {"text": text, "images": images}, _params(rng), salt, None, None))
    traffic.sort(key=lambda t: t[0])
    return traffic


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


class _Answers:
    """The model's greedy continuation of a prompt (a conversation's earlier answer), from an
    engine with caching off."""

    engines: dict[Path, LLMEngine] = {}

    def __init__(self, model: Path) -> None:
        engine = self.engines.get(model)
        if engine is None:
            config = EngineConfig(
                model=str(model),
                dtype="float32",
                device="cpu",
                max_model_len=MAX_MODEL_LEN,
                enable_prefix_caching=False,
                num_blocks=16,  # not the default budget's GiB: a prompt at a time
                block_size=16,
            )
            engine = self.engines[model] = LLMEngine(config)
        self.engine = engine

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        rid = self.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        tokens: list[int] = []
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id == rid and out.finished:
                    tokens = list(out.outputs[0].token_ids)
        return tokens


def serve(model: Path, cfg: dict[str, Any], traffic: list[Arrival], caching: bool) -> tuple[dict[str, Any], int, int]:
    """Each request's outputs (every sequence's tokens, finish and logprobs; prompt logprobs;
    error), the prompt tokens the cache served and the preemptions; every block free after."""
    settings = dict(cfg, enable_prefix_caching=caching)
    pin = settings.pop(PIN, None)
    if not caching:
        settings.pop("kv_offloading_size", None)  # a tier and the stage-output cache keep cached
        settings.pop("enable_stage_output_cache", None)  # blocks' values: none without the cache
        settings.pop("speculative_config", None)  # the engine to equal decodes a token a step
    engine = LLMEngine(EngineConfig(model=str(model), **settings))
    if caching and pin is not None:
        try:
            LLM.from_engine(engine).pin_prefix(pin)
        except ValueError:  # past max_pinned_fraction of a small pool: refused, by name
            pass
    pending = list(traffic)
    adapters = sorted({t[5] for t in traffic if t[5] is not None})
    # a seeded draw is compared by its lengths and finishes only: where the uniform falls within a
    # rounding of a token's edge, the last bits that a state restored from a block (or a scan in
    # other chunks) changes pick the neighbour token (mamba2 seed 22 of `case`: logprobs 2.4e-7
    # apart, then token 229 for 228); greedy requests are compared token for token
    sampled_ids = {t[1]: t[3].temperature > 0 for t in traffic}
    done: dict[str, Any] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, salt, adapter, hidden_from = pending.pop(0)
            lora = None if adapter is None else LoRARequest(Path(adapter).name, 1 + adapters.index(adapter), adapter)
            images = None
            if isinstance(prompt, dict):  # llava's: its text, and its images made from their seeds
                from ..multimodal.conftest import make_image

                images = {"image": [make_image(s) for s in prompt["images"]]} if prompt["images"] else None
                prompt = prompt["text"]
            engine.add_request(
                prompt,
                params,
                request_id=rid,
                cache_salt=salt,
                lora_request=lora,
                hidden_states_from=hidden_from,
                multi_modal_data=images,
            )
        for out in engine.step():
            if out.finished:
                sampled = sampled_ids.get(out.request_id, False)
                done[out.request_id] = (
                    [
                        (len(c.token_ids), c.finish_reason)
                        if sampled
                        else (tuple(c.token_ids), c.finish_reason, _scores(c.logprobs))
                        for c in out.outputs
                    ],
                    _scores(out.prompt_logprobs),
                    None if out.hidden_states is None else out.hidden_states.double().sum(dim=1).tolist(),
                    out.error,
                )
        step += 1
        if step > MAX_STEPS:
            raise RuntimeError(f"no end after {MAX_STEPS} steps")
    if caching and pin is not None:  # its blocks are held while pinned; free once unpinned
        LLM.from_engine(engine).unpin_prefix(pin)
    DRAFTS_KEPT[0] += engine.scheduler.spec_stats.num_accepted_tokens
    held = engine.num_blocks - engine.kv_cache_manager.num_free_blocks
    if held:
        raise RuntimeError(f"{held} blocks held after every request ended (caching {caching})")
    return done, engine.prefix_cache_stats.hits, engine.scheduler.num_preemptions


def _scores(entries: list | None) -> list | None:
    """Each position's logprobs, their values in order: which of two tokens within a rounding of
    each other makes a top-k list is the last bits' choice (llama seed 232: 4.7e-7 apart, token 185
    with caching, 299 without), while a wrong block moves values by far more than 2e-3. The
    tokens drawn are compared on their own."""
    if entries is None:
        return None
    return [e and sorted((lp.logprob for lp in e.values()), reverse=True) for e in entries]


def differences(model: Path, seed: int) -> tuple[list[str], int, int]:
    """The requests of seed `seed` whose outputs differ with caching on, or whose greedy tokens
    differ from the request's alone; the cache's hits and the preemptions with caching on."""
    cfg, traffic = case(seed, model)
    off, _, _ = serve(model, cfg, traffic, caching=False)
    on, hits, preemptions = serve(model, cfg, traffic, caching=True)
    differ = sorted(set(off) ^ set(on))
    differ += [rid for rid in off if rid in on and not close(off[rid], on[rid])]
    # and each greedy request of the base model as it runs alone (one engine, caching off, the whole
    # prompt in one step): neither the traffic around it, its chunks nor its preemptions change it
    answers = _Answers(model) if model.name not in ("lora", "llava") else None
    for _, rid, prompt, params, _, adapter, _ in traffic:
        if answers is None or params.temperature > 0 or adapter is not None or off[rid][-1] is not None:
            continue
        if off[rid][0][0][0] != tuple(answers.greedy(prompt, params.max_tokens or 0)):
            differ.append(f"{rid} (alone)")
    return differ, hits, preemptions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", type=names(FAMILIES), default=FAMILIES)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, default=40)
    args = ap.parse_args()
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            model = checkpoint(family, Path(tmp))
            hits_total = preempted = 0
            for seed in range(args.first, args.first + args.count):
                try:
                    differ, hits, preemptions = differences(model, seed)
                except Exception:  # a crash is a finding too
                    failures.append(f"{family} seed {seed}: {traceback.format_exc(limit=4)}")
                    print(failures[-1], flush=True)
                    continue
                hits_total += hits
                preempted += preemptions > 0
                if differ:
                    failures.append(f"{family} seed {seed}: {differ}")
                    print(failures[-1], flush=True)
            kept, DRAFTS_KEPT[0] = DRAFTS_KEPT[0], 0
            print(
                f"{family}: {args.count} seeds, {hits_total} hits, {preempted} seeds preempting, {kept} drafts kept",
                flush=True,
            )
    print(f"{len(failures)} failing seeds")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
