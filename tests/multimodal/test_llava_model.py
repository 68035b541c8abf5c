"""A tiny random LLaVA 1.5 checkpoint written by transformers, loaded by prefixkv: the image
preprocessing equals transformers' CLIP processor pixel for pixel, the placeholder expansion equals
its LlavaProcessor's, the vision tower + projector equal its image features, and greedy tokens
equal transformers' for prompts with one and two images (caching off, on, chunked)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from prefixkv import LLM, SamplingParams
from prefixkv.model.llava.loader import split_llava_name

from .conftest import make_image
from .llava_builder import IMAGE_TOKEN_ID, build_llava, hf_llava_greedy

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_processor(llava):
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder, _ = llava
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{folder}/tokenizer.json", bos_token="<s>", eos_token="</s>")
    return LlavaProcessor(
        image_processor=CLIPImageProcessorPil.from_pretrained(folder),
        tokenizer=tok,
        patch_size=6,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def _odd_images():
    rgba = make_image(5, (33, 41), "RGBA")
    alpha = np.array(rgba)
    alpha[..., 3] = np.linspace(0, 255, alpha.shape[1], dtype=np.uint8)[None, :]
    palette = make_image(6, (50, 20)).convert("P")
    palette.info["transparency"] = 3
    return [
        make_image(1, (40, 48)),
        make_image(2, (48, 40)),
        make_image(3, (30, 30)),
        make_image(4, (17, 90)),  # the long edge rounds down
        make_image(7, (12, 9)),  # upscaled
        Image.fromarray(alpha, "RGBA"),  # composited onto white
        make_image(8, (64, 64), "L"),
        palette,
        make_image(9, (31, 1000)),
    ]


def _transformers_composites_onto_white() -> bool:
    """transformers' own RGB conversion composites transparency onto white (as prefixkv's does)
    since 5.2x; 5.17 (on the lent GPU machine, 2026-11-26) dropped the alpha channel instead."""
    from transformers.image_transforms import convert_to_rgb

    clear = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    return np.asarray(convert_to_rgb(clear)).reshape(-1)[:3].tolist() == [255, 255, 255]


def test_preprocessing_equals_transformers_clip_processor(llava, hf_processor):
    mm = LLM(llava[0], num_blocks=8, block_size=8, device="cpu").llm_engine.loaded.multimodal
    images = _odd_images()
    if not _transformers_composites_onto_white():  # an older oracle: only the opaque images compare
        images = [img for img in images if "A" not in img.getbands() and "transparency" not in img.info]
    for img in images:
        ours = mm.processor(img)
        ref = hf_processor.image_processor(img, return_tensors="np")["pixel_values"][0]
        assert ours.dtype == np.float32 and ours.shape == ref.shape == (3, 30, 30)
        assert np.array_equal(ours, ref), (img.mode, img.size)


def test_llava_tensor_names_both_layouts():
    assert split_llava_name("language_model.model.layers.0.mlp.up_proj.weight") == (
        "text",
        "model.layers.0.mlp.up_proj.weight",
    )
    assert split_llava_name("model.language_model.layers.0.mlp.up_proj.weight") == (
        "text",
        "model.layers.0.mlp.up_proj.weight",
    )
    assert split_llava_name("language_model.lm_head.weight") == ("text", "lm_head.weight")
    assert split_llava_name("lm_head.weight") == ("text", "lm_head.weight")
    assert split_llava_name("vision_tower.vision_model.pre_layrnorm.weight") == ("vision", "pre_layrnorm.weight")
    assert split_llava_name("model.vision_tower.encoder.layers.1.mlp.fc1.bias") == (
        "vision",
        "encoder.layers.1.mlp.fc1.bias",
    )
    assert split_llava_name("model.multi_modal_projector.linear_2.weight") == ("vision", "projector.linear_2.weight")


@pytest.mark.parametrize("strategy, layer", [("full", [-3, -1]), ("default", 1)])
def test_vision_encoder_equals_transformers_image_features(tmp_path, strategy, layer):
    """Other feature layers (a list is concatenated) and the "full" strategy (CLS kept)."""
    hf = build_llava(tmp_path, vision_feature_layer=layer, strategy=strategy, seed=3)
    llm = LLM(str(tmp_path), num_blocks=8, block_size=8, device="cpu")
    mm = llm.llm_engine.loaded.multimodal
    pixels = torch.stack([torch.from_numpy(mm.processor(make_image(s))) for s in (1, 2)])
    ours = mm.encoder.encode(pixels)
    with torch.inference_mode():
        ref = torch.stack(list(hf.get_image_features(pixel_values=pixels).pooler_output))
    assert ours.shape == ref.shape == (2, mm.tokens_per_image, 64)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


PROMPTS = [
    ("USER: <image>\nWhat is shown here? ASSISTANT:", [1]),
    ("USER: <image>\n<image>\nWhich of the two is brighter? ASSISTANT:", [2, 3]),
    ("<image>", [4]),  # the image is the whole prompt (after BOS)
    ("USER: compare <image> with <image>, then the first again. ASSISTANT:", [5, 1]),
]


def test_greedy_equals_transformers_with_one_and_two_images(llava, hf_processor):
    folder, hf = llava
    expected, prompts = [], []
    for text, seeds in PROMPTS:
        images = [make_image(s) for s in seeds]
        ref = hf_processor(text=text, images=images, return_tensors="pt")
        ids = [256] + ref["input_ids"][0].tolist()  # our tokenizer adds BOS (add_bos_token)
        expected.append(hf_llava_greedy(hf, ids, ref["pixel_values"], MAX_NEW))
        prompts.append(({"prompt": text, "multi_modal_data": {"image": images}}, ids))
    assert len({tuple(e) for e in expected}) == len(expected)  # the images and prompts matter
    settings = [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=16),  # images split across prefill chunks
        dict(enable_mm_encoder_cache=False),
    ]
    for kwargs in settings:
        llm = LLM(folder, **{"num_blocks": 96, "block_size": 8, "device": "cpu", **kwargs})
        for _ in range(1 if kwargs.get("enable_prefix_caching") is False else 2):  # round 2 hits the caches
            outs = llm.generate([p for p, _ in prompts], GREEDY, use_tqdm=False)
            for out, (_, ids), exp in zip(outs, prompts, expected):
                assert out.prompt_token_ids == ids
                assert out.outputs[0].token_ids == exp, kwargs
        engine = llm.llm_engine
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        assert IMAGE_TOKEN_ID in engine.loaded.tokenizer.encode("<image>")


@pytest.mark.parametrize("text_model", ["qwen2", "mistral"])
def test_other_decoders_equal_transformers(tmp_path, hf_processor, text_model):
    """LLaVA with a Qwen2 (qkv bias) or Mistral decoder: the decoder is prefixkv's shared one."""
    hf = build_llava(tmp_path, text_model=text_model, seed=5)
    text = "USER: <image>\nWhat is shown here? ASSISTANT:"
    img = make_image(9)
    ref = hf_processor(text=text, images=[img], return_tensors="pt")
    ids = [256] + ref["input_ids"][0].tolist()
    expected = hf_llava_greedy(hf, ids, ref["pixel_values"], MAX_NEW)
    llm = LLM(str(tmp_path), num_blocks=32, block_size=8, device="cpu")
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)[0]
    assert (
        llm.llm_engine.model_config.architecture
        == {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[text_model]
    )
    assert out.outputs[0].token_ids == expected


@pytest.mark.slow(seconds=8)
def test_steps_with_images_replay_over_fixed_buffers(llava, hf_processor, monkeypatch):
    """Under cudagraph_mode FULL every step takes the fixed buffers a CUDA graph replays (on a CPU
    uncaptured under Triton's interpreter): the mixed steps splicing image rows - chunks of 16
    tokens, images split across them - through the image-row buffer, and the decode steps after
    them. Greedy tokens equal transformers' for prompts with one and two images, scheduled ahead;
    a second round over the cached prefixes splices the rows its hits leave (the image-only
    prompt's last block is computed again: a lookup stops before the last token)."""
    from ..model.triton_interpreter import device, kernels_module

    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    folder, hf = llava
    # three tokens a request: two decode steps over the buffers after the prompt's (each step of
    # Triton's interpreter costs ~1 s here)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts, expected = [], []
    for text, seeds in PROMPTS[:3]:  # one image, two, and an image alone
        images = [make_image(s) for s in seeds]
        ref = hf_processor(text=text, images=images, return_tensors="pt")
        expected.append(hf_llava_greedy(hf, [256] + ref["input_ids"][0].tolist(), ref["pixel_values"], 3))
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    llm = LLM(
        folder,
        num_blocks=128,
        block_size=8,
        device=str(device()),
        dtype="float32",
        async_scheduling=True,
        max_num_batched_tokens=16,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16], "cudagraph_mode": "FULL"},
    )
    engine = llm.llm_engine
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.image_rows is not None
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert graphs.replays > 0 and graphs.image_rows.steps > 0
    image_steps = graphs.image_rows.steps
    again = llm.generate(prompts[::-1], greedy, use_tqdm=False)  # over the first round's blocks
    assert [o.outputs[0].token_ids for o in again] == expected[::-1]
    assert all(o.num_cached_tokens > 0 for o in again)
    assert graphs.image_rows.steps > image_steps
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    # a step of one token a request whose token is a placeholder: a mixed graph (decode graphs take no image rows)
    from prefixkv.engine.scheduler_output import ScheduledRequest

    one = ScheduledRequest("r", [IMAGE_TOKEN_ID], 5, [1], True, GREEDY, None, [], [])
    assert graphs.kind([one]) == "decode"
    placeholder = dataclasses.replace(one, mm_inputs=(object(),))
    assert graphs.kind([one, placeholder]) == "mixed" and engine.runner.graph_kind([one, placeholder]) == "mixed"
