"""The offline API as a vLLM user drives it: prompts in every accepted shape, sampling options,
stop conditions, n > 1, errors that leave the engine serving, and no block left held."""

from __future__ import annotations

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.config import EngineConfig
from prefixkv.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(default_lm):
    return LLM.from_engine(
        LLMEngine(EngineConfig(dtype="float32", device="cpu", num_blocks=128, max_model_len=512), loaded=default_lm)
    )


@pytest.fixture(autouse=True)
def no_blocks_held_after(llm):
    yield
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert engine.kv_cache_usage == 0.0


def test_prompt_shapes_give_the_same_answer(llm):
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    ids = tok.encode(text)
    by_text = llm.generate(text, GREEDY)[0]
    assert by_text.prompt == text and by_text.prompt_token_ids == ids
    variants = [
        llm.generate(ids, GREEDY)[0],
        llm.generate({"prompt": text}, GREEDY)[0],
        llm.generate({"prompt_token_ids": ids}, GREEDY)[0],
        llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)[0],
    ]
    for out in variants:
        assert out.outputs[0].token_ids == by_text.outputs[0].token_ids
        assert out.outputs[0].text == by_text.outputs[0].text
    batch = llm.generate([text, "Hello", ids], GREEDY, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in batch][::2] == [by_text.outputs[0].token_ids] * 2


def test_request_output_fields(llm):
    out = llm.generate("Tell me a story about a cat", SamplingParams(temperature=0, max_tokens=5))[0]
    c = out.outputs[0]
    assert out.finished and c.finish_reason == "length" and len(c.token_ids) == 5
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_streamed_metrics_of_one_and_of_several_sequences(llm):
    """Each step's output carries the step's time, and a group's first token and end are its
    earliest and latest sequence's (a single sequence's own, without the walk)."""
    engine = llm.llm_engine
    engine.add_request("Tell me about caching", SamplingParams(temperature=0, max_tokens=4), request_id="one")
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=4)
    engine.add_request("Tell me about caching", params, request_id="two")
    last: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            m = out.metrics
            assert m.last_token_time >= last.get(out.request_id, 0.0)
            last[out.request_id] = m.last_token_time
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
            assert len(out.outputs) == (2 if out.request_id == "two" else 1)
            if out.finished:
                assert out.request_id not in engine.groups.groups  # forgotten once finished
                assert m.finished_time is not None and m.first_token_time <= m.finished_time
    assert set(last) == {"one", "two"}


def test_second_request_reuses_the_prefix(llm):
    doc = "Here is a long shared document about caching. " * 20
    first = llm.generate(doc + "Question one?", GREEDY)[0]
    second = llm.generate(doc + "Question two?", GREEDY)[0]
    assert second.num_cached_tokens >= len(second.prompt_token_ids) - 32 > 0
    assert first.num_cached_tokens < second.num_cached_tokens
    stats = llm.get_prefix_cache_stats()
    assert stats.hits > 0 and 0 < stats.hit_rate <= 1


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], GREEDY)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).startswith("<|im_start|>")
    assert out.outputs[0].text


def test_chat_hands_tools_to_the_template_and_priorities_to_the_requests(llm):
    """vLLM's LLM.chat(tools=..., priority=...): the tools reach the template (the reply is not parsed
    for calls offline, as in vLLM); priorities go with the requests (refused here as without priority
    scheduling); sampling params may be one per conversation."""
    tpl = "{% for t in tools or [] %}{{ t['function']['name'] }};{% endfor %}{{ messages[-1]['content'] }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conv = [{"role": "user", "content": "Hi"}]
    first, second = llm.chat(
        [conv, conv],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 2)],
        chat_template=tpl,
        tools=tools,
    )
    assert first.prompt == second.prompt == "get_weather;Hi"
    assert len(first.outputs[0].token_ids) == 3 and len(second.outputs[0].token_ids) == 2
    assert llm.chat(conv, GREEDY, chat_template=tpl)[0].prompt == "Hi"
    with pytest.raises(ValueError, match="tools"):
        llm.chat(conv, GREEDY, chat_template=tpl, tools=tools, chat_template_kwargs={"tools": []})
    with pytest.raises(ValueError, match="priority 1"):
        llm.chat(conv, GREEDY, priority=[1])


def test_stop_strings_and_tokens(llm):
    prompt = "Count: 1, 2, 3,"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert ", 5" in free.text
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=", 5"))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == ", 5"
    assert stopped.text == free.text[: free.text.index(", 5")]
    kept = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, stop=[", 5"], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text.endswith(", 5")
    tok_stop = free.token_ids[2]
    by_token = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tok_stop]))[0].outputs[
        0
    ]
    assert by_token.token_ids == free.token_ids[:3] and by_token.stop_reason == tok_stop


