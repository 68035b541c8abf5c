"""What a tier stores for one KV block, and the checks a value must pass to be loaded.

    MAGIC | u32 header length | header (CBOR) | KV bytes | xxh3-128 of everything before it
          [| HMAC-SHA256 under the tier secret of (u32 key length | key | everything before it)]

The header carries the full key (namespace + content hash), every token id of the prefix up to
the end of the block and the extra keys (LoRA, multimodal, cache salt) of each of its blocks.
On load, a value is used only if the checksum matches, the key is the one asked for, and the
prefix and extra keys are exactly the request's: the content hash only says where to look, so a
corrupted value, a value of another model or engine, or a hash collision is a miss - never a
wrong block, whatever the hash function does.

The checksum protects against accidents (a flipped bit, a truncated file, a value of another
engine), not against someone who can write to the store: anyone can recompute an xxh3. With a tier
secret (`kv_tier_secret`), every value also carries an HMAC-SHA256 under the secret over its key
and bytes, and a value from a disk or Redis tier is used only if it verifies (`authenticated`):
values planted by someone who can write the store but lacks the secret are misses. The CPU tier is
in-process memory, written only by this engine (values sealed here, or authenticated before they
were promoted into it), so its values are not verified again.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import cbor2
import xxhash

MAGIC = b"PKVT\x01"
_HEAD = struct.Struct("<I")
_SUM = 16  # xxh3-128 digest bytes
_PREFIX = len(MAGIC) + _HEAD.size
MAC_SIZE = 32  # HMAC-SHA256 bytes, after the checksum, with a tier secret


def encode_header(key: bytes, prefix_tokens: bytes, extras: bytes | None) -> bytes:
    """The part of a value the scheduler knows: magic, header length, header."""
    header = cbor2.dumps({"k": key, "t": prefix_tokens, "x": extras})
    return MAGIC + _HEAD.pack(len(header)) + header


def _cbor_bytes_nbytes(n: int) -> int:
    """Encoded size of a CBOR byte string of n bytes (its head, 1 to 9 bytes, and the bytes)."""
    head = 1 if n < 24 else 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5 if n < 1 << 32 else 9
    return head + n


def value_nbytes(
    key_nbytes: int, prefix_tokens_nbytes: int, extras_nbytes: int | None, kv_nbytes: int, mac: bool = False
) -> int:
    """The exact size of the value `seal(encode_header(...), kv)` makes for these sizes (`mac`: with
    a tier secret's MAC): the only size a value of that block can have, so a store can refuse a
    file of another size unread. The header is {"k": key, "t": tokens, "x": extras or None} (1 byte
    for the 3-entry map, 2 per one-letter text key)."""
    header = 1 + 3 * 2 + _cbor_bytes_nbytes(key_nbytes) + _cbor_bytes_nbytes(prefix_tokens_nbytes)
    header += 1 if extras_nbytes is None else _cbor_bytes_nbytes(extras_nbytes)
    return _PREFIX + header + kv_nbytes + _SUM + (MAC_SIZE if mac else 0)


def seal(head: bytes, kv: bytes | bytearray | memoryview, key: bytes = b"", secret: bytes | None = None) -> bytes:
    """The whole value: header, KV bytes, checksum, and with a `secret` the MAC binding it to `key`."""
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(kv)
    body = b"".join((head, kv, h.digest()))
    if secret is None:
        return body
    return body + _mac(secret, key, body)


def _mac(secret: bytes, key: bytes, body: bytes | memoryview) -> bytes:
    m = hmac.new(secret, digestmod=hashlib.sha256)
    m.update(_HEAD.pack(len(key)))  # the key's length first: (key, body) pairs cannot run into each other
    m.update(key)
    m.update(body)
    return m.digest()


def authenticated(value: bytes | memoryview, key: bytes, secret: bytes) -> memoryview | None:
    """`value` without its MAC when the MAC verifies under `secret` for `key`, else None."""
    view = memoryview(value)
    if len(view) < MAC_SIZE:
        return None
    body = view[:-MAC_SIZE]
    if not hmac.compare_digest(_mac(secret, key, body), view[-MAC_SIZE:]):
        return None
    return body


def without_mac(value: bytes | memoryview) -> memoryview:
    """A value of this engine's own (the in-process tier) without its MAC, unverified."""
    view = memoryview(value)
    return view[: max(0, len(view) - MAC_SIZE)]


def open_value(
    value: bytes | memoryview, key: bytes, prefix_tokens: bytes | memoryview, extras: bytes | None, kv_nbytes: int
) -> memoryview | None:
    """The KV bytes of `value` if it is exactly the block asked for, else None."""
    view = memoryview(value)
    if len(view) < _PREFIX + _SUM or view[: len(MAGIC)] != MAGIC:
        return None
    (hlen,) = _HEAD.unpack_from(view, len(MAGIC))
    kv_start = _PREFIX + hlen
    if len(view) != kv_start + kv_nbytes + _SUM:
        return None
    if xxhash.xxh3_128_digest(view[:-_SUM]) != view[-_SUM:]:
        return None
    try:
        header = cbor2.loads(view[_PREFIX:kv_start])
    except Exception:  # noqa: BLE001 (a checksummed but foreign header: not ours)
        return None
    if not isinstance(header, dict):
        return None
    if header.get("k") != key or header.get("t") != prefix_tokens or header.get("x") != extras:
        return None
    return view[kv_start:-_SUM]
