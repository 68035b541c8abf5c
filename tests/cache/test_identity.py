"""Block identity: extra keys, content hashes, and exactness under a degenerate hash."""

import random

import pytest

from prefixkv.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    block_extra_keys,
    get_hash_function,
    none_hash,
)
from prefixkv.cache.identity import extra_keys, hash_chain, lora_extra_key
from prefixkv.request import LoRARequest, MultiModalItem, Request

from .conftest import decode, prefill


def hit_tokens(mgr, req):
    return mgr.get_computed_blocks(req)[1]


def test_cache_salt_separates_tenants_and_same_salt_shares():
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    prefill(mgr, Request("a", list(range(13)), cache_salt="tenant-a"))
    assert hit_tokens(mgr, Request("b", list(range(13)), cache_salt="tenant-b")) == 0
    assert hit_tokens(mgr, Request("c", list(range(13)))) == 0
    assert hit_tokens(mgr, Request("d", list(range(13)), cache_salt="tenant-a")) == 12


def test_salt_is_on_block_zero_only():
    req = Request("a", list(range(12)), cache_salt="s")
    assert block_extra_keys(req, 0, 4, 0) == (("cache_salt", "s"),)
    assert block_extra_keys(req, 4, 8, 1) is None


def test_lora_separates_adapters_and_shares_same_adapter():
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    lora_a = LoRARequest("a", 1, "/adapters/a")
    prefill(mgr, Request("x", list(range(13)), lora_request=lora_a))
    assert hit_tokens(mgr, Request("y", list(range(13)))) == 0
    assert hit_tokens(mgr, Request("z", list(range(13)), lora_request=LoRARequest("b", 2, "/adapters/b"))) == 0
    assert hit_tokens(mgr, Request("w", list(range(13)), lora_request=LoRARequest("a", 7, "/adapters/a"))) == 12


def test_multimodal_items_key_the_blocks_they_overlap():
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    prompt = [1, 2] + [0] * 6 + [3, 4, 5, 6, 7]  # placeholders at 2..7
    img = MultiModalItem("img-1", offset=2, length=6)
    req = Request("a", prompt, mm_items=[img])
    assert block_extra_keys(req, 0, 4, 0) == (("mm", "img-1", 2),)
    assert block_extra_keys(req, 4, 8, 1) == (("mm", "img-1", -2),)
    assert block_extra_keys(req, 8, 12, 2) is None
    prefill(mgr, req)
    assert hit_tokens(mgr, Request("same", prompt, mm_items=[img])) == 12
    other = MultiModalItem("img-2", offset=2, length=6)
    assert hit_tokens(mgr, Request("other", prompt, mm_items=[other])) == 0
    shifted = Request("shifted", [1, 2, 0] + [0] * 6 + [3, 4, 5, 6], mm_items=[MultiModalItem("img-1", 3, 6)])
    assert hit_tokens(mgr, shifted) == 0  # same tokens in block 0, image at another offset


def test_extra_key_kinds_cannot_collide():
    a = Request("a", list(range(8)), cache_salt="x")
    b = Request("b", list(range(8)), lora_request=LoRARequest("x", 0, ""))
    assert block_extra_keys(a, 0, 4, 0) != block_extra_keys(b, 0, 4, 0)


def test_hash_algorithms():
    obj = (b"p", (1, 2, 3), None)
    assert len(get_hash_function("sha256_cbor")(obj)) == 32
    assert get_hash_function("sha256_cbor")(obj) == get_hash_function("sha256_cbor")(obj)
    assert get_hash_function("sha256")(obj) != get_hash_function("sha256_cbor")(obj)
    assert get_hash_function("xxhash_cbor", seed=5)(obj) == get_hash_function("xxhash_cbor", seed=5)(obj)
    assert get_hash_function("xxhash_cbor", seed=5)(obj) != get_hash_function("xxhash_cbor", seed=6)(obj)
    with pytest.raises(ValueError, match="unknown prefix-caching hash algorithm 'md5'"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="md5")


def test_content_hashes_are_reproducible_across_managers_and_chain():
    h1 = KVCacheManager(num_blocks=8, block_size=4).get_block_hashes(Request("a", list(range(9))))
    h2 = KVCacheManager(num_blocks=8, block_size=4).get_block_hashes(Request("b", list(range(9))))
    assert h1 == h2 and len(h1) == 2 and h1[0] != h1[1]
    h3 = KVCacheManager(num_blocks=8, block_size=4, hash_seed=1).get_block_hashes(Request("c", list(range(9))))
    assert h3[0] != h1[0]  # NONE_HASH follows the seed


def test_hashes_extend_incrementally_with_generated_tokens():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("a", list(range(6)))
    first = mgr.get_block_hashes(r)
    r.append_output_token_ids([6, 7])
    second = mgr.get_block_hashes(r)
    assert len(first) == 1 and len(second) == 2 and second[0] == first[0]
    assert second == KVCacheManager(num_blocks=8, block_size=4).get_block_hashes(Request("b", list(range(8))))


