"""Greedy float32 tokens through prefixkv equal transformers + peft's, for each adapter alone and
for all of them in one mixed batch with the base model; caching on and off, chunked prefill,
more adapters in flight than max_loras (requests wait, all finish), async scheduling. Every KV
block free after."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.lora import LoRARequest

from .conftest import MAX_NEW

PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
BASE = dict(dtype="float32", device="cpu", num_blocks=96, block_size=8, max_model_len=64, enable_lora=True)


def _lora(fx, name):
    if name is None:
        return None
    return LoRARequest(name, list(fx.adapters).index(name) + 1, fx.adapters[name])


def _run(llm, fx, names):
    """Every prompt of the fixture once per adapter name (None = base), all in one generate call."""
    prompts, loras = [], []
    for name in names:
        for p in fx.prompts:
            prompts.append(p)
            loras.append(_lora(fx, name))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False, lora_request=loras)
    got: dict = {}
    for name, out in zip([n for n in names for _ in fx.prompts], outs):
        assert out.outputs[0].finish_reason == "length", out
        got.setdefault(name, []).append(list(out.outputs[0].token_ids))
    return got


def _all_free(llm):
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_adapters_change_the_output(lora_fixture):
    fx = lora_fixture
    for name in fx.adapters:
        assert fx.expected[name] != fx.expected[None], f"adapter {name} does not change greedy tokens"


def test_each_adapter_alone(lora_fixture):
    fx = lora_fixture
    llm = LLM(str(fx.base), **BASE, max_loras=1, max_lora_rank=8)
    for name in [None, *fx.adapters]:
        got = _run(llm, fx, [name])
        assert got[name] == fx.expected[name], name
    _all_free(llm)


@pytest.mark.parametrize(
    "settings",
    [
        dict(enable_prefix_caching=False, max_loras=3),
        dict(enable_prefix_caching=True, max_loras=3),
        dict(enable_prefix_caching=True, max_loras=3, max_num_batched_tokens=7),  # chunked prefill
        dict(enable_prefix_caching=True, max_loras=2),  # more adapters in flight than slots: they wait
        dict(enable_prefix_caching=True, max_loras=1, max_num_batched_tokens=11),
        # decode steps scheduled before the previous one's tokens are read (engine/scheduler.py)
        dict(enable_prefix_caching=True, max_loras=3, async_scheduling=True),
        dict(enable_prefix_caching=True, max_loras=1, max_num_batched_tokens=11, async_scheduling=True),
    ],
)
def test_mixed_batch(lora_fixture, settings):
    fx = lora_fixture
    llm = LLM(str(fx.base), **BASE, max_lora_rank=8, **settings)
    names = [None, *fx.adapters, "qv", None]
    for _ in range(2):  # the second round runs on whatever the first left cached
        got = _run(llm, fx, names)
        for name in set(names):
            assert got[name] == fx.expected[name] * names.count(name), (name, settings)
    _all_free(llm)
    if settings["max_loras"] < len(fx.adapters):
        assert llm.llm_engine.lora_manager.num_loads > len(fx.adapters)  # slots were reused
    if settings.get("async_scheduling"):
        assert llm.llm_engine.num_steps_ahead > 0


def test_preemption_with_adapters(lora_fixture):
    fx = lora_fixture
    llm = LLM(str(fx.base), **{**BASE, "num_blocks": 8}, max_loras=2, max_lora_rank=8)
    got = _run(llm, fx, [None, *fx.adapters])
    for name in [None, *fx.adapters]:
        assert got[name] == fx.expected[name], name
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _all_free(llm)


def test_dense_and_run_paths_equal_per_token_reference():
    """Both mixed-batch paths - the masked dense one (many short runs: decodes) and the run-by-run
    one (prefill chunks) - add exactly each token's own adapter, and nothing to base tokens."""
    import torch

    from prefixkv.lora.layers import SHORT_RUN, LoRAContext, LoRALinear, LoRAMapping

    g = torch.Generator().manual_seed(0)
    ctx = LoRAContext()
    base = torch.nn.Linear(6, 5, bias=False)
    lin = LoRALinear(base, 6, [2, 3], ctx, 4, 3, torch.float32, "cpu")
    weights = {}
    for slot in range(4):
        # slot 1 targets only the second slice, at a lower rank than max_rank
        pieces = [(torch.randn(r, 6, generator=g), torch.randn(w, r, generator=g)) for r, w in ((3, 2), (2, 3))]
        if slot == 1:
            pieces[0] = None  # type: ignore[call-overload]
        lin.set_slot(slot, pieces)  # type: ignore[arg-type]
        weights[slot] = pieces
    # decodes of 4 adapters and the base, then a long prefill run and a base prefill
    segments = [(2, 1), (-1, 2), (0, 1), (3, 1), (2, 1), (1, 1), (1, SHORT_RUN + 2), (-1, 3)]
    x = torch.randn(sum(n for _, n in segments), 6, generator=g)
    expected = base(x)
    pos = 0
    for slot, n in segments:
        for t in range(pos, pos + n):
            if slot >= 0:
                parts = [torch.zeros(2) if p is None else (x[t] @ p[0].t()) @ p[1].t() for p in weights[slot]]
                expected[t] += torch.cat(parts)
        pos += n
    dense = LoRAMapping.from_segments(segments, "cpu", num_slots=4, max_rank=3)
    assert dense is not None and dense.dense == slice(0, 6) and dense.dense_slots == slice(0, 4)
    assert dense.runs == [(1, 6, 7 + SHORT_RUN + 2)]  # the decode of slot 1 merged with its prefill
    one_by_one = LoRAMapping.from_segments(segments[-2:], "cpu", num_slots=4, max_rank=3)
    assert one_by_one is not None and one_by_one.dense is None
    # decodes of slots 2 and 3 only: the dense path reads just those slots' columns
    narrow_segments = [(2, 1), (-1, 1), (3, 1), (2, 1)]
    narrow = LoRAMapping.from_segments(narrow_segments, "cpu", num_slots=4, max_rank=3)
    assert narrow is not None and narrow.dense_slots == slice(2, 4) and not narrow.runs
    with torch.inference_mode():
        ctx.mapping = dense
        torch.testing.assert_close(lin(x), expected)
        # the run-by-run path alone, on the rows of the long run
        ctx.mapping = LoRAMapping([(1, 0, SHORT_RUN + 2)])
        rows = slice(7, 7 + SHORT_RUN + 2)
        torch.testing.assert_close(lin(x[rows]), expected[rows])
        ctx.mapping = narrow
        torch.testing.assert_close(lin(x[[0, 1, 4, 5]]), expected[[0, 1, 4, 5]])
        # one adapter's decodes side by side merge into one run
        single = LoRAMapping.from_segments([(2, 1)] * 3, "cpu", num_slots=4, max_rank=3)
        assert single is not None and single.runs == [(2, 0, 3)] and single.dense is None
        ctx.mapping = single
        torch.testing.assert_close(lin(x[[0, 5, 0]]), expected[[0, 5, 0]])
    assert LoRAMapping.from_segments([(-1, 4)], "cpu", num_slots=4, max_rank=3) is None
