"""mm_hash: exact (default) vs phash on a JPEG re-compressed copy of an image. Exact: the copy is a
different item (no prefix hit, its own encoder run, its own answer). Perceptual: the copy has the
same 64-bit pHash, so it is the same item - it hits the original's blocks and encoder output and so
gets the original's answer, to the last bit of its logprobs."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from prefixkv import LLM, SamplingParams
from prefixkv.multimodal.hashing import perceptual_identity

from .conftest import make_shapes_image

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
TEXT = "USER: <image>\nDescribe the picture in detail. ASSISTANT:"


def _jpeg_copy(img: Image.Image, quality: int = 75) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def test_exact_vs_perceptual_identity_on_a_jpeg_copy(llava):
    original = make_shapes_image(0)
    copy = _jpeg_copy(original)
    assert not np.array_equal(np.asarray(original), np.asarray(copy))  # the pixels differ
    assert perceptual_identity(original) == perceptual_identity(copy)  # the pHash does not
    original_prompt, copy_prompt = ({"prompt": TEXT, "multi_modal_data": {"image": img}} for img in (original, copy))

    def engine(**kwargs):
        return LLM(llava[0], num_blocks=64, block_size=8, device="cpu", **kwargs)

    def run(llm, prompt):
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        return out, (
            out.outputs[0].token_ids,
            [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
        )

    exact = engine()
    _, orig_alone = run(exact, original_prompt)
    copy_out, copy_alone = run(exact, copy_prompt)
    assert copy_out.num_cached_tokens == 0  # the image starts in block 0: the copy hits nothing
    assert copy_alone[1] != orig_alone[1]  # the model sees the difference (in its logprobs at least)
    again, orig_hit = run(exact, original_prompt)  # the original again: every whole block hits
    n = len(again.prompt_token_ids)
    assert again.num_cached_tokens == (n - 1) // 8 * 8
    assert exact.llm_engine.get_stats().mm_encoder_runs == 2

    phash = engine(mm_hash="phash")
    assert run(phash, original_prompt)[1] == orig_alone
    copy_out, copy_phash = run(phash, copy_prompt)
    assert copy_out.num_cached_tokens == (n - 1) // 8 * 8  # the copy hit the original's blocks ...
    assert copy_phash == orig_hit  # ... and is answered exactly as the original is
    stats = phash.llm_engine.get_stats()
    assert stats.mm_encoder_runs == 1  # the copy was never encoded: its image lies in hit blocks only
    for llm in (exact, phash):
        assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks
