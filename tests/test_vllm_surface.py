"""vLLM's options and fields offline, on a tiny random Llama saved as an HF folder (transformers'
own classes): --tokenizer, --generation-config, --scheduling-policy priority, the hash choices,
per-call chat templates, continue_final_message, add_generation_prompt."""

from __future__ import annotations

import json

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.model.tokenizer import _bytes_to_unicode

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def _write_tokenizer(folder, extra_tokens=()):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", *extra_tokens])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    import transformers as tf

    root = tmp_path_factory.mktemp("tiny")
    folder = root / "model"
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    _write_tokenizer(folder)
    gen = {"temperature": 0.0, "top_k": 50, "top_p": 0.5, "max_new_tokens": 5, "repetition_penalty": 1.3}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return root


def make(folder, **kw):
    kw.setdefault("max_model_len", 256)
    if "num_gpu_blocks_override" not in kw:
        kw["kv_cache_memory_bytes"] = 4 << 20
    return LLM(str(folder), **kw)


def test_generation_config_defaults_as_vllm(tiny):
    llm = make(tiny / "model")
    d = llm.get_default_sampling_params()
    # top_k=50 is transformers' own default: dropped, as vLLM's to_diff_dict does
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens, d.repetition_penalty) == (0.0, 0.5, 0, 5, 1.3)
    out = llm.generate("hello", use_tqdm=False)[0]  # no params: the folder's defaults
    assert len(out.outputs[0].token_ids) == 5
    plain = make(tiny / "model", generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    assert plain.get_default_sampling_params().temperature == 1.0
    with pytest.raises(FileNotFoundError, match="generation_config"):
        make(tiny / "model", generation_config=str(tiny))  # a folder without the file


def test_separate_tokenizer(tiny):
    other = tiny / "tok"
    _write_tokenizer(other, extra_tokens=["<extra>"])
    llm = make(tiny / "model", tokenizer=str(other), generation_config="vllm")
    assert llm.get_tokenizer().convert_tokens_to_ids("<extra>") == 258  # the other tokenizer is used
    assert make(tiny / "model", generation_config="vllm").llm_engine.tokenizer.token_to_id("<extra>") is None
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        make(tiny / "model", tokenizer=str(tiny / "nope"))


def test_priority_scheduling_lower_first(tiny):
    params = SamplingParams(temperature=0, max_tokens=2)
    llm = make(tiny / "model", scheduling_policy="priority", max_num_seqs=1, generation_config="vllm")
    engine = llm.llm_engine
    for rid, prio in (("a", 5), ("b", 0), ("c", 1), ("d", 0)):
        engine.add_request([1, 2, 3, ord(rid)], params, request_id=rid, priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["b", "d", "c", "a"]  # lower priority value first, then arrival
    outs = llm.generate(["x", "y"], params, priority=[3, -1], use_tqdm=False)
    assert [o.prompt for o in outs] == ["x", "y"]  # results stay in input order
    fcfs = make(tiny / "model", generation_config="vllm")
    with pytest.raises(ValueError, match="neither priority scheduling nor priority eviction is enabled"):
        fcfs.generate("x", params, priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make(tiny / "model", scheduling_policy="lifo")


def test_priority_preempts_the_least_urgent(tiny):
    """Blocks run out while two requests decode: the one with the larger priority value is the
    one preempted (recomputed later), whatever their order."""
    llm = make(
        tiny / "model",
        scheduling_policy="priority",
        num_gpu_blocks_override=6,
        max_model_len=96,
        generation_config="vllm",
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(list(range(10, 30)), params, request_id="urgent", priority=0)
    engine.add_request(list(range(40, 60)), params, request_id="later", priority=9)
    preempted = {}
    while engine.has_unfinished_requests():
        engine.step()
        for r in engine.scheduler.requests.values():
            preempted[r.prompt_token_ids[0]] = r.num_preemptions
    assert preempted[40] >= 1 and preempted[10] == 0
    assert engine.get_stats().kv_cache_usage == 0


def test_hash_algo_choices_are_vllms():
    from prefixkv.cache import HASH_ALGOS, get_hash_function

    assert set(HASH_ALGOS) == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}
    f = get_hash_function("xxhash", seed=3)
    assert f((1, (2, 3))) == get_hash_function("xxhash", seed=3)((1, (2, 3))) != f((1, (2, 4)))


def test_served_defaults_priority_and_chat_template(tiny):
    """The same options through the HTTP app in-process: the folder's max_new_tokens caps a chat
    reply that asks for none, `priority` is taken, a per-request chat_template renders the prompt."""
    from starlette.testclient import TestClient

    from prefixkv.engine.llm_engine import LLMEngine
    from prefixkv.engine_args import EngineArgs
    from prefixkv.server.app import create_app

    engine = LLMEngine(
        EngineArgs(str(tiny / "model"), kv_cache_memory_bytes=4 << 20, max_model_len=256, scheduling_policy="priority")
    )
    msgs = [{"role": "user", "content": "hi"}]
    with TestClient(create_app(engine, served_model_names=["tiny"])) as client:
        r = client.post("/v1/chat/completions", json={"messages": msgs, "priority": -3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5  # generation_config.json's max_new_tokens
        own = client.post("/tokenize", json={"messages": msgs}).json()
        other = client.post(
            "/tokenize", json={"messages": msgs, "chat_template": "{{ messages[0]['content'] }}!"}
        ).json()
        assert other["tokens"] == engine.tokenizer.encode("hi!") != own["tokens"]
        r = client.post("/v1/chat/completions", json={"messages": msgs, "chat_template": "{% if %}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_cli_flags_from_vllm_command_lines(tmp_path):
    from prefixkv import cli

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages[0]['content'] }}")
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--chat-template",
            str(tpl),
            "--enable-chunked-prefill",
            "--trust-remote-code",
            "--gpu-memory-utilization",
            "0.8",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--generation-config",
            "vllm",
            "--scheduling-policy",
            "priority",
            "--prefix-caching-hash-algo",
            "xxhash",
        ]
    )
    assert args.chat_template == "{{ messages[0]['content'] }}" and args.api_key == ["a", "b"]
    cfg = cli.engine_config(args)
    assert (cfg.generation_config, cfg.scheduling_policy, cfg.prefix_caching_hash_algo) == (
        "vllm",
        "priority",
        "xxhash",
    )
    inline = cli.build_parser().parse_args(["serve", "--chat-template", "{{ 'x' }}\\n"])
    assert inline.chat_template == "{{ 'x' }}\n"  # inline, escapes decoded (vLLM)
    for bad in (str(tmp_path / "missing.jinja"), "{% if %}"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "--chat-template", bad])
    with pytest.raises(ValueError, match="enable_chunked_prefill"):  # always on: turning it off is refused
        cli.engine_config(cli.build_parser().parse_args(["serve", "--no-enable-chunked-prefill"]))


def test_llm_chat_options_and_prompt(tiny):
    llm = make(tiny / "model", generation_config="vllm")
    params = SamplingParams(temperature=0, max_tokens=3)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    out = llm.chat(conv, params, use_tqdm=False)[0]
    assert out.prompt == "<s>user: hi</s>\n<s>assistant: hel</s>\n<s>assistant: "  # llm.chat carries the prompt
    cont = llm.chat(conv, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert cont.prompt == "<s>user: hi</s>\n<s>assistant: hel"
    assert cont.prompt_token_ids == llm.llm_engine.tokenizer.encode(cont.prompt)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv, params, continue_final_message=True, use_tqdm=False)
    own = llm.chat(conv, params, chat_template="{{ p }}:{{ messages[-1]['content'] }}", chat_template_kwargs={"p": "Z"})
    assert own[0].prompt == "Z:hel"
    with pytest.raises(ValueError, match="beam_search"):
        llm.beam_search(["hi"], None)
    cut = llm.generate("hello there", SamplingParams(max_tokens=1, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert cut.prompt_token_ids == llm.llm_engine.tokenizer.encode("hello there")[-3:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_get_tokenizer_is_hugging_faces(tiny):
    from transformers import PreTrainedTokenizerFast

    llm = make(tiny / "model", generation_config="vllm")
    own = llm.llm_engine.tokenizer
    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast) and llm.get_tokenizer() is tok
    text = "héllo wörld"
    assert tok(text)["input_ids"] == own.encode(text, add_special_tokens=True)
    assert len(tok) == own.vocab_size == len(tok.get_vocab())
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (257, 257, 256)
    assert tok.convert_ids_to_tokens([256, 257]) == ["<s>", "</s>"]
    assert tok.batch_decode([own.encode("ab"), own.encode("cd")]) == ["ab", "cd"]
    msgs = [{"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)  # tokenize=True by default, as HF
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == own.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)


def test_hub_id_from_the_local_cache_only(tiny, tmp_path, monkeypatch):
    import os

    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in os.listdir(tiny / "model"):
        os.symlink(tiny / "model" / f, snap / f)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = make("acme/tiny")
    assert llm.llm_engine.default_sampling_params["max_tokens"] == 5  # its generation_config.json too
    with pytest.raises(FileNotFoundError, match="not in the local HF cache \\(nothing is downloaded\\)"):
        make("acme/absent")
