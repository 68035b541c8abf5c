"""The cache identity of an engine's KV blocks outside its process: the namespace of tier keys.

Two engines may share a block only if the block's KV bytes would be the same: same weights (a
digest of every parameter, not a file name), same KV dtype and layout, same block size, same
device kind, same content-hash function and seed (through the chain's root hash, NONE_HASH).
Everything goes into one digest that prefixes every key, so a store shared by several engines
or models never even looks in another's keys; the value check (value.py) catches the rest.
"""

from __future__ import annotations

import hashlib

import cbor2
import torch
import xxhash

NAMESPACE_VERSION = 1  # bump when the value layout or what the namespace covers changes


def weights_digest(model: torch.nn.Module) -> str:
    """xxh3-128 over every parameter and buffer (name, dtype, shape, bytes), in state-dict order."""
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            data = t.detach().contiguous().cpu()
            if data.dtype in (torch.bfloat16, torch.float16):
                data = data.view(torch.int16)
            elif data.dtype.is_floating_point and data.element_size() == 1:
                data = data.view(torch.int8)
            h.update(data.reshape(-1).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def tier_namespace(
    *,
    weights: str,
    kv_layout: list[tuple[tuple[int, ...], str]],
    block_size: int,
    device_type: str,
    root_hash: bytes,
) -> bytes:
    """16 bytes naming the engine's cache identity; `root_hash` is the chain's NONE_HASH (it
    depends on the hash algorithm and its seed)."""
    ident = cbor2.dumps(
        [NAMESPACE_VERSION, weights, [[list(s), d] for s, d in kv_layout], block_size, device_type, root_hash],
        canonical=True,
    )
    return hashlib.sha256(ident).digest()[:16]