def test_eos_stops_unless_ignored(llm):
    tok = llm.get_tokenizer()  # Hugging Face's: tokenize=True by default, as HF
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False
    )
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.llm_engine.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text
    longer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 3, ignore_eos=True))[
        0
    ].outputs[0]
    assert longer.finish_reason == "length" and longer.token_ids[: len(out.token_ids)] == out.token_ids


def test_logprobs(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("top_p", [5e-324, 1e-50, 1e-9])
def test_a_tiny_top_p_keeps_the_most_likely_token(llm, top_p):
    """top_p below float32's least value compares as 0.0 in the float32 filter: the first token must
    still stay (it once dropped every token and the sampler failed on NaN probabilities)."""
    greedy = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    nucleus = llm.generate("The sky is", SamplingParams(temperature=1.0, top_p=top_p, seed=1, max_tokens=4))[0]
    assert nucleus.outputs[0].token_ids == greedy.token_ids


def test_sampling_seed_is_reproducible_and_n_shares_the_prompt(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=7, max_tokens=10)
    a = llm.generate("Once upon a time", params)[0]
    b = llm.generate("Once upon a time", params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    many = llm.generate(
        "Once upon a time there was a long prompt that fills some blocks " * 3,
        SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=10),
    )[0]
    assert len(many.outputs) == 4 and [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    assert llm.llm_engine.prefix_cache_stats.hits >= 3 * 16  # children 1-3 hit child 0's blocks


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(n=0), "n must"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs"),
    ],
)
def test_bad_sampling_values(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_bad_prompts_are_clear_errors_and_the_engine_keeps_serving(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([1, 2, vocab], GREEDY)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([[5, -1]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([7] * 600, GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"text": "x"}], GREEDY)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [GREEDY])
    # a bad prompt in a batch rejects the batch before anything runs
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], GREEDY)
    assert llm.generate("Still serving?", GREEDY)[0].outputs[0].token_ids


def test_kv_budget_and_context_errors(default_lm):
    with pytest.raises(ValueError, match="does not fit in the KV budget"):
        LLMEngine(EngineConfig(device="cpu", num_blocks=4, block_size=16, max_model_len=128), loaded=default_lm)
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=4, block_size=16), loaded=default_lm)
    assert engine.max_model_len == 64  # the whole budget, not the model's 8k
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 64)
    with pytest.raises(TypeError, match="unexpected"):
        LLM(not_an_argument=1)


def test_generation_stops_at_max_model_len(default_lm):
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=4, block_size=8), loaded=default_lm)
    out = LLM.from_engine(engine).generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 32 - 3
    assert engine.kv_cache_manager.num_free_blocks == 4


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    rid = engine.add_request("A prompt that will be aborted " * 5, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv_cache_usage > 0
    engine.abort_request(rid)
    assert engine.kv_cache_usage == 0 and not engine.has_unfinished_requests()


def test_reset_prefix_cache(llm):
    llm.generate("Some text to cache " * 10, GREEDY)
    assert llm.reset_prefix_cache()
    out = llm.generate("Some text to cache " * 10, GREEDY)[0]
    assert out.num_cached_tokens == 0


def test_bfloat16_on_cpu_packs_weights_and_serves(llm):
    """dtype="bfloat16" on CPU: one copy of the weights in the native layout where the CPU has
    AVX512-BF16 and the many-row native linear runs; else oneDNN-packed weights where the CPU
    supports them (and a second layout for decode-sized steps where it has AVX512-BF16); the engine
    generates, caches and frees like the float32 one (whose outputs the exactness tests check)."""
    from prefixkv.model.kernels import ops
    from prefixkv.model.layers import DualLayoutLinear, NativeLinear, PackedLinear, packed_linear_works

    b16 = LLM(device="cpu", dtype="bfloat16", kv_cache_memory_bytes=32 << 20, max_model_len=512)
    engine = b16.llm_engine
    assert (engine.runner.model.packed_head is not None) == packed_linear_works()
    if packed_linear_works():
        kind = (
            NativeLinear
            if ops.blocked_linear_available()
            else DualLayoutLinear
            if ops.small_linear_available()
            else PackedLinear
        )
        assert isinstance(engine.runner.model.layers[0].mlp.down_proj, kind)
    doc = "A shared document about prefix caching. " * 8
    outs = b16.generate([doc + "First question?", doc + "Second question?"], GREEDY)
    assert all(len(o.outputs[0].token_ids) > 0 and o.outputs[0].text for o in outs)
    again = b16.generate(doc + "Third question?", GREEDY)[0]
    assert again.num_cached_tokens >= 48
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
