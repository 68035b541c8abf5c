"""A block's stage outputs travel with its KV into the tiers and back: with the stage-output
cache on, an embedding request whose prefix left the pool (or whose engine restarted) loads the
prefix's hidden-state rows from the CPU or disk tier, and its rows equal computing from scratch."""

from __future__ import annotations

import torch

from prefixkv.llm import LLM
from prefixkv.stage_outputs import PoolingParams

from .conftest import all_free, engine, tier
from .test_engine_tiers import prompts

ALL_ROWS = PoolingParams("all", normalize=False)


def encode(llm: LLM, prompt: list[int]):
    return llm.encode([prompt], ALL_ROWS, use_tqdm=False)[0]


def test_stage_outputs_load_from_the_tiers_after_eviction_and_restart(tiny_model, tiny_loaded, tmp_path):
    ps = prompts(5, 5)
    scratch = LLM.from_engine(engine(tiny_model, tiny_loaded, enable_prefix_caching=False))
    refs = [encode(scratch, p).outputs.data for p in ps]
    folder = tmp_path / "kv"
    stage = dict(enable_stage_output_cache=True, kv_tier=f"disk:{folder}")
    eng = engine(tiny_model, tiny_loaded, kv_offloading_size=0.01, **stage)
    llm = LLM.from_engine(eng)
    first = encode(llm, ps[0])
    assert first.num_cached_tokens == 0
    torch.testing.assert_close(first.outputs.data, refs[0], atol=1e-5, rtol=1e-4)
    for p, ref in zip(ps[1:], refs[1:]):  # 44 blocks through a 32-block pool: ps[0] leaves it
        torch.testing.assert_close(encode(llm, p).outputs.data, ref, atol=1e-5, rtol=1e-4)
    again = encode(llm, ps[0])
    assert again.num_cached_tokens == 36 and tier(eng, "cpu").hits == 9  # rows read back from the CPU tier
    assert torch.equal(again.outputs.data[:36], first.outputs.data[:36])  # the very rows saved
    torch.testing.assert_close(again.outputs.data, refs[0], atol=1e-5, rtol=1e-4)
    eng.tiers.flush()
    assert all_free(eng)

    # a restarted engine: the disk tier gives the prefix's KV and rows back
    restarted = engine(tiny_model, tiny_loaded, **stage)
    back = encode(LLM.from_engine(restarted), ps[1])
    assert back.num_cached_tokens == 36 and tier(restarted, "disk").hits == 9
    torch.testing.assert_close(back.outputs.data, refs[1], atol=1e-5, rtol=1e-4)
    assert all_free(restarted)

    # an engine without the stage cache has another value layout: it never loads these values
    plain = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    assert plain.tiers.namespace != restarted.tiers.namespace
