"""The real server with a LLaVA checkpoint, driven by the openai client: an image as a data URL gives
the same answer as llm.chat offline; a local file only under --allowed-local-media-path; remote URLs,
undecodable images, wrong counts and too many images are 400s that leave the server idle and
healthy; encoder-cache counters in /metrics."""

from __future__ import annotations

import httpx
import pytest

from prefixkv import LLM, SamplingParams

from ..server.conftest import Server
from .conftest import make_image
from .test_mm_chat import data_url, image_msg

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(llava, tmp_path_factory):
    media = tmp_path_factory.mktemp("served-media")
    make_image(51).save(media / "dog.png")
    server = Server(
        llava[0],
        "--served-model-name",
        "llava",
        "--block-size",
        "8",
        "--allowed-local-media-path",
        str(media),
        "--limit-mm-per-prompt",
        '{"image": 2}',
    )
    yield server, media
    server.stop()


def test_data_url_chat_equals_offline_and_counts_encoder_hits(served, llava):
    from openai import OpenAI

    server, media = served
    client = OpenAI(base_url=server.base + "/v1", api_key="none")
    img = make_image(51)
    messages = image_msg(data_url(img))
    offline = LLM(llava[0], num_blocks=64, block_size=8, device="cpu")
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    answers = []
    for url in (data_url(img), data_url(img), f"file://{media}/dog.png"):
        r = client.chat.completions.create(model="llava", messages=image_msg(url), temperature=0, max_tokens=6)
        answers.append(r.choices[0].message.content)
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model="llava", messages=messages, temperature=0, max_tokens=6, stream=True)
    answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert answers == [expected.outputs[0].text] * 4
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    m = server.wait_idle()
    assert m["prefixkv:mm_encoder_runs_total"] == 1  # one image, three requests
    assert m["prefixkv:mm_encoder_cache_queries_total"] >= 1


@pytest.mark.parametrize(
    "messages, needle",
    [
        (image_msg("https://example.com/cat.png"), "does not fetch from the network"),
        (image_msg("data:image/png;base64,bm90IGFuIGltYWdl"), "cannot be decoded"),
        (image_msg("file:///etc/hostname"), "outside the allowed local media path"),
        (image_msg(data_url(make_image(1)), text="two? <image>"), "2 image tokens"),
        (image_msg(*[data_url(make_image(i)) for i in range(3)]), "at most 2"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "input_audio"),
    ],
)
def test_bad_images_are_400(served, messages, needle):
    server, _ = served
    r = httpx.post(
        server.base + "/v1/chat/completions", json={"model": "llava", "messages": messages, "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert server.healthy()
    server.wait_idle()


def test_completions_with_an_image_token_but_no_image_is_400(served):
    server, _ = served
    r = httpx.post(server.base + "/v1/completions", json={"model": "llava", "prompt": "<image> hi", "max_tokens": 2})
    assert r.status_code == 400 and "1 image tokens" in r.json()["error"]["message"], r.text
    server.wait_idle()


def test_a_1xN_image_is_a_prompt_400(served):
    """A tiny PNG of 1 x 20,000 pixels would be resized to 30 x 600,000 (the issue's 1 x 300,000 to
    +2.6 GB at CLIP's 224): refused from its header with a 400 naming the limit, the server healthy."""
    import base64

    from .test_mm_chat import long_strip_png

    server, _ = served
    for data in (long_strip_png(20_000), long_strip_png(300_000)):
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        r = httpx.post(
            server.base + "/v1/chat/completions",
            json={"model": "llava", "messages": image_msg(url), "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert "aspect ratio" in r.json()["error"]["message"] and "at most 200" in r.json()["error"]["message"]
    assert server.healthy()
    server.wait_idle()
