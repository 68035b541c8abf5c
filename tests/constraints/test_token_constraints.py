"""logit_bias, allowed_token_ids and bad_words change what is sampled (each checked against the
unconstrained greedy output of the same prompt), are refused by name when malformed, and a
request whose constraints leave nothing to sample fails alone."""

from __future__ import annotations

import pytest

from prefixkv import SamplingParams

from ..engine.test_reliability import run_all

PROMPT = "The capital of France is"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 6), ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def baseline(constrained_llm):
    return constrained_llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]


def test_logit_bias_moves_the_output(constrained_llm, baseline):
    first = baseline.token_ids[0]
    down = constrained_llm.generate(PROMPT, greedy(max_tokens=1, logit_bias={first: -100}), use_tqdm=False)
    assert down[0].outputs[0].token_ids[0] != first
    target = constrained_llm.get_tokenizer().encode(" banana")[0]
    assert target not in baseline.token_ids
    # OpenAI's JSON shape: token ids as string keys
    up = constrained_llm.generate(PROMPT, greedy(max_tokens=3, logit_bias={str(target): 100}), use_tqdm=False)
    assert up[0].outputs[0].token_ids == [target] * 3


def test_bad_words_never_appear(constrained_llm, baseline):
    assert "Paris" in baseline.text
    tok = constrained_llm.get_tokenizer()
    # a single-token word and a multi-token one (only its last token is banned, after its prefix)
    out = constrained_llm.generate(
        [PROMPT, PROMPT + " Par"], greedy(max_tokens=8, bad_words=["Paris", "is a"]), use_tqdm=False
    )
    for o in out:
        ids = o.outputs[0].token_ids
        assert "Paris" not in o.outputs[0].text
        for word in ("Paris", " Paris", "is a", " is a"):
            banned = tok.encode(word)
            assert not any(ids[i : i + len(banned)] == banned for i in range(len(ids))), (word, ids)


def test_allowed_token_ids_restrict_every_token(constrained_llm):
    allowed = constrained_llm.get_tokenizer().encode(" one two three four")
    o = constrained_llm.generate(PROMPT, greedy(max_tokens=6, allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(o.outputs[0].token_ids) <= set(allowed)
    sampled = constrained_llm.generate(
        PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=allowed), use_tqdm=False
    )[0]
    assert set(sampled.outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(logit_bias={1: 100.5}), r"logit_bias values must be numbers in \[-100, 100\]"),
        (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
        (dict(logit_bias={1: float("nan")}), "logit_bias values"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids must be non-negative"),
        (dict(bad_words=[""]), "bad_words must be a list of non-empty strings"),
        (dict(bad_words="Paris"), "bad_words must be a list"),
    ],
)
def test_malformed_fields_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_refused(constrained_llm, field):
    vocab = constrained_llm.llm_engine.model_config.vocab_size
    value = {vocab: 1.0} if field == "logit_bias" else [5, vocab + 7]
    with pytest.raises(ValueError, match=rf"{field}: token ids out of the vocabulary \[0, {vocab}\)"):
        constrained_llm.llm_engine.add_request(PROMPT, greedy(**{field: value}))


def test_nothing_left_to_sample_fails_that_request_alone(constrained_llm, baseline):
    engine = constrained_llm.llm_engine
    eos = sorted(engine.eos_ids)
    # only EOS allowed while min_tokens forbids it: no token at all, in the same batch as a healthy request
    engine.add_request(PROMPT, greedy(allowed_token_ids=eos, min_tokens=3), request_id="stuck")
    engine.add_request(PROMPT, greedy(), request_id="fine")
    done = run_all(engine)
    assert "no token is allowed" in (done["stuck"].error or "")
    assert done["fine"].error is None and done["fine"].outputs[0].token_ids == baseline.token_ids
