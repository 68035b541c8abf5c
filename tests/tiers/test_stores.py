"""The stores, the value checks and the flags, without an engine."""

from __future__ import annotations

import os
from array import array

import pytest

from prefixkv.engine_args import EngineArgs
from prefixkv.tiers import CPUStore, DiskStore, parse_spec, split_specs
from prefixkv.tiers.value import encode_header, open_value, seal


def test_cpu_store_is_bounded_lru():
    s = CPUStore(300)
    for k in (b"a", b"b", b"c"):
        s.put(k, bytes(100))
    assert s.get(b"a") is not None  # a is now the most recent
    s.put(b"d", bytes(100))  # evicts b, the least recently used
    assert not s.contains(b"b") and s.contains(b"a") and s.contains(b"d")
    assert s.used_bytes == 300 and s.num_evicted == 1
    s.put(b"huge", bytes(301))  # larger than the tier: not kept, nothing evicted for it
    assert not s.contains(b"huge") and len(s) == 3


def test_disk_store_atomic_bounded_and_rescanned(tmp_path):
    s = DiskStore(str(tmp_path), capacity_bytes=250)
    for k in (b"\x01", b"\x02", b"\x03"):
        s.put(k, bytes([k[0]]) * 100)
    assert s.get(b"\x01") is None  # the oldest was deleted to stay within 250 bytes
    assert s.get(b"\x03") == b"\x03" * 100
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    (tmp_path / ".x.kv.1.2.tmp").write_bytes(b"cut short")  # a crash mid-write
    again = DiskStore(str(tmp_path), capacity_bytes=250)  # a restart finds what is there
    assert again.used_bytes == 200 and again.get(b"\x02") == b"\x02" * 100
    assert not (tmp_path / ".x.kv.1.2.tmp").exists()


def _value(key=b"K" * 48, tokens=(1, 2, 3, 4), extras=None, kv=b"\x07" * 64):
    head = encode_header(key, array("i", tokens).tobytes(), extras)
    return seal(head, kv)


def test_value_checks_refuse_anything_but_the_block_asked_for():
    key, toks = b"K" * 48, array("i", (1, 2, 3, 4)).tobytes()
    good = _value()
    assert bytes(open_value(good, key, toks, None, 64)) == b"\x07" * 64
    assert open_value(good, b"L" * 48, toks, None, 64) is None  # another key (foreign value)
    assert open_value(good, key, array("i", (1, 2, 3, 5)).tobytes(), None, 64) is None  # another prefix
    assert open_value(good, key, toks, b"extras", 64) is None  # another LoRA / salt / mm item
    assert open_value(good, key, toks, None, 32) is None  # another KV layout
    for i in (0, 10, len(good) // 2, len(good) - 1):  # any flipped byte: header, KV or checksum
        bad = bytearray(good)
        bad[i] ^= 0x40
        assert open_value(bytes(bad), key, toks, None, 64) is None
    assert open_value(good[:-1], key, toks, None, 64) is None
    assert open_value(b"", key, toks, None, 64) is None


def test_tier_specs_and_flags():
    assert split_specs(["disk:/a,redis://h:1/0", " disk:/b "]) == ["disk:/a", "redis://h:1/0", "disk:/b"]
    spec = parse_spec("disk:/a/b?size=2GiB")
    assert (spec.kind, spec.target, spec.size_bytes) == ("disk", "/a/b", 2 << 30)
    assert parse_spec("redis://localhost:6379/1").kind == "redis"
    assert not spec.sync_load and parse_spec("disk:/a?size=1GiB&load=sync").sync_load  # loads: async by default
    from prefixkv.tiers.redis import RedisStore  # builds a client, connects on first use

    assert RedisStore("redis://127.0.0.1:1/0?load=sync&timeout=2").sync_load
    assert not RedisStore("redis://127.0.0.1:1/0").sync_load
    with pytest.raises(ValueError, match="load must be async or sync"):
        RedisStore("redis://127.0.0.1:1/0?load=later")
    for bad in ("nfs:/x", "disk:", "disk:/x?size=lots", "disk:/x?color=red", "disk:/x?load=lazy", "/plain/path"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    for kw in (
        dict(kv_offloading_size=-1),
        dict(kv_offloading_size="1"),
        dict(kv_tier="nfs:/x"),
        dict(kv_offloading_size=1, enable_prefix_caching=False),
    ):
        with pytest.raises(ValueError):
            EngineArgs(**kw)


def test_cli_flags_repeat(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--kv-offloading-size", "0.5", "--kv-tier", "disk:/a", "--kv-tier", "redis://h:1/0"])
    args = EngineArgs.from_cli_args(ns)
    assert args.kv_offloading_size == 0.5 and args.kv_tier == ["disk:/a", "redis://h:1/0"]
