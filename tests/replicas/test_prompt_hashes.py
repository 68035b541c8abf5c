"""The router's block hashes of a request body equal the BlockStored hashes the engine publishes
for it (completions text and token ids, chat, cache_salt): the precise index can only work if they do."""

from __future__ import annotations

import pytest

from prefixkv.cache import BlockStored
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine_args import EngineArgs
from prefixkv.kv_events.wire import to_int_hash
from prefixkv.model.loader import load_tokenizer
from prefixkv.replicas.prompt_hashes import CHAT, COMPLETIONS, PromptHasher
from prefixkv.sampling_params import SamplingParams

from ..tiers.conftest import make_tiny
from .conftest import BLOCK, CHAT_TEMPLATE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny(tmp_path_factory.mktemp("tiny-llama"))
    engine = LLMEngine(
        EngineArgs(
            model=model,
            block_size=BLOCK,
            num_blocks=128,
            max_model_len=256,
            dtype="float32",
            kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
        )
    )
    engine.tokenizer.set_chat_template(CHAT_TEMPLATE)
    tokenizer = load_tokenizer(model)
    tokenizer.set_chat_template(CHAT_TEMPLATE)
    return engine, PromptHasher(tokenizer, BLOCK)


def stored_hashes(engine: LLMEngine, ids: list[int], cache_salt: str | None = None) -> list[int]:
    engine.take_kv_events()
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1), cache_salt=cache_salt)
    while engine.has_unfinished_requests():
        engine.step()
    return [to_int_hash(h) for ev in engine.take_kv_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, {"prompt": "the router hashes what the engine caches, block by block"}),
        (COMPLETIONS, {"prompt": list(range(3, 40))}),
        (COMPLETIONS, {"prompt": "salted tenants never share a block", "cache_salt": "tenant-a"}),
        (CHAT, {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]}),
    ],
)
def test_router_hashes_equal_the_engines_published_hashes(setup, path, body):
    engine, hasher = setup
    engine.reset_prefix_cache()
    ids = hasher.token_ids(path, body)
    if path == CHAT:  # what the chat route feeds the engine
        text = engine.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        assert ids == engine.tokenizer.encode(text, False)
    expected = stored_hashes(engine, ids, body.get("cache_salt"))
    got = hasher.hashes(path, body)
    assert got and got == expected[: len(got)]
    assert len(got) == (len(ids) - 1) // BLOCK  # the blocks a later request can look up


def test_unknown_shapes_route_by_load(setup):
    _, hasher = setup
    assert hasher.hashes(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) == []
    assert hasher.hashes(COMPLETIONS, {"prompt": {"not": "a prompt"}}) == []
    assert hasher.hashes("/v1/embeddings", {"input": "x"}) == []


def test_lora_request_hashes_carry_the_adapters_block_key(tmp_path):
    """A LoRA request's blocks hash with ("lora", name, path, digest) on each (the key the ingress
    asks a replica for); with a cache salt too. Without the key the router's hashes would miss."""
    from prefixkv.lora.request import LoRARequest

    from ..lora.conftest import write_adapter

    model = make_tiny(tmp_path / "base")
    write_adapter(model, tmp_path / "qv", seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    engine = LLMEngine(
        EngineArgs(
            model=model,
            block_size=BLOCK,
            num_blocks=64,
            max_model_len=256,
            dtype="float32",
            enable_lora=True,
            kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
        )
    )
    lora = LoRARequest("qv", 1, str(tmp_path / "qv"))
    resolved, _ = engine.resolve_lora(lora)
    key = ("lora", resolved.lora_name, resolved.lora_path, resolved.weights_digest)
    hasher = PromptHasher(load_tokenizer(model), BLOCK)
    for salt in (None, "tenant-b"):
        body = {"model": "qv", "prompt": "an adapter's blocks are its own, block by block", "cache_salt": salt}
        ids = hasher.token_ids(COMPLETIONS, body)
        engine.take_kv_events()
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1), lora_request=lora, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        stored = [
            to_int_hash(h) for ev in engine.take_kv_events() if isinstance(ev, BlockStored) for h in ev.block_hashes
        ]
        got = hasher.hashes(COMPLETIONS, {k: v for k, v in body.items() if v is not None}, key)
        assert got and got == stored[: len(got)]
        assert not set(hasher.hashes(COMPLETIONS, body)) & set(stored)  # the base model's are others
    engine.shutdown()


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
@pytest.mark.parametrize(("salt", "with_lora"), [(None, False), ("tenant-a", False), (None, True), ("tenant-b", True)])
def test_router_chain_is_the_caches_chain(algo, salt, with_lora):
    """The router's hashes of a token prompt are the cache's own content hashes (converted as the
    publisher converts them), with a cache salt, a LoRA adapter's block key, or both."""
    from prefixkv.cache import KVCacheManager
    from prefixkv.cache.identity import lora_extra_key
    from prefixkv.kv_events.wire import hash_converter
    from prefixkv.lora.request import LoRARequest
    from prefixkv.request import Request

    ids = list(range(5, 42))
    lora = LoRARequest("qv", 1, "/adapters/qv", weights_digest="digest-1") if with_lora else None
    hasher = PromptHasher(None, BLOCK, algo)  # type: ignore[arg-type]  # chain() tokenizes nothing
    got = hasher.chain(ids, salt, lora_extra_key(lora) if lora is not None else None)
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK, hash_algo=algo)
    cached = manager.get_block_hashes(Request("r", ids, lora_request=lora, cache_salt=salt))
    convert = hash_converter()
    assert len(got) == (len(ids) - 1) // BLOCK
    assert got == [convert(h) for h in cached[: len(got)]]
