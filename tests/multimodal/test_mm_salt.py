"""Salted requests never share encoder outputs or KV with another salt, in any hash mode. With
mm_hash="phash" two different images with the same 64-bit pHash are one item: an encoder cache
keyed by that identity alone would answer tenant B's image (other pixels, other salt) with tenant
A's encoder output. Oracle: each answer equals its own answer with every cache off."""

from __future__ import annotations

import numpy as np
import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.cache.identity import block_extra_keys
from prefixkv.multimodal.hashing import perceptual_identity
from prefixkv.request import Request

from .conftest import make_shapes_image

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
TEXT = "USER: <image>\nDescribe the picture in detail. ASSISTANT:"
OTHER_TEXT = "USER: Here is a photo. <image>\nWhat is in it? ASSISTANT:"
BS = 8


def _images():
    """A colour image and its grayscale copy: other pixels, the same pHash (pHash looks at the
    image's 8-bit luminance only, and the gray copy has the same luminance)."""
    a = make_shapes_image(0)
    b = a.convert("L").convert("RGB")
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    assert perceptual_identity(a) == perceptual_identity(b)
    return a, b


def _llm(folder, **kwargs):
    return LLM(folder, **{"num_blocks": 64, "block_size": BS, "device": "cpu", "mm_hash": "phash", **kwargs})


def _run(llm, image, salt=None, text=TEXT):
    prompt = {"prompt": text, "multi_modal_data": {"image": image}}
    if salt is not None:
        prompt["cache_salt"] = salt
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    seq = out.outputs[0]
    return (seq.token_ids, [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)]), out.num_cached_tokens


@pytest.fixture(scope="module")
def uncached(llava):
    llm = _llm(llava[0], enable_prefix_caching=False, enable_mm_encoder_cache=False)
    a, b = _images()
    return {k: _run(llm, img, text=t)[0] for k, img, t in (("a", a, TEXT), ("b", b, TEXT), ("a2", a, OTHER_TEXT))}


def test_phash_twins_under_other_salts_get_their_own_answers(llava, uncached):
    a, b = _images()
    assert uncached["a"] != uncached["b"]  # the model sees the difference
    llm = _llm(llava[0])
    stats = llm.llm_engine.get_stats
    assert _run(llm, a, "tenant-a") == (uncached["a"], 0)
    # tenant B: its image has A's pHash; neither A's KV blocks nor A's encoder output may be used
    assert _run(llm, b, "tenant-b") == (uncached["b"], 0)
    assert stats().mm_encoder_runs == 2 and stats().mm_encoder_cache_hits == 0
    # no salt is a tenant of its own too
    assert _run(llm, b) == (uncached["b"], 0)
    assert stats().mm_encoder_runs == 3

    # the same salt still shares (phash: the twins are one item, by choice of the operator):
    # other text before the image, so no KV block hits and the encoder output comes from the cache
    answer, cached = _run(llm, a, "tenant-b", text=OTHER_TEXT)
    assert cached == 0 and stats().mm_encoder_runs == 3 and stats().mm_encoder_cache_hits == 1
    assert answer != uncached["a2"]  # tenant B's own twin's encoder output (phash semantics)
    # and the same image, prompt and salt again hits its KV blocks
    _, cached = _run(llm, b, "tenant-b")
    assert cached > 0
    e = llm.llm_engine
    assert not e.has_unfinished_requests() and e.kv_cache_manager.num_free_blocks == e.num_blocks


def test_exact_mode_keeps_encoder_outputs_per_salt_too(llava, uncached):
    """The same image under two salts: the same output either way (exact identity), but a hit would
    tell a tenant that another sent the image, so each salt encodes its own."""
    a, _ = _images()
    llm = _llm(llava[0], mm_hash="exact")
    stats = llm.llm_engine.get_stats
    assert _run(llm, a, "tenant-a")[0] == uncached["a"]
    assert _run(llm, a, "tenant-b", text=OTHER_TEXT) == (uncached["a2"], 0)
    assert stats().mm_encoder_runs == 2 and stats().mm_encoder_cache_hits == 0
    assert _run(llm, a, "tenant-a", text=OTHER_TEXT) == (uncached["a2"], 0)  # same salt: shared
    assert stats().mm_encoder_runs == 2 and stats().mm_encoder_cache_hits == 1


def test_image_blocks_are_keyed_by_the_salt(llava):
    """The KV side: the salt is an extra key of block 0 and the chain carries it, so every block of
    the image - local table key and content hash (tiers, events) - differs between salts."""
    llm = _llm(llava[0])
    engine = llm.llm_engine
    ids, items = engine.process_multimodal(engine.tokenize(TEXT), {"image": _images()[0]})
    kv = engine.kv_cache_manager
    hashes = {}
    for salt in ("tenant-a", "tenant-b", None):
        req = Request(f"probe-{salt}", ids, mm_items=items, cache_salt=salt, sampling_params=SamplingParams())
        assert block_extra_keys(req, 0, BS, 0)[-1:] == ((("cache_salt", salt),) if salt else (("mm", *_mm0(items)),))
        hashes[salt] = kv.get_block_hashes(req)[: len(ids) // BS]
        kv.free(req)
    image_blocks = range(items[0].offset // BS, (items[0].offset + items[0].length) // BS)
    for i in image_blocks:
        assert len({hashes[s][i] for s in hashes}) == 3


def _mm0(items):
    return items[0].identifier, items[0].offset
