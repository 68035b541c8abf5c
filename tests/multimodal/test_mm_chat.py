"""llm.chat with image parts (data URLs, local files under allowed_local_media_path, PIL images), and
bad input: an undecodable image, a remote URL, a wrong count of image tokens, too many images, an
image on a text-only model - each a clear ValueError, with nothing left behind."""

from __future__ import annotations

import base64
import io

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine_args import EngineArgs

from .conftest import make_image

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def data_url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_msg(*urls, text="What is in the picture?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


@pytest.fixture(scope="module")
def llm(llava, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    make_image(41).save(media / "cat.png")
    return LLM(
        llava[0],
        num_blocks=64,
        block_size=8,
        device="cpu",
        allowed_local_media_path=str(media),
        limit_mm_per_prompt={"image": 2},
    )


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_chat_with_image_parts_equals_generate(llm):
    img = make_image(41)
    media = llm.llm_engine.config.allowed_local_media_path
    prompt = "USER: <image>\nWhat is in the picture? ASSISTANT:"
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)  # chat adds no BOS: the template would
    expected = _tokens(
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)
    )
    by_url = llm.chat(image_msg(data_url(img)), GREEDY, use_tqdm=False)
    by_file = llm.chat(image_msg(f"file://{media}/cat.png"), GREEDY, use_tqdm=False)
    by_pil = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": img},
                    {"type": "text", "text": "What is in the picture?"},
                ],
            }
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert _tokens(by_url) == _tokens(by_file) == _tokens(by_pil) == expected
    # two images and a text-only turn in one batch
    two = llm.chat(
        [image_msg(data_url(img), data_url(make_image(42))), [{"role": "user", "content": "no image"}]],
        GREEDY,
        use_tqdm=False,
    )
    assert two[0].prompt_token_ids.count(258) == 50 and 258 not in two[1].prompt_token_ids


@pytest.mark.parametrize(
    "messages, needle",
    [
        (image_msg("https://example.com/cat.png"), "does not fetch from the network"),
        (image_msg("http://127.0.0.1/cat.png"), "does not fetch from the network"),
        (image_msg("data:image/png;base64,bm90IGFuIGltYWdl"), "cannot be decoded"),
        (image_msg("data:image/png;base64,@@@"), "base64"),
        (image_msg("data:text/plain;base64,aGk="), "not an image"),
        (image_msg("file:///etc/passwd"), "outside the allowed local media path"),
        (image_msg("ftp://x/y.png"), "unsupported URL scheme"),
        (image_msg(data_url(make_image(1)), text="see <image> here"), "2 image tokens"),
        (image_msg(*[data_url(make_image(i)) for i in range(3)]), "at most 2"),
        ([{"role": "user", "content": [{"type": "video_url", "video_url": "x"}]}], "video_url"),
    ],
)
def test_chat_bad_images_are_refused(llm, messages, needle):
    with pytest.raises(ValueError, match=needle):
        llm.chat(messages, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_generate_bad_multimodal_inputs_are_refused(llm):
    img = make_image(3)
    cases = [
        ({"prompt": "<image> and <image>", "multi_modal_data": {"image": img}}, "2 image tokens"),
        ({"prompt": "no token", "multi_modal_data": {"image": img}}, "0 image tokens"),
        ({"prompt": "<image>", "multi_modal_data": {"image": b"\x89PNG broken"}}, "cannot be decoded"),
        ({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, "PIL image"),
        ({"prompt": "<image>", "multi_modal_data": {"video": [img]}}, "only images"),
        ({"prompt": "<image>", "multi_modal_data": img}, "must be a dict"),
        ({"prompt": "<image>", "multi_modal_uuids": {"image": ["a"]}}, "multi_modal_uuids"),
    ]
    for prompt, needle in cases:
        # a good prompt first in the batch: all or nothing
        good = {"prompt": "<image>", "multi_modal_data": {"image": img}}
        with pytest.raises(ValueError, match=needle):
            llm.generate([good, prompt], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_image_on_a_text_only_model_is_refused(default_lm):
    llm = LLM.from_engine(LLMEngine(EngineArgs(device="cpu", num_blocks=16, max_model_len=128), loaded=default_lm))
    with pytest.raises(ValueError, match="text-only"):
        llm.chat(image_msg(data_url(make_image(1))), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="text-only"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": make_image(1)}}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def long_strip_png(long: int, truncate: bool = False) -> bytes:
    """A 1 x `long` PNG (a few hundred bytes); `truncate` cuts its pixel data so that decoding fails."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (long, 1), (200, 10, 10)).save(buf, format="PNG")
    data = buf.getvalue()
    return data[:60] if truncate else data


def test_a_1xN_image_is_refused_before_it_is_decoded_or_resized(llm, monkeypatch):
    """Resizing a 1 x N image's short edge up to the model's size made it size x (N * size) pixels
    (a 661-byte 1 x 300,000 PNG took +2.6 GB): the aspect ratio is refused from the header, before
    the pixels are decoded (decoding is made to fail here, and the truncated strip could not be
    decoded anyway) or resized."""
    from PIL import Image

    def no_decoding(self, *args, **kwargs):
        raise RuntimeError("the refused image was decoded")

    strips = (long_strip_png(20_000), long_strip_png(300_000, truncate=True))
    with monkeypatch.context() as patched:
        patched.setattr(Image.Image, "load", no_decoding)
        patched.setattr(Image.Image, "resize", no_decoding)
        for data in strips:
            with pytest.raises(ValueError, match="aspect ratio .* at most 200"):
                llm.generate({"prompt": "<image>", "multi_modal_data": {"image": data}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="aspect ratio"):
        llm.chat(image_msg("data:image/png;base64," + base64.b64encode(long_strip_png(20_000)).decode()), GREEDY)
    # the bound is on the ratio: 200:1 is taken
    ok = llm.generate(
        {"prompt": "<image>", "multi_modal_data": {"image": make_image(5, size=(2000, 10))}}, GREEDY, use_tqdm=False
    )
    assert len(ok[0].outputs[0].token_ids) == 4
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_the_processed_size_is_bounded_before_resizing():
    """A checkpoint whose resize target is large: the size an image would be resized to is checked
    before PIL allocates it."""
    from PIL import Image

    from prefixkv.model.llava.processor import MAX_PROCESSED_PIXELS, ImageProcessor

    proc = ImageProcessor(size={"shortest_edge": 4096}, crop_size={"height": 4096, "width": 4096})
    with pytest.raises(ValueError, match=f"at most {MAX_PROCESSED_PIXELS} pixels"):
        proc(Image.new("RGB", (20_000, 100)))  # ratio 200: taken, but 819,200 x 4,096 after resizing
    assert proc(Image.new("RGB", (40, 30))).shape == (3, 4096, 4096)
