"""Tier values authenticated by a secret (issue 36, item 3). Without a secret a value is checked
(xxh3), which anyone who can write the store can recompute: a planted value - other KV bytes, the
checksum recomputed - is loaded (documented in docs/tiers.md). With `kv_tier_secret` every value
carries an HMAC-SHA256 under it, and a planted value is refused (a miss, counted, logged), whatever
its checksum; engines with the same secret share blocks. A real disk folder and a real redis-server."""

from __future__ import annotations

import logging
import struct

import pytest
import xxhash

from prefixkv.cli import build_parser
from prefixkv.engine_args import TIER_SECRET_ENV, EngineArgs
from prefixkv.tiers.value import MAC_SIZE, MAGIC, authenticated, encode_header, open_value, seal

from .conftest import all_free, engine, run, tier
from .test_engine_tiers import _hashes, prompts

SECRET = "correct horse battery staple 36"
FULL = 36  # cached tokens of a 40-token prompt whose 9 whole blocks (of 4) before the last token hit


@pytest.fixture(scope="module")
def cases(tiny_model, tiny_loaded):
    ps = prompts(36, 1)
    ref = engine(tiny_model, tiny_loaded, enable_prefix_caching=False)
    return ps[0], run(ref, ps[0])[0]


def _plant(value: bytes, with_mac: bool) -> bytes:
    """What someone who can write the store but lacks the secret can make of a stored value: the
    same header (key, prefix, extra keys), other KV bytes (all zero), the xxh3 checksum recomputed;
    a MAC-sized tail kept where there was one (it cannot be recomputed without the secret)."""
    (hlen,) = struct.unpack_from("<I", value, len(MAGIC))
    kv_start = len(MAGIC) + 4 + hlen
    tail = MAC_SIZE if with_mac else 0
    kv_end = len(value) - 16 - tail
    head, kv = value[:kv_start], bytes(kv_end - kv_start)
    body = head + kv + xxhash.xxh3_128_digest(head + kv)
    return body + (value[len(value) - tail :] if tail else b"")


class _Disk:
    def __init__(self, folder) -> None:
        self.folder, self.spec = folder, f"disk:{folder}"

    def get(self, key: bytes) -> bytes:
        return (self.folder / (key.hex() + ".kv")).read_bytes()

    def put(self, key: bytes, value: bytes) -> None:
        (self.folder / (key.hex() + ".kv")).write_bytes(value)


class _Redis:
    def __init__(self, url: str) -> None:
        import redis

        self.spec, self.client = url, redis.Redis.from_url(url)
        self.client.flushdb()

    def get(self, key: bytes) -> bytes:
        value = self.client.get(b"prefixkv:" + key.hex().encode())
        assert value is not None
        return value

    def put(self, key: bytes, value: bytes) -> None:
        self.client.set(b"prefixkv:" + key.hex().encode(), value)


@pytest.fixture(params=["disk", "redis"])
def store(request, tmp_path):
    if request.param == "disk":
        return _Disk(tmp_path / "kv")
    return _Redis(request.getfixturevalue("redis_server").url)


def _plant_all(eng, store, prompt, with_mac: bool) -> None:
    for h in _hashes(eng, prompt):
        key = eng.tiers.key(h)
        store.put(key, _plant(store.get(key), with_mac))


def test_without_a_secret_a_planted_value_is_loaded(tiny_model, tiny_loaded, cases, store):
    """The limit of the checksum, as documented: it is no authentication."""
    prompt, ref = cases
    first = engine(tiny_model, tiny_loaded, kv_tier=store.spec)
    assert run(first, prompt) == (ref, 0)
    first.tiers.flush()
    _plant_all(first, store, prompt, with_mac=False)
    victim = engine(tiny_model, tiny_loaded, kv_tier=store.spec)
    _, cached = run(victim, prompt)
    assert cached == FULL  # every planted block passed the checks and was loaded
    t = tier(victim, store.spec.split(":")[0])
    assert t.hits == 9 and t.rejected == 0
    assert all_free(victim)


