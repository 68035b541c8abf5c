"""The Redis tier against a real redis-server started here (Debian's package) on a free port."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from .conftest import all_free, engine, run, tier
from .test_engine_tiers import prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cases(tiny_model, tiny_loaded):
    ps = prompts(2, 5)
    ref = engine(tiny_model, tiny_loaded, enable_prefix_caching=False)
    return ps, [run(ref, p)[0] for p in ps]


@pytest.mark.slow
def test_a_second_engine_process_hits_the_first_ones_prefixes(tiny_model, tiny_loaded, cases, redis_server):
    ps, refs = cases
    first = engine(tiny_model, tiny_loaded, kv_tier=redis_server.url)
    assert run(first, ps[0]) == (refs[0], 0)
    first.tiers.flush()
    assert tier(first, "redis").saves == 11 and tier(first, "redis").errors == 0
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "second_engine.py"), tiny_model, redis_server.url]
        + [",".join(map(str, ps[0]))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"tokens": refs[0], "cached": 36, "hits": [9], "all_free": True}


def test_redis_killed_and_restarted_mid_run(tiny_model, tiny_loaded, cases, redis_server, caplog):
    ps, refs = cases
    caplog.set_level(logging.WARNING, logger="prefixkv")
    eng = engine(tiny_model, tiny_loaded, kv_tier=redis_server.url)
    assert run(eng, ps[1])[0] == refs[1]
    eng.tiers.flush()
    redis_server.stop()  # killed: every call now fails at once (connection refused)
    for p, r in zip(ps[2:], refs[2:]):
        assert run(eng, p)[0] == r  # served by recomputing
    assert run(eng, ps[1])[0] == refs[1]  # its blocks were evicted from the pool, and Redis is down
    eng.tiers.flush()
    down = tier(eng, "redis")
    assert down.errors >= 1 and not down.available
    assert "failed" in caplog.text and redis_server.url in caplog.text

    redis_server.start()  # restarted, empty (no persistence)
    eng.tiers.retry_now()  # rather than wait out the backoff
    hits_before = tier(eng, "redis").hits
    assert run(eng, ps[0]) == (refs[0], 0)  # saved again once it answers
    eng.tiers.flush()
    for p, r in zip(ps[2:], refs[2:]):
        assert run(eng, p)[0] == r
    assert run(eng, ps[0]) == (refs[0], 36)  # the pool thrashed: (partly) from the restarted Redis
    assert tier(eng, "redis").hits > hits_before
    assert tier(eng, "redis").available and "answers again" in caplog.text
    assert all_free(eng)
