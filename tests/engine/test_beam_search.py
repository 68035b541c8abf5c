"""Beam search (LLM.beam_search, vLLM's shape): equal to transformers' beam search on a tiny random
float32 checkpoint, token for token and score for score, with prefix caching on and off; the
beams' shared blocks are cache hits and every block is free afterwards; vLLM's EOS and
length-penalty rules on a search fed by hand; bad parameters refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from prefixkv import LLM, BeamSearchParams
from prefixkv.engine.beam_search import BeamSearch
from prefixkv.outputs import Logprob

from ..model.test_model_hf_folder import _make, _write_tokenizer

WIDTH, MAX_NEW = 3, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("beam")
    hf = _make("llama", max_position_embeddings=128)
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return folder, hf


def make(folder, **kw):
    kw = {"dtype": "float32", "device": "cpu", "num_blocks": 96, "block_size": 8, "max_model_len": 96, **kw}
    return LLM(str(folder), **kw)


@torch.inference_mode()
def hf_beams(hf, prompt, width, max_new, length_penalty=1.0):
    """transformers' beam search with EOS off (vLLM's ignore_eos): every beam has max_new tokens."""
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # no position is padding
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=None,
        pad_token_id=0,
        length_penalty=length_penalty,
        early_stopping=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    seqs = [s[len(prompt) :].tolist() for s in out.sequences]
    return seqs, (out.sequences_scores * max_new**length_penalty).tolist()  # back to cumulative logprobs


@pytest.mark.parametrize("caching", [True, False])
def test_equals_transformers_beam_search(tiny, caching):
    folder, hf = tiny
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(12)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(2)]
    prompts.append([rng.randrange(256) for _ in range(5)])
    llm = make(folder, enable_prefix_caching=caching)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        want, scores = hf_beams(hf, prompt, WIDTH, MAX_NEW)
        got = [s.tokens[len(prompt) :] for s in out.sequences]
        assert got == want, prompt
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(scores, abs=1e-4)
        for seq in out.sequences:
            assert seq.tokens[: len(prompt)] == prompt and len(seq.logprobs) == MAX_NEW
            assert seq.finish_reason == "length"
            assert seq.text == llm.llm_engine.tokenizer.decode(seq.tokens, skip_special_tokens=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    stats = engine.prefix_cache_stats
    if caching:  # each step's beams find the prompt and their own earlier blocks
        assert stats.hits > stats.queries / 2, stats
    else:
        assert stats.hits == 0


@torch.inference_mode()
def vllm_beams(hf, prompt, width, max_new, eos, length_penalty):
    """vLLM's beam search written plainly over transformers' full forward passes: every EOS in a
    beam's top 2 * width finishes a beam, the best `width` others go on; the end ranks both by
    cum_logprob / (length, a final EOS not counted) ** length_penalty."""
    beams, finished = [(list(prompt), 0.0)], []
    for _ in range(max_new):
        candidates = []
        for tokens, cum in beams:
            logp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            values, ids = torch.topk(logp, 2 * width)
            for v, t in zip(values.tolist(), ids.tolist()):
                (finished if t == eos else candidates).append((tokens + [t], cum + v))
        beams = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]

    def score(c):
        return c[1] / (len(c[0]) - (c[0][-1] == eos)) ** length_penalty

    return [t for t, _ in sorted(finished + beams, key=score, reverse=True)[:width]]


def test_with_eos_equals_vllms_rules(tiny):
    """EOS on: this checkpoint's EOS (257) is often among the top candidates, so beams finish early;
    with no length penalty the short finished beams rank first."""
    folder, hf = tiny
    llm = make(folder)
    # the first prompt's best beams pass through EOS at their second token
    prompts = [[215, 20, 132, 248, 207, 155, 244, 183, 111, 71, 144, 71, 48, 128, 75, 158, 50], [7, 250, 3, 9]]
    finished = {}
    for length_penalty in (0.0, 1.0):
        params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_NEW, length_penalty=length_penalty)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        finished[length_penalty] = 0
        for prompt, out in zip(prompts, outs):
            want = vllm_beams(hf, prompt, WIDTH, MAX_NEW, 257, length_penalty)
            assert [s.tokens for s in out.sequences] == want, length_penalty
            for seq in out.sequences:
                ended = seq.tokens[-1] == 257
                finished[length_penalty] += ended
                assert (seq.finish_reason, seq.stop_reason) == (("stop", 257) if ended else ("length", None))
    assert finished[0.0] > 0  # the EOS rule was exercised
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def test_length_penalty_and_batching_and_text_prompts(tiny):
    folder, hf = tiny
    llm = make(folder)
    tok = llm.llm_engine.tokenizer
    texts = ["hello beams", "another prompt, longer than the first one"]
    one_by_one = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True, length_penalty=2.0)
    outs = llm.beam_search(texts, one_by_one, concurrency_limit=1)
    together = llm.beam_search(texts, one_by_one)  # batches of other shapes: other last bits, same beams
    assert [[s.tokens for s in o.sequences] for o in outs] == [[s.tokens for s in o.sequences] for o in together]
    for text, out in zip(texts, outs):
        ids = tok.encode(text, add_special_tokens=True)
        want, _ = hf_beams(hf, ids, 2, 5, length_penalty=2.0)  # one length: the penalty keeps the order
        assert [s.tokens[len(ids) :] for s in out.sequences] == want


def test_context_end_stops_the_beams(tiny):
    folder, _ = tiny
    llm = make(folder, max_model_len=32)
    prompt = list(range(1, 30))
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))[0]
    assert [len(s.tokens) for s in out.sequences] == [32, 32]  # the whole context, as generate() fills it
    assert [s.finish_reason for s in out.sequences] == ["length", "length"]
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def lp(*pairs):
    return {tok: Logprob(v, rank + 1) for rank, (tok, v) in enumerate(pairs)}


def test_vllm_rules_for_eos_and_length_penalty():
    """Fed by hand: an EOS candidate finishes its beam (its score not counting the EOS in the
    length), the others compete for the width by cumulative logprob, and the end ranks finished
    and live beams together by cum_logprob / length ** length_penalty."""
    eos = 9
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    s = BeamSearch([1, 2], params, {eos}, max_model_len=100)
    s.advance([lp((eos, -0.9), (5, -1.0), (6, -1.2), (7, -3.0))])
    assert [b.tokens for b in s.beams] == [[1, 2, 5], [1, 2, 6]]
    assert [c.tokens for c in s.completed] == [[1, 2, eos]]
    s.advance([lp((3, -0.5), (eos, -0.6), (4, -2.0), (8, -2.1)), lp((3, -0.1), (4, -0.2), (eos, -3.0), (8, -4.0))])
    assert [(b.tokens[-2:], round(b.cum_logprob, 6)) for b in s.beams] == [([6, 3], -1.3), ([6, 4], -1.4)]
    s.advance([lp((1, -2.0), (2, -2.5), (3, -3.0), (4, -3.5))] * 2)
    assert s.live == []  # max_tokens reached
    best = s.best()
    # scores: [1,2,eos] -0.9/2 = -0.45; [1,2,5,eos] -1.6/3 = -0.53; live beams -3.3/5, -3.4/5
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in best] == [
        ([1, 2, eos], "stop", eos),
        ([1, 2, 5, eos], "stop", eos),
    ]
    # a strong length penalty favours the long live beams: -3.3 / 5**2 beats -0.9 / 2**2
    s.params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=2.0)
    assert [b.tokens for b in s.best()] == [[1, 2, 6, 3, 1], [1, 2, 6, 4, 1]]


def test_ignore_eos_keeps_eos_as_a_token():
    s = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), {9}, max_model_len=100)
    s.advance([lp((9, -0.1), (5, -1.0))])
    assert s.completed == [] and s.beams[0].tokens == [1, 9]


def test_bad_parameters_are_refused_by_name(tiny):
    folder, _ = tiny
    llm = make(folder, max_logprobs=8)
    for kwargs, name in [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=True, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, length_penalty=1e6), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
        (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
    ]:
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="max_logprobs"):  # 2 * 5 logprobs a step > 8
        llm.beam_search(["hi"], BeamSearchParams(beam_width=5, max_tokens=2))
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=10**9, max_tokens=2))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(["hi"], {"beam_width": 2})
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    with pytest.raises(ValueError, match="context"):  # the second prompt is too long: nothing runs
        llm.beam_search(["hi", [5] * 200], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.beam_search(
            [{"prompt": "hi", "multi_modal_data": {"image": []}}], BeamSearchParams(beam_width=2, max_tokens=2)
        )
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()
