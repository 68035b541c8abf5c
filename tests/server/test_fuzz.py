"""Random JSON bodies shaped like the request schema against a real server, with its steps in
order and scheduled ahead (a GPU's default): never a 5xx, the server keeps serving, and no KV
block is held afterwards."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import HTTP

pytestmark = pytest.mark.slow  # real server subprocesses: deselected by make test-fast


@pytest.fixture(scope="module", params=["in order", "ahead", "ahead, tight, tiered"])
def server(make_server, request):
    """The server as a CPU runs it, and with async scheduling as a GPU does by default (steps
    launched before the previous step's tokens are read); then ahead over a KV cache of 40 blocks
    (steps ahead preempt) with a CPU tier under it (every completed block copied out)."""
    extra: tuple[str, ...] = ()
    if request.param != "in order":
        extra = ("--async-scheduling",)
    if "tight" in request.param:
        extra += ("--num-gpu-blocks-override", "40", "--max-model-len", "320", "--kv-offloading-size", "0.05")
    return make_server("--max-n", "4", "--max-prompts-per-request", "3", *extra)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, -1, 20, 21, 2**63, 2**64 - 1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["\ud800", "", "<|im_end|>", "\x00"]),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


def strategies(wild: bool) -> dict[str, st.SearchStrategy]:
    """Typed bodies pass the schema, so the engine's own checks and the engine itself are reached
    (values of each field's type, edge values included); wild ones have anything in any field."""

    def mostly(typed: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(typed, junk) if wild else typed

    edge_floats = st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.sampled_from([0.0, 1.0, 1e-9, 1e308, -0.0])
    )
    edge_ints = st.one_of(st.integers(-3, 30), st.sampled_from([2**31, 2**63, 2**64 - 1, 2**64, -(2**64)]))
    texts = st.one_of(st.text(max_size=30), st.sampled_from(["\ud800", "<|im_end|>", "\x00", "Hello world"]))
    token_ids = st.lists(st.one_of(st.integers(0, 49151), st.integers(-5, 10**6)), max_size=6)
    fields = {
        "n": mostly(st.integers(-1, 6)),
        "temperature": mostly(edge_floats),
        "top_p": mostly(edge_floats),
        "top_k": mostly(edge_ints),
        "min_p": mostly(edge_floats),
        "seed": mostly(edge_ints),
        "stop": mostly(st.one_of(texts, st.lists(texts, max_size=3))),
        "stop_token_ids": mostly(token_ids),
        "presence_penalty": mostly(edge_floats),
        "frequency_penalty": mostly(edge_floats),
        "repetition_penalty": mostly(edge_floats),
        "min_tokens": mostly(st.integers(-1, 6)),
        "ignore_eos": mostly(st.booleans()),
        "include_stop_str_in_output": mostly(st.booleans()),
        "skip_special_tokens": mostly(st.booleans()),
        "cache_salt": mostly(texts),
        "request_id": mostly(texts),
        "prompt_logprobs": mostly(edge_ints),
        "stream": mostly(st.booleans()),
        "stream_options": mostly(
            st.fixed_dictionaries(
                {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
            )
        ),
        "user": mostly(texts),
        "model": mostly(st.sampled_from([None, "nope", "HuggingFaceTB/SmolLM2-135M-Instruct"])),
    }
    if wild:
        fields.update(response_format=junk, tools=junk, unknown_field=junk)
    field_values = st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys})
    )
    words = st.text(min_size=1, max_size=30)
    ids = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
    prompts = mostly(
        st.one_of(
            words, ids, texts, token_ids, st.lists(words, min_size=1, max_size=3), st.lists(ids, min_size=1, max_size=3)
        )
    )
    parts = st.lists(st.fixed_dictionaries({"type": mostly(st.just("text")), "text": mostly(texts)}), max_size=2)
    messages = mostly(
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": mostly(st.sampled_from(["user", "system", "assistant"])),
                    "content": mostly(st.one_of(texts, parts)),
                }
            ),
            min_size=1,
            max_size=3,
        )
    )
    small = st.one_of(st.none(), st.integers(0, 5), edge_ints)  # mostly valid lengths and counts
    return {
        "fields": field_values,
        "prompts": prompts,
        "messages": messages,
        "ints": mostly(small),
        "bools": mostly(st.booleans()),
    }


TYPED = strategies(wild=False)
ANY = strategies(wild=True)


def _bounded(body: dict, length_keys: tuple[str, ...]) -> dict:
    """Keep valid requests cheap: lengths that would be accepted are made small (invalid ones
    stay as they are, to be refused)."""
    for key in length_keys:
        v = body.get(key)
        if v is None:  # None means "the rest of the context": up to a thousand tokens
            body[key] = 3
        elif isinstance(v, int) and not isinstance(v, bool) and v > 4:
            body[key] = 4
    body.setdefault("model", None)
    if body["model"] is None:
        del body["model"]
    return body


def _check(server, path: str, body: dict) -> None:
    try:
        content = json.dumps(body)
    except (ValueError, TypeError):
        return
    with HTTP.stream(
        "POST", server.base + path, content=content, headers={"Content-Type": "application/json"}, timeout=120
    ) as r:
        text = "".join(r.iter_text())
    assert r.status_code < 500, (r.status_code, text[:500], content[:500])
    for line in text.splitlines():  # a streamed response's error event: never an internal error
        if line.startswith("data: {") and '"error"' in line:
            assert json.loads(line[6:])["error"]["code"] < 500, (line, content[:500])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("kind", ["typed", "wild"])
@given(data=st.data())
def test_fuzz_completions(server, kind, data):
    s = TYPED if kind == "typed" else ANY
    body = {
        **data.draw(s["fields"]),
        "prompt": data.draw(s["prompts"]),
        "max_tokens": data.draw(s["ints"]),
        "logprobs": data.draw(s["ints"]),
        "echo": data.draw(st.booleans()),
    }
    _check(server, "/v1/completions", _bounded(body, ("max_tokens",)))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("kind", ["typed", "wild"])
@given(data=st.data())
def test_fuzz_chat(server, kind, data):
    s = TYPED if kind == "typed" else ANY
    body = {
        **data.draw(s["fields"]),
        "messages": data.draw(s["messages"]),
        "max_completion_tokens": data.draw(s["ints"]),
        "top_logprobs": data.draw(s["ints"]),
        "logprobs": data.draw(s["bools"]),
    }
    _check(server, "/v1/chat/completions", _bounded(body, ("max_completion_tokens",)))


def test_after_fuzzing_nothing_is_held(server):
    assert server.healthy()
    server.wait_idle()
    r = HTTP.post(server.base + "/v1/completions", json={"prompt": "Still here?", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
