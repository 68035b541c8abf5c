"""Block identity: the exact key that the local cache table uses, the extra keys that separate
LoRA adapters, multimodal items and tenants, and the content hashes used outside this process.

Exactness. The local table is keyed by the exact triple (parent identity number, token tuple,
extra keys). Python's dict compares keys for equality after matching hashes, and identity numbers
are never reused, so two different prefixes can never share an entry, whatever any hash function
returns. Content hashes (sha256 over CBOR by default) name blocks to other processes - events,
routers, offload - and are computed only for those consumers; they never decide a local hit.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

from .protocol import CacheRequest, LoRAKey, MultiModalKey

# Extra keys of a block: tagged tuples such as ("lora", name, path, weights digest), ("mm", identifier,
# offset), ("cache_salt", salt): the tag keeps a LoRA named X apart from a salt X
ExtraKeys = tuple[tuple[Any, ...], ...]
# (parent identity uid or ROOT_UID, tokens of the block, extra keys or None)
BlockKey = tuple[int, tuple[int, ...], ExtraKeys | None]
ROOT_UID = 0

HashFunction = Callable[[Any], bytes]


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _make_xxhash_cbor(seed: int) -> HashFunction:
    import xxhash

    def xxhash_cbor(obj: Any) -> bytes:
        return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True), seed=seed)

    return xxhash_cbor


def _make_xxhash_pickle(seed: int) -> HashFunction:
    import xxhash

    def xxhash_pickle(obj: Any) -> bytes:
        return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), seed=seed)

    return xxhash_pickle


# vLLM 0.32's choices (its CacheConfig.prefix_caching_hash_algo); the first is prefixkv's default
HASH_ALGOS = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")


def get_hash_function(algo: str | HashFunction, seed: int | None = None) -> HashFunction:
    """The content hash named `algo`, or `algo` itself when it is a callable (tests inject one).

    sha256 variants are deterministic; the xxhash variants take a random 64-bit seed per process unless
    `seed` is given, so its values are only comparable between processes that share the seed.
    """
    if callable(algo):
        return algo
    if algo == "sha256_cbor":
        return _sha256_cbor
    if algo == "sha256":
        return _sha256_pickle
    if algo == "xxhash":
        return _make_xxhash_pickle(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    if algo == "xxhash_cbor":
        return _make_xxhash_cbor(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")


def none_hash(hash_fn: HashFunction, seed: str | int = 0) -> bytes:
    """The parent hash of block 0: fixed by `seed`, so the same prefix hashes the same everywhere."""
    return hash_fn(("prefixkv.NONE_HASH", seed))


def hash_chain(
    hash_fn: HashFunction,
    parent: bytes,
    tokens: Sequence[tuple[int, ...]],
    extras: Sequence[ExtraKeys | None],
) -> list[bytes]:
    """Content hashes of consecutive full blocks (their token tuples and extra keys), each chained
    on the one before it, the first on `parent` (none_hash() for block 0). Every process that names
    blocks - the cache, its events, a router hashing prompts - hashes them here, so they agree."""
    out: list[bytes] = []
    for block_tokens, extra in zip(tokens, extras, strict=True):
        parent = hash_fn((parent, block_tokens, extra))
        out.append(parent)
    return out


def lora_extra_key(lora: LoRAKey) -> tuple[str, str, str, str]:
    """The extra key on every block of a request that names adapter `lora`."""
    return ("lora", lora.lora_name, lora.lora_path, lora.weights_digest)


def extra_keys(
    lora_key: tuple[Any, ...] | None,
    mm_items: Sequence[MultiModalKey],
    cache_salt: str | None,
    start: int,
    end: int,
    block_index: int,
) -> ExtraKeys | None:
    """Tagged extra keys of the block covering tokens [start, end), in the order LoRA, multimodal
    items overlapping the block (with their offset relative to the block start), cache salt (block
    0 only - the chain carries it to every later block). None when there are none."""
    keys: list[tuple[Any, ...]] = []
    if lora_key is not None:
        keys.append(lora_key)
    for item in mm_items:
        if item.offset < end and item.offset + item.length > start:
            keys.append(("mm", item.identifier, item.offset - start))
    if block_index == 0 and cache_salt is not None:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def block_extra_keys(request: CacheRequest, start: int, end: int, block_index: int) -> ExtraKeys | None:
    """extra_keys() of `request`'s block covering tokens [start, end)."""
    lora = request.lora_request
    lora_key = lora_extra_key(lora) if lora is not None else None
    return extra_keys(lora_key, request.mm_items, request.cache_salt, start, end, block_index)


def has_extra_keys(request: CacheRequest) -> bool:
    return request.lora_request is not None or bool(request.mm_items) or request.cache_salt is not None


class BlockChain:
    """Per-request identity material, extended incrementally as the request's tokens grow:
    the token tuple and extra keys of every full block, and - only when asked - content hashes.
    Nothing here depends on cache state, so a lookup after a failed allocation reuses it."""

    __slots__ = ("block_size", "tokens", "extras", "content_hashes", "_with_extras")

    def __init__(self, block_size: int, request: CacheRequest) -> None:
        self.block_size = block_size
        self.tokens: list[tuple[int, ...]] = []
        self.extras: list[ExtraKeys | None] = []
        self.content_hashes: list[bytes] = []
        self._with_extras = has_extra_keys(request)

    def extend(self, request: CacheRequest) -> int:
        """Cover every full block of `request`; returns the number of full blocks."""
        bs = self.block_size
        num_full = request.num_tokens // bs
        done = len(self.tokens)
        if done < num_full:
            ids: Sequence[int] = request.all_token_ids
            tokens = self.tokens
            for i in range(done, num_full):
                tokens.append(tuple(ids[i * bs : (i + 1) * bs]))
            if self._with_extras:
                self.extras.extend(block_extra_keys(request, i * bs, (i + 1) * bs, i) for i in range(done, num_full))
        return num_full

    def extra(self, index: int) -> ExtraKeys | None:
        return self.extras[index] if self._with_extras else None

    def hashes_upto(self, n: int, hash_fn: HashFunction, root: bytes) -> list[bytes]:
        """Content hashes of the first n full blocks, chained from `root`; computed once each."""
        hashes = self.content_hashes
        done = len(hashes)
        if done < n:
            extras = self.extras[done:n] if self._with_extras else [None] * (n - done)
            hashes += hash_chain(hash_fn, hashes[-1] if hashes else root, self.tokens[done:n], extras)
        return hashes
