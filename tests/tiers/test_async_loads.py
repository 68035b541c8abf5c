"""Slow-tier loads run on a loader thread while the engine goes on. The slow store is a real
redis-server made to hang with `DEBUG SLEEP`: a request whose prefix is in it waits
(WAITING_FOR_REMOTE_KVS) while another request keeps decoding, and is then served from the tier;
outputs equal computing from scratch (greedy float32); a load that times out is computed; a
request aborted while loading leaves every block free."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from prefixkv.request import RequestStatus
from prefixkv.sampling_params import SamplingParams

from .conftest import RedisServer, all_free, engine, run, tier
from .test_engine_tiers import prompts

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def slow_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-debug"), debug=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cases(tiny_model, tiny_loaded):
    ps = prompts(3, 2)
    ref = engine(tiny_model, tiny_loaded, enable_prefix_caching=False)
    decode_ref = _drive(ref, ps[1], LONG)
    return ps, [run(ref, p)[0] for p in ps], decode_ref


def _drive(eng, prompt, params):
    rid = eng.add_request(prompt, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no output")


def _start_decoding(eng, prompt) -> str:
    """Add a long request and step until it decodes (its own tier lookup, a miss, done)."""
    rid = eng.add_request(prompt, LONG)
    while not any(r.num_output_tokens for r in eng.scheduler.running):
        eng.step()
    return rid


def _hang(server: RedisServer, seconds: float) -> threading.Thread:
    """Make the server hang for `seconds` (from another client), and return once it does."""
    client = redis.Redis(host="127.0.0.1", port=server.port)
    t = threading.Thread(target=client.execute_command, args=("DEBUG", "SLEEP", seconds), daemon=True)
    t.start()
    time.sleep(0.1)  # the server is asleep now: every other call waits for it
    return t


def _filled(tiny_model, tiny_loaded, server, prompt, ref):
    """A first engine puts the prompt's blocks in an emptied Redis."""
    redis.Redis(host="127.0.0.1", port=server.port).flushdb()
    first = engine(tiny_model, tiny_loaded, kv_tier=server.url)
    assert run(first, prompt) == (ref, 0)
    first.tiers.flush()
    first.tiers.close()


def test_another_request_decodes_while_a_load_is_in_flight(tiny_model, tiny_loaded, cases, slow_redis):
    ps, refs, decode_ref = cases
    _filled(tiny_model, tiny_loaded, slow_redis, ps[0], refs[0])
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"{slow_redis.url}?timeout=5")
    decoding = _start_decoding(eng, ps[1])
    hang = _hang(slow_redis, 1.0)
    loading = eng.add_request(ps[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokens_while_loading, waited, outs = 0, False, {}
    while eng.has_unfinished_requests():
        loading_now = any(r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in eng.scheduler.waiting)
        for out in eng.step():
            outs[out.request_id] = out
            if out.request_id == decoding and loading_now:
                tokens_while_loading += 1
        waited |= loading_now
    hang.join()
    assert waited and tokens_while_loading >= 3  # the engine loop went on during the load
    assert outs[decoding].outputs[0].token_ids == decode_ref
    assert outs[loading].outputs[0].token_ids == refs[0]
    assert outs[loading].num_cached_tokens == 36  # every block that may be a hit came from Redis
    assert tier(eng, "redis").hits == 9 and eng.scheduler.num_loading == 0
    assert all_free(eng)


def test_a_load_that_times_out_is_computed(tiny_model, tiny_loaded, cases, slow_redis, caplog):
    ps, refs, _ = cases
    _filled(tiny_model, tiny_loaded, slow_redis, ps[0], refs[0])
    caplog.set_level(logging.WARNING, logger="prefixkv")
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"{slow_redis.url}?timeout=5")
    eng.tiers.load_timeout_s = 0.3  # the server hangs longer than the engine waits for a load
    hang = _hang(slow_redis, 2.5)  # well past the deadline, even on a loaded machine
    assert run(eng, ps[0]) == (refs[0], 0)  # given up on the load: computed
    hang.join()
    assert tier(eng, "redis").errors >= 1 and "failed an asynchronous load (TimeoutError" in caplog.text
    assert all_free(eng) and eng.scheduler.num_loading == 0


def test_abort_while_loading_frees_everything(tiny_model, tiny_loaded, cases, slow_redis):
    ps, refs, decode_ref = cases
    _filled(tiny_model, tiny_loaded, slow_redis, ps[0], refs[0])
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"{slow_redis.url}?timeout=5")
    decoding = _start_decoding(eng, ps[1])
    hang = _hang(slow_redis, 0.5)
    loading = eng.add_request(ps[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()
    assert eng.scheduler.num_loading == 1
    eng.abort_request(loading)
    assert eng.scheduler.num_loading == 0
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == decoding and out.finished:
                final = out
    hang.join()
    assert final is not None and final.outputs[0].token_ids == decode_ref
    assert all_free(eng)