def test_events_in_order():
    mgr = KVCacheManager(num_blocks=3, block_size=4, enable_kv_cache_events=True)
    a = Request("a", list(range(9)), lora_request=LoRARequest("L", 1, "/l"))
    prefill(mgr, a)
    (stored,) = mgr.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == mgr.get_block_hashes(a) and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.lora_name == "L"
    decode(mgr, a, 100)
    decode(mgr, a, 101)
    decode(mgr, a, 102)  # fills block 2
    (stored2,) = mgr.take_events()
    assert stored2.parent_block_hash == stored.block_hashes[-1]
    mgr.free(a)
    b = Request("b", list(range(50, 54)))
    prefill(mgr, b)  # takes block 2 from the head: its identity is removed, then b's is stored
    removed, stored3 = mgr.take_events()
    assert removed == BlockRemoved(stored2.block_hashes)
    assert isinstance(stored3, BlockStored) and stored3.token_ids == [50, 51, 52, 53]
    mgr.free(b)
    assert mgr.reset_prefix_cache()
    assert mgr.take_events() == [AllBlocksCleared()]
    assert mgr.take_events() == []


def degenerate(obj):
    return b"\x00" * 32


def run_script(mgr, seed):
    """A fixed random workload over a small vocabulary, so many blocks repeat with different
    prefixes; returns everything observable: tables, hits, queue order, events' shapes."""
    rng = random.Random(seed)
    observed = []
    live = []
    for step in range(300):
        if live and rng.random() < 0.3:
            req = live.pop(rng.randrange(len(live)))
            mgr.free(req)
            observed.append(("free", req.request_id))
        elif live and rng.random() < 0.4:
            req = rng.choice(live)
            out = decode(mgr, req, rng.randrange(3))
            observed.append(("decode", req.request_id, out))
            if out is None:
                req.output_token_ids.pop()
                req.all_token_ids.pop()
        else:
            req = Request(f"r{step}", [rng.randrange(3) for _ in range(rng.randrange(1, 20))])
            hits, n = mgr.get_computed_blocks(req)
            new = mgr.allocate_slots(req, req.num_tokens - n, hits)
            observed.append(
                ("new", req.request_id, [b.block_id for b in hits], None if new is None else [b.block_id for b in new])
            )
            if new is not None:
                req.num_computed_tokens = req.num_tokens
                live.append(req)
        observed.append(tuple(mgr.block_pool.eviction_policy.block_ids()))
    return observed


@pytest.mark.parametrize("seed", range(5))
def test_degenerate_hash_is_still_exact(seed):
    """Every content hash equal: the cache must behave exactly as with sha256."""
    normal = KVCacheManager(num_blocks=12, block_size=2, enable_kv_cache_events=True)
    broken = KVCacheManager(num_blocks=12, block_size=2, hash_algo=degenerate, enable_kv_cache_events=True)
    assert run_script(normal, seed) == run_script(broken, seed)
    assert normal.stats == broken.stats
    events_normal, events_broken = normal.take_events(), broken.take_events()
    assert [type(e) for e in events_normal] == [type(e) for e in events_broken]
    assert all(h == b"\x00" * 32 for e in events_broken if isinstance(e, BlockStored) for h in e.block_hashes)


def test_multimodal_items_and_lora_in_plain_forms():
    as_tuple = Request("t", [0] * 8, mm_items=[("img", 2, 4)])
    as_dict = Request("d", [0] * 8, mm_items=[{"identifier": "img", "offset": 2, "length": 4}])
    assert as_tuple.mm_items == as_dict.mm_items == (MultiModalItem("img", 2, 4),)
    assert Request("l", [1], lora_request="adapter").lora_request.lora_name == "adapter"
    with pytest.raises(ValueError, match="outside the prompt"):
        Request("bad", [0] * 4, mm_items=[("img", 2, 4)])
    with pytest.raises(ValueError, match="multimodal item"):
        Request("bad", [0] * 4, mm_items=[{"offset": 0}])


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_hash_chain_of_plain_parts_is_the_managers_chain(algo):
    """hash_chain() over token tuples and extra_keys() - what a process without the request objects
    (a router hashing a prompt) has - gives the manager's content hashes, bit for bit."""
    bs = 4
    ids = [1, 2] + [0] * 6 + list(range(3, 12))
    lora = LoRARequest("a", 1, "/adapters/a", weights_digest="d1")
    img = MultiModalItem("img-1", offset=2, length=6)
    req = Request("r", ids, lora_request=lora, mm_items=[img], cache_salt="tenant-a")
    expected = KVCacheManager(num_blocks=16, block_size=bs, hash_algo=algo).get_block_hashes(req)
    n = len(ids) // bs
    hash_fn = get_hash_function(algo)
    got = hash_chain(
        hash_fn,
        none_hash(hash_fn),
        [tuple(ids[i * bs : (i + 1) * bs]) for i in range(n)],
        [extra_keys(lora_extra_key(lora), [img], "tenant-a", i * bs, (i + 1) * bs, i) for i in range(n)],
    )
    assert len(expected) == n and got == expected
