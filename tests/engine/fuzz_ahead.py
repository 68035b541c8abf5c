"""A differential fuzz of async scheduling: random traffic through an engine stepping in order
and one scheduling ahead, under random configurations. The traffic: arrivals between steps, shared
prefixes, greedy and seeded sampling (top-p, top-k, min-p), penalties, stop tokens with
min_tokens, text stops, logit biases, allowed tokens, bad words, a regex grammar, n=2, logprobs,
prompt logprobs, hidden states (return_hidden_states, an embedding's prompt). The configurations:
block size, a pool small enough to preempt, chunked prefill, the sequence limit, caching on or
off, the fcfs or priority policy with random priorities, a CPU tier, the stage-output cache (more
requests then read their prompt's outputs back). Each request's tokens, text, finish and stop
reasons, logprobs and hidden states (within 2e-3: batches differ, so do the last bits) must be
equal, and every KV block free after both. Outside the suite (seconds a seed): run
it after changing what steps ahead do, and turn what it finds into a test; the suite runs a few
seeds (tests/engine/test_async_scheduling.py).

    .venv/bin/python -m tests.engine.fuzz_ahead [--first 0] [--count 200]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from prefixkv import SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.sampling_params import StructuredOutputsParams

from ..model.test_model_hf_folder import _make, _write_tokenizer

MAX_STEPS = 5000  # a run longer than this hangs
MAX_MODEL_LEN = 48  # every engine's; prompts are at most 43 tokens
_STOP_AT = "fuzz_stop_at"  # extra_args key: (what stops, at which greedy token), set by _with_stops
_greedy_engines: dict[Path, LLMEngine] = {}


def checkpoint(folder: Path) -> Path:
    """A tiny random Llama with a byte-level tokenizer, written in `folder`."""
    _make("llama").save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return folder


def _params(rng: random.Random) -> SamplingParams:
    """Random sampling parameters; stops (`_STOP_AT` in extra_args) are set from the model's own
    greedy continuation, or they would seldom stop anything (`_with_stops`)."""
    kind, most = rng.randrange(12), rng.randrange(1, 16)
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=most, ignore_eos=rng.random() < 0.5)
    if kind == 1:
        return SamplingParams(
            temperature=rng.choice([0.5, 1.0]),
            top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(99),
            max_tokens=most,
            logprobs=rng.choice([None, 2]),
        )
    if kind == 2:
        return SamplingParams(
            temperature=0,
            max_tokens=most,
            repetition_penalty=1.3,
            frequency_penalty=rng.choice([0.0, 0.5]),
            ignore_eos=True,
        )
    if kind == 3:  # a stop token the greedy continuation meets (after min_tokens, or not)
        return SamplingParams(
            temperature=0,
            max_tokens=most,
            stop_token_ids=[rng.randrange(256)],
            min_tokens=min(most, rng.randrange(4)),
            extra_args={_STOP_AT: ("token", rng.randrange(most))},
        )
    if kind == 4:
        return SamplingParams(temperature=0.8, seed=rng.randrange(99), max_tokens=most, n=2)
    if kind == 5:
        return SamplingParams(temperature=0, max_tokens=most, prompt_logprobs=rng.choice([0, 2]), ignore_eos=True)
    if kind == 6:
        return SamplingParams(temperature=0, max_tokens=most, logprobs=1, presence_penalty=0.4)
    if kind == 7:  # a text stop the greedy continuation meets
        return SamplingParams(
            temperature=0,
            max_tokens=most,
            stop=["\x00"],
            include_stop_str_in_output=rng.random() < 0.5,
            extra_args={_STOP_AT: ("text", rng.randrange(most))},
        )
    if kind == 8:  # what the logits are edited by: biases, an allowed set, bad words
        vocab = list(range(3, 259))
        return SamplingParams(
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(99),
            max_tokens=most,
            logit_bias={t: rng.choice([-5.0, 5.0]) for t in rng.sample(vocab, 3)},
            allowed_token_ids=rng.sample(vocab, 40) if rng.random() < 0.5 else None,
            bad_words=["ab", "e"] if rng.random() < 0.5 else None,
        )
    if kind == 9:  # a grammar: lowercase words
        return SamplingParams(
            temperature=rng.choice([0.0, 0.7]),
            seed=rng.randrange(99),
            max_tokens=most,
            structured_outputs=StructuredOutputsParams(regex="[a-z]+( [a-z]+)*"),
        )
    if kind == 10:  # every position's hidden state (a pipeline's thinker)
        return SamplingParams(temperature=0, max_tokens=most, return_hidden_states=True, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_k=5, min_p=0.05, seed=rng.randrange(99), max_tokens=most)


def case(
    seed: int, model: Path
) -> tuple[dict[str, Any], list[tuple[int, str, list[int], SamplingParams, int, int | None]]]:
    """Seed `seed`'s engine configuration and traffic: (step it arrives before, id, prompt,
    params, priority, hidden_states_from), in arrival order."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(rng.randrange(24))]
    cfg: dict[str, Any] = dict(
        dtype="float32",
        device="cpu",
        block_size=rng.choice([4, 8]),
        num_blocks=rng.choice([12, 16, 24, 64]),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=rng.choice([16, 32, 256]),
        max_num_seqs=rng.choice([2, 4, 8]),
        enable_prefix_caching=rng.random() < 0.8,
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        kv_offloading_size=rng.choice([None, 0.01]),
    )
    if not cfg["enable_prefix_caching"]:
        cfg["kv_offloading_size"] = None  # tiers need it
    # the stage-output cache, drawn apart (the other seeds' cases stay), with more requests reading it
    stage = random.Random(f"stage-{seed}")
    if cfg["enable_prefix_caching"] and stage.random() < 0.4:
        cfg["enable_stage_output_cache"] = True
    else:
        stage = None
    if cfg["max_num_batched_tokens"] < cfg["max_model_len"]:
        cfg["enable_chunked_prefill"] = True  # (always on; False is refused)
    traffic = []
    for i in range(rng.randrange(1, 10)):
        prompt = (shared if rng.random() < 0.6 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
        priority = rng.randrange(3) if cfg["scheduling_policy"] == "priority" else 0
        params = _with_stops(model, prompt, _params(rng))
        # an embedding's prompt hidden states, from a position (not beside return_hidden_states)
        hidden_from = rng.randrange(len(prompt)) if not params.return_hidden_states and rng.random() < 0.1 else None
        if stage is not None and stage.random() < 0.5:  # its prompt's outputs, over what others cached
            if stage.random() < 0.5 and not params.return_hidden_states:
                hidden_from = stage.randrange(len(prompt))
            elif params.prompt_logprobs is None:
                params = dataclasses.replace(params, prompt_logprobs=stage.choice([0, 3]))
        traffic.append((rng.randrange(12), f"r{i}", prompt, params, priority, hidden_from))
    traffic.sort(key=lambda t: t[0])
    return cfg, traffic


def _with_stops(model: Path, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """`params` with its stop taken from the greedy continuation of `prompt` (a token at its
    position, or two characters of the text from it), where `_params` asked for one."""
    if not params.extra_args or _STOP_AT not in params.extra_args:
        return params
    what, at = params.extra_args[_STOP_AT]
    engine = _greedy_engines.get(model)
    if engine is None:
        engine = _greedy_engines[model] = LLMEngine(
            EngineConfig(
                model=str(model),
                dtype="float32",
                device="cpu",
                max_model_len=MAX_MODEL_LEN,
                num_blocks=16,  # a prompt at a time: not the default budget's GiB, kept for the session
                block_size=16,
            )
        )
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o.outputs[0]
    assert out is not None
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    fields["extra_args"] = None
    if what == "token":
        fields["stop_token_ids"] = [out.token_ids[min(at, len(out.token_ids) - 1)]]
    else:
        text = out.text[at : at + 2] or out.text[-2:]
        fields["stop"] = [text] if text.strip() else None
    return SamplingParams(**fields)


def serve(model: Path, cfg: dict[str, Any], traffic: list, async_scheduling: bool) -> tuple[dict[str, Any], int, int]:
    """Each request's outputs (tokens, finish reason and logprobs of every sequence, prompt
    logprobs, error), the steps launched ahead and the preemptions; every block free after."""
    engine = LLMEngine(EngineConfig(model=str(model), **cfg, async_scheduling=async_scheduling))
    pending = list(traffic)
    done: dict[str, Any] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, priority, hidden_from = pending.pop(0)
            engine.add_request(prompt, params, request_id=rid, priority=priority, hidden_states_from=hidden_from)
        for out in engine.step():
            if out.finished:
                hidden = out.hidden_states
                done[out.request_id] = (
                    [
                        (tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason, _scores(c.logprobs))
                        for c in out.outputs
                    ],
                    _scores(out.prompt_logprobs),
                    None if hidden is None else (tuple(hidden.shape), hidden.double().sum(dim=1).tolist()),
                    out.error,
                )
        step += 1
        if step > MAX_STEPS:
            raise RuntimeError(f"no end after {MAX_STEPS} steps")
    held = engine.num_blocks - engine.kv_cache_manager.num_free_blocks
    if held:
        raise RuntimeError(f"{held} blocks held after every request ended")
    return done, engine.num_steps_ahead, engine.scheduler.num_preemptions


def _scores(entries: list | None) -> list | None:
    if entries is None:
        return None
    return [e and sorted((t, lp.logprob) for t, lp in e.items()) for e in entries]


def close(a: Any, b: Any) -> bool:
    """Equal, floats within 2e-3."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return abs(a - b) < 2e-3
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


def differences(model: Path, seed: int) -> tuple[list[str], int, int]:
    """The requests of seed `seed` whose outputs differ; the steps ahead and preemptions ahead."""
    cfg, traffic = case(seed, model)
    in_order = serve(model, cfg, traffic, False)
    ahead = serve(model, cfg, traffic, True)
    differ = sorted(set(in_order[0]) ^ set(ahead[0]))
    differ += [rid for rid in in_order[0] if rid in ahead[0] and not close(in_order[0][rid], ahead[0][rid])]
    return differ, ahead[1], ahead[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, default=200)
    args = ap.parse_args()
    model = checkpoint(Path(tempfile.mkdtemp(prefix="fuzz-ahead-")))
    bad = 0
    for seed in range(args.first, args.first + args.count):
        try:
            differ, steps_ahead, preemptions = differences(model, seed)
        except Exception:  # noqa: BLE001 (reported with its seed, the fuzz goes on)
            bad += 1
            print(f"seed {seed}: FAILED", flush=True)
            traceback.print_exc()
            continue
        if differ:
            bad += 1
            print(
                f"seed {seed}: {len(differ)} request(s) differ, first {differ[0]}: {case(seed, model)[0]}", flush=True
            )
        else:
            print(f"seed {seed}: ok ({steps_ahead} steps ahead, {preemptions} preemptions)", flush=True)
    print(f"{bad} seed(s) of {args.count} differ or fail")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
