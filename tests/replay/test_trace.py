"""Trace parsing: Mooncake records, deterministic id expansion, the simple JSONL format."""

import json

import pytest

from prefixkv.replay import expand_hash_ids, load_jsonl, load_mooncake, load_trace


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_expansion_is_deterministic_distinct_and_cut():
    a = expand_hash_ids([7, 3], 600)
    assert len(a) == 600 and a == expand_hash_ids([7, 3], 600)
    assert a[:512] == list(range(7 * 512, 8 * 512)) and a[512:] == list(range(3 * 512, 3 * 512 + 88))
    assert expand_hash_ids([7, 4], 600)[:512] == a[:512] and expand_hash_ids([7, 4], 600)[512:] != a[512:]
    assert expand_hash_ids([1, 2], 4, tokens_per_id=2) == [2, 3, 4, 5]
    with pytest.raises(ValueError):
        expand_hash_ids([1], 513)


def test_mooncake_parsing_sorts_stably_and_checks(tmp_path):
    p = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
            {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [2]},
            {"timestamp": 5, "input_length": 512, "output_length": 0, "hash_ids": [0]},
        ],
    )
    reqs = load_mooncake(p)
    assert [r.timestamp_ms for r in reqs] == [0, 5, 5]
    assert reqs[1].hash_ids == (0, 1) and reqs[2].hash_ids == (0,)  # equal times keep file order
    assert reqs[1].prompt_token_ids()[:512] == reqs[2].prompt_token_ids()
    assert load_trace(p)[1].hash_ids == (0, 1) and len(load_mooncake(p, limit=1)) == 1
    bad = write(
        tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}]
    )
    with pytest.raises(ValueError, match="need 3"):
        load_mooncake(bad)
    with pytest.raises(ValueError, match="not a Mooncake record"):
        load_mooncake(write(tmp_path / "x.jsonl", [{"timestamp": 0}]))


def test_simple_jsonl(tmp_path):
    p = write(
        tmp_path / "s.jsonl",
        [{"prompt": "héllo"}, {"prompt_token_ids": [1, 2, 3], "timestamp": 10, "output_length": 4}],
    )
    reqs = load_jsonl(p)
    assert reqs[0].prompt_token_ids() == list("héllo".encode()) and reqs[0].timestamp_ms == 0
    assert reqs[1].prompt_token_ids() == [1, 2, 3] and reqs[1].output_length == 4
    assert load_trace(p)[1].token_ids == (1, 2, 3)
    with pytest.raises(ValueError):
        load_jsonl(write(tmp_path / "e.jsonl", [{"nothing": 1}]))


def test_real_trace_head():
    import os

    from prefixkv.replay import replay, replay_optimum

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "examples", "traces", "conversation_sample.jsonl")  # shipped
    reqs = load_mooncake(path, limit=200)
    assert len(reqs) == 200
    lru = replay(reqs, 1024, 512, "lru")
    opt = replay_optimum(reqs, 1024, 512)
    assert lru.requests + lru.skipped == 200 and opt.hit_rate >= lru.hit_rate > 0
