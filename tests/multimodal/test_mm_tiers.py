"""KV tiers on a LLaVA checkpoint: an image prompt's blocks are served from a disk tier by a new
engine of the same checkpoint, and not by one whose vision tower differs (the
namespace covers the vision tower's weights, the LLaVA config and the image preprocessing; image
blocks are keyed by the image's identity, which says nothing of the encoder that embedded it)."""

from __future__ import annotations

import torch

from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine_args import EngineArgs
from prefixkv.model import load_model
from prefixkv.sampling_params import SamplingParams

from .conftest import make_image

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TEXT = "USER: <image>\nDescribe the picture in detail. ASSISTANT:"


def _engine(folder, loaded, **kw) -> LLMEngine:
    args = dict(block_size=8, num_blocks=64, dtype="float32", device="cpu", **kw)
    return LLMEngine(EngineArgs(model=folder, **args), loaded=loaded)


def _run(eng: LLMEngine, image):
    rid = eng.add_request(TEXT, GREEDY, multi_modal_data={"image": image})
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.error is None
    return final.outputs[0].token_ids, final.num_cached_tokens


def test_image_blocks_from_a_disk_tier_only_for_the_same_vision_tower(llava, tmp_path):
    folder, image, tier = llava[0], make_image(70), f"disk:{tmp_path / 'kv'}"
    loaded = load_model(folder, dtype=torch.float32, device="cpu")
    expected = _run(_engine(folder, loaded, enable_prefix_caching=False), image)[0]
    first = _engine(folder, loaded, kv_tier=tier)
    assert _run(first, image) == (expected, 0)
    first.tiers.flush()
    second = _engine(folder, loaded, kv_tier=tier)
    out, cached = _run(second, image)
    assert out == expected and cached > 0  # a restart of the same checkpoint loads the image's blocks

    other = load_model(folder, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        next(iter(other.multimodal.encoder.parameters())).add_(0.5)  # the vision tower only
    other_expected = _run(_engine(folder, other, enable_prefix_caching=False), image)[0]
    third = _engine(folder, other, kv_tier=tier)
    assert third.tiers.namespace != first.tiers.namespace
    assert _run(third, image) == (other_expected, 0)
