"""Image-aware prefix caching and the encoder cache, through llm.generate: block keys carry the
image's identity and offset, outputs with caching equal outputs without, an image
split between a cached block and an uncached one recomputes only the rest from the encoder cache,
and every KV block is free afterwards."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.multimodal import EncoderCache

from .conftest import make_image

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BS = 8


def _llm(folder, **kwargs):
    return LLM(folder, **{"num_blocks": 96, "block_size": BS, "device": "cpu", **kwargs})


def _prompt(text, *images):
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


@pytest.fixture(scope="module")
def reference(llava):
    """Outputs with every cache off: the oracle (itself equal to transformers, test_llava_model.py)."""
    llm = _llm(llava[0], enable_prefix_caching=False, enable_mm_encoder_cache=False)

    def run(prompt):
        return llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    return run


def _free(llm):
    e = llm.llm_engine
    assert not e.has_unfinished_requests()
    assert e.kv_cache_manager.num_free_blocks == e.num_blocks
    return True


def test_block_keys_carry_image_identity_and_offset(llava):
    llm = _llm(llava[0])
    engine = llm.llm_engine
    ids, items = engine.process_multimodal(engine.tokenize("ab<image>cdefgh"), {"image": make_image(1)})
    (item,) = items
    assert (item.offset, item.length) == (3, 25) and ids[3:28] == [258] * 25
    assert item.identifier.startswith("sha256:")
    from prefixkv.cache.identity import block_extra_keys
    from prefixkv.request import Request

    req = Request("r", ids, mm_items=items)
    keys = [block_extra_keys(req, i * BS, (i + 1) * BS, i) for i in range(len(ids) // BS)]
    assert keys == [
        (("mm", item.identifier, 3),),
        (("mm", item.identifier, -5),),
        (("mm", item.identifier, -13),),
        (("mm", item.identifier, -21),),
    ]


def test_seed_003_image_split_between_cached_and_uncached_block(llava, reference):
    """Blocks of 8: BOS a b, then the 25 image tokens at 3..27, then text. The second request shares
    the first three blocks (all image) and differs from position 28 on, so block 3 (image rows 21-24
    and text) is computed again: its image rows come from the encoder cache - one encoder run in all."""
    img = make_image(11)
    first, second = _prompt("ab<image>xyzw tell me", img), _prompt("ab<image>qrst other", img)
    for encoder_cache in (True, False):
        llm = _llm(llava[0], enable_mm_encoder_cache=encoder_cache)
        out1 = llm.generate(first, GREEDY, use_tqdm=False)[0]
        out2 = llm.generate(second, GREEDY, use_tqdm=False)[0]
        assert out1.outputs[0].token_ids == reference(first)
        assert out2.outputs[0].token_ids == reference(second)
        assert out2.num_cached_tokens == 24  # three whole blocks, the image's tail is recomputed
        stats = llm.llm_engine.get_stats()
        assert stats.mm_encoder_runs == (1 if encoder_cache else 2)
        assert stats.mm_encoder_cache_hits == (1 if encoder_cache else 0)
        assert _free(llm)


def test_different_image_or_offset_gets_no_hit(llava, reference):
    a, b = make_image(21), make_image(22)
    llm = _llm(llava[0])
    base = _prompt("ab<image> what is it", a)
    llm.generate(base, GREEDY, use_tqdm=False)
    # the same position, another image: only the text before it could match, and it is < a block
    other = _prompt("ab<image> what is it", b)
    out = llm.generate(other, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference(other)
    # the same image one token later: every block the image touches has another offset
    shifted = _prompt("abc<image> what is it", a)
    out = llm.generate(shifted, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference(shifted)
    # the same image and text again: everything but the last token's block hits
    again = llm.generate(base, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # 39 tokens: four whole blocks
    assert again.outputs[0].token_ids == reference(base)
    stats = llm.llm_engine.get_stats()
    assert stats.mm_encoder_runs == 2  # a and b; the shifted request took a's output from the cache
    assert _free(llm)


def test_caching_on_equals_off_for_many_requests(llava, reference):
    """Many questions about the same images in one batch, chunked prefill, two images per prompt."""
    imgs = [make_image(s) for s in (31, 32, 33)]
    prompts = [_prompt(f"USER: <image>\nquestion {i}? ASSISTANT:", imgs[i % 3]) for i in range(6)] + [
        _prompt("USER: <image> vs <image>: which? ASSISTANT:", imgs[0], imgs[1])
    ] * 2
    llm = _llm(llava[0], max_num_batched_tokens=40)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p)
    stats = llm.llm_engine.get_stats()
    assert stats.mm_encoder_runs == 3  # each image once, however many requests and chunks use it
    assert stats.prefix_cache_hits > 0
    assert _free(llm)
    # too few blocks for the batch: requests are preempted and recomputed, images included
    small = _llm(llava[0], num_blocks=12, max_model_len=96)
    outs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p) for p in prompts]
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert _free(small)
    # decode steps scheduled before the previous step's tokens are read; prompts with images
    # admitted behind them
    ahead = _llm(llava[0], max_num_batched_tokens=40, async_scheduling=True)
    outs = ahead.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference(p) for p in prompts]
    assert ahead.llm_engine.num_steps_ahead > 0
    assert _free(ahead)


def test_encoder_cache_lru_and_budget():
    import torch

    row = torch.zeros(4, 8)  # 128 bytes
    cache = EncoderCache(300)
    cache.put("a", row)
    cache.put("b", row.clone())
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", row.clone())  # evicts b
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.bytes_used == 256 and cache.evictions == 1
    cache.put("huge", torch.zeros(100, 8))  # larger than the budget: not kept, nothing evicted
    assert "huge" not in cache and len(cache) == 2
    off = EncoderCache(0)
    off.put("a", row)
    assert off.get("a") is None and len(off) == 0
    s = cache.stats()
    assert (s.queries, s.hits, s.entries) == (1, 1, 2)


def test_chunks_and_prefix_hits_take_only_the_rows_they_need():
    """The scheduler -> runner contract (no model): each chunk carries, for every item it overlaps,
    the item's rows that fall inside it and where they go; a prefix hit that covers an item's first
    rows leaves only the rest to the first chunk."""
    from prefixkv.engine.model_runner_output import ModelRunnerOutput
    from prefixkv.engine.scheduler import Scheduler
    from prefixkv.multimodal.encoder_input import EncoderInput
    from prefixkv.request import MultiModalItem, Request

    s = Scheduler(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=6)
    img, pix = MultiModalItem("img", 2, 9, "pixels"), "pixels"
    tokens = [1, 2] + [9] * 9 + [3, 4, 5]  # the image at 2..10
    a = Request("a", tokens, mm_items=[img], sampling_params=SamplingParams(max_tokens=1))
    s.add_request(a)
    chunks = []
    while a.num_computed_tokens < len(tokens):
        step = s.schedule()
        chunks.append(step.scheduled[0].mm_inputs)
        s.update_from_output(
            step,
            ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[7])
            if a.num_computed_tokens + len(step.scheduled[0].token_ids) == len(tokens)
            else ModelRunnerOutput(),
        )
    assert chunks == [
        (EncoderInput("img", pix, (0, 4), 2),),  # tokens 0-5: image rows 0-3 at chunk positions 2-5
        (EncoderInput("img", pix, (4, 9), 0),),  # tokens 6-11: rows 4-8 from position 0
        (),  # tokens 12-13: text only
    ]
    s.finish_request(a, a.status)
    # the same prompt again: blocks 0-2 (tokens 0-11) hit, the image's rows are all behind it
    b = Request("b", tokens[:12] + [6, 6, 6], mm_items=[img], sampling_params=SamplingParams(max_tokens=1))
    s.add_request(b)
    assert s.schedule().scheduled[0].mm_inputs == ()
    # the image with other text after it: a hit of two blocks (tokens 0-7) leaves its rows 6-8
    c = Request("c", tokens[:11] + [8, 8, 8, 8], mm_items=[img], sampling_params=SamplingParams(max_tokens=1))
    s.add_request(c)
    (sr,) = [x for x in s.schedule().scheduled if x.req_id == "c"]
    assert sr.start == 8 and sr.mm_inputs == (EncoderInput("img", pix, (6, 9), 0),)


def test_stage_output_cache_serves_image_positions_hidden_states(llava):
    """The stage-output cache keeps the per-token outputs of image positions like any other: a
    second request sharing the image's blocks reads them back, and every position's hidden state
    equals the no-cache engine's."""
    import torch

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, return_hidden_states=True)
    image = make_image(7)
    prompts = [
        _prompt("USER: <image>\nWhat is this? ASSISTANT:", image),
        _prompt("USER: <image>\nAnd now? ASSISTANT:", image),
    ]
    cached = _llm(llava[0], enable_stage_output_cache=True)
    plain = _llm(llava[0], enable_prefix_caching=False, enable_mm_encoder_cache=False)
    first, second = (cached.generate(p, params, use_tqdm=False)[0] for p in prompts)
    assert second.num_cached_tokens >= 24  # the image's blocks, KV and hidden states
    for out, prompt in zip((first, second), prompts):
        ref = plain.generate(prompt, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        torch.testing.assert_close(out.hidden_states, ref.hidden_states, atol=1e-4, rtol=1e-4)
    assert _free(cached) and _free(plain)