def test_with_the_secret_planted_values_are_refused_and_secret_holders_share(
    tiny_model, tiny_loaded, cases, store, caplog
):
    prompt, ref = cases
    name = store.spec.split(":")[0]
    caplog.set_level(logging.INFO, logger="prefixkv")
    first = engine(tiny_model, tiny_loaded, kv_tier=store.spec, kv_tier_secret=SECRET)
    assert run(first, prompt) == (ref, 0)
    first.tiers.flush()

    # the same secret: the blocks are shared (a restart, another engine)
    second = engine(tiny_model, tiny_loaded, kv_tier=store.spec, kv_tier_secret=SECRET)
    assert second.tiers.namespace == first.tiers.namespace
    assert run(second, prompt) == (ref, FULL)
    assert tier(second, name).hits == 9

    # another secret, or none: another key space - nothing found, nothing overwritten
    for other in (dict(kv_tier_secret="another secret"), {}):
        eng = engine(tiny_model, tiny_loaded, kv_tier=store.spec, **other)
        assert eng.tiers.namespace != first.tiers.namespace
        assert run(eng, prompt) == (ref, 0)
        assert tier(eng, name).hits == 0

    # planted values (checksum recomputed, the old MAC kept): refused, the blocks computed
    _plant_all(first, store, prompt, with_mac=True)
    victim = engine(tiny_model, tiny_loaded, kv_tier=store.spec, kv_tier_secret=SECRET)
    assert run(victim, prompt) == (ref, 0)
    t = tier(victim, name)
    assert t.hits == 0 and t.rejected >= 1  # the chain stops at the first refused block
    assert "refused: no valid MAC under the tier secret" in caplog.text
    assert all_free(victim)
    # the recomputed blocks were written again, MAC and all: the tier is repaired
    victim.tiers.flush()
    again = engine(tiny_model, tiny_loaded, kv_tier=store.spec, kv_tier_secret=SECRET)
    assert run(again, prompt) == (ref, FULL)

    # the secret never appears in a log line, a repr or the stats
    for text in (caplog.text, repr(victim.config), repr(victim.get_stats()), repr(victim.tiers.stats())):
        assert SECRET not in text
    assert "authenticated" in caplog.text  # the log says there is a secret, not what it is


def test_values_and_macs():
    key, toks, kv = b"K" * 32, struct.pack("<4i", 1, 2, 3, 4), b"\x07" * 64
    head = encode_header(key, toks, None)
    secret = b"s"
    value = seal(head, kv, key, secret)
    assert len(value) == len(seal(head, kv)) + MAC_SIZE
    body = authenticated(value, key, secret)
    assert body is not None and bytes(open_value(body, key, toks, None, 64)) == kv
    assert authenticated(value, key, b"t") is None  # another secret
    assert authenticated(value, b"L" * 32, secret) is None  # moved under another key
    assert authenticated(seal(head, kv), key, secret) is None  # no MAC at all
    assert authenticated(_plant(value, with_mac=True), key, secret) is None  # checksum recomputed
    assert open_value(_plant(seal(head, kv), with_mac=False), key, toks, None, 64) is not None  # passes the checksum


def test_the_secret_from_flag_keyword_or_environment(tiny_model, monkeypatch, tmp_path):
    spec = f"disk:{tmp_path}"
    args = build_parser().parse_args(["serve", tiny_model, "--kv-tier", spec, "--kv-tier-secret", SECRET])
    from_cli = EngineArgs.from_cli_args(args)
    assert from_cli.tier_secret_bytes() == SECRET.encode()
    assert from_cli == EngineArgs(model=tiny_model, kv_tier=[spec], kv_tier_secret=SECRET)
    assert SECRET not in repr(from_cli)
    monkeypatch.setenv(TIER_SECRET_ENV, SECRET)
    assert EngineArgs(kv_tier=spec).tier_secret_bytes() == SECRET.encode()
    assert EngineArgs().kv_tier_secret is None  # no tiers: the environment's secret is not taken
    assert EngineArgs(kv_tier=spec, kv_tier_secret="flag wins").kv_tier_secret == "flag wins"
    with pytest.raises(ValueError, match="non-empty") as e:
        EngineArgs(kv_tier=spec, kv_tier_secret="")
    with pytest.raises(ValueError, match="give it with kv_tier") as e:
        EngineArgs(kv_tier_secret=SECRET)
    assert SECRET not in str(e.value)
