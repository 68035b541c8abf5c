"""KV events over ZeroMQ, read back with plain pyzmq + msgpack (no prefixkv decoder): the stream
rebuilds the engine's cached blocks exactly (stores, evictions, duplicates, reset), replay resends
from a sequence number, hashes are recomputable from the events, a stalled subscriber stalls nothing."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections import Counter

import cbor2
import msgpack
import pytest
import zmq

from prefixkv import EngineArgs, SamplingParams
from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.kv_events import KVEventsConfig, ZmqEventPublisher, to_int_hash

BS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(default_lm, **events) -> LLMEngine:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events", **events}
    args = EngineArgs(block_size=BS, num_blocks=40, max_num_batched_tokens=64, kv_events_config=config)
    return LLMEngine(args, loaded=default_lm)


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 3) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()


def _workload(engine: LLMEngine) -> None:
    """Shared prefixes (hits, duplicates in one batch), enough distinct prompts to evict, a reset
    while idle, and more requests after it."""
    base = list(range(100, 124))  # 6 blocks
    _run(engine, [[*base, 1, 2, 3, 4, 5], [*base, 6, 7, 8, 9]])  # same step: duplicated prefix blocks
    _run(engine, [[*base, 10, 11, 12, 13, 14, 15]])  # a hit on the cached prefix
    _run(engine, [list(range(200 + 40 * i, 230 + 40 * i)) for i in range(6)])  # thrash: evictions
    assert engine.reset_prefix_cache()
    _run(engine, [[*base, 1, 2, 3, 4, 5], list(range(500, 520))])


def _cached_counter(engine: LLMEngine) -> Counter:
    """The manager's cached set (with multiplicity: duplicated blocks hold the same hash), as the
    wire names it."""
    blocks = engine.scheduler.kv_cache_manager.block_pool.blocks
    return Counter(to_int_hash(b.content_hash) for b in blocks if b.block_key is not None)


def _apply(state: Counter, batch_payload: bytes, parents_seen: list) -> None:
    ts, events, dp_rank = msgpack.unpackb(batch_payload, raw=False)
    assert isinstance(ts, float) and dp_rank == 0
    for ev in events:
        kind = ev["type"]
        if kind == "BlockStored":
            assert ev["medium"] == "GPU" and ev["block_size"] == BS and ev["lora_id"] is None
            assert len(ev["token_ids"]) == BS * len(ev["block_hashes"]) == BS * len(ev["extra_keys"])
            parent = ev["parent_block_hash"]
            parents_seen.append(parent is None or state[parent] > 0)  # a parent is cached when its child is
            state.update(ev["block_hashes"])
        elif kind == "BlockRemoved":
            assert ev["medium"] == "GPU"
            for h in ev["block_hashes"]:
                assert state[h] > 0, "removed a block never stored"
                state[h] -= 1
            state += Counter()  # drop zero counts
        elif kind == "AllBlocksCleared":
            state.clear()
        else:
            raise AssertionError(f"unknown event type {kind!r}")


def _drain(sub: zmq.Socket, until_seq: int, timeout: float = 20.0) -> list[tuple[int, bytes]]:
    got, deadline = [], time.time() + timeout
    while time.time() < deadline and (not got or got[-1][0] < until_seq):
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), payload))
    return got


@pytest.fixture(scope="module")
def streamed(default_lm):
    """One engine, one live subscriber, one replay request: what every stream test reads."""
    port, replay_port = _free_port(), _free_port()
    engine = _engine(default_lm, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    time.sleep(0.5)  # ZeroMQ's slow joiner: a PUB drops what it sends before the subscription arrives
    try:
        _workload(engine)
        last = engine.kv_event_publisher._next_seq - 1
        live = _drain(sub, last)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        start = last - 3
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while dealer.poll(10_000):
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        dealer.close(0)
        yield engine, live, last, start, replayed
    finally:
        sub.close(0)
        engine.shutdown()


def test_stream_rebuilds_cached_set_exactly(streamed):
    engine, live, last, _, _ = streamed
    assert [s for s, _ in live] == list(range(last + 1))  # every batch, in order, no gap
    state, parents_ok = Counter(), []
    kinds = Counter()
    for _, payload in live:
        _apply(state, payload, parents_ok)
        kinds.update(e["type"] for e in msgpack.unpackb(payload)[1])
    assert kinds["BlockStored"] and kinds["BlockRemoved"] and kinds["AllBlocksCleared"] == 1
    assert all(parents_ok)
    assert state == _cached_counter(engine) and state  # exactly the manager's cached blocks
    assert engine.scheduler.kv_cache_manager.block_pool.num_free_blocks == engine.num_blocks  # all free again
    assert engine.take_kv_events() == []  # they went to the publisher
    assert engine.get_stats().num_kv_events_dropped == 0


def test_replay_resends_from_a_sequence_number(streamed):
    _, live, last, start, replayed = streamed
    assert [s for s, _ in replayed] == list(range(start, last + 1))
    assert replayed == [x for x in live if x[0] >= start]  # byte-identical payloads


def test_block_hashes_recomputable_from_the_events(default_lm, monkeypatch):
    """With full digests on the wire, a consumer recomputes every hash from the parent hash, the
    token ids and the extra keys: sha256 over canonical CBOR of (parent, tokens, extra keys),
    chained from sha256(cbor(("prefixkv.NONE_HASH", 0)))."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    path = f"ipc:///tmp/prefixkv-test-events-{_free_port()}"
    engine = _engine(default_lm, endpoint=path)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(path)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    try:
        _run(engine, [list(range(1, 14))])
        _run(engine, [[*range(1, 9), 77, 78, 79, 80, 81]], max_tokens=1)  # continues a cached chain
        live = _drain(sub, engine.kv_event_publisher._next_seq - 1)
    finally:
        sub.close(0)
        engine.shutdown()
    root = hashlib.sha256(cbor2.dumps(("prefixkv.NONE_HASH", 0), canonical=True)).digest()
    stored = [e for _, p in live for e in msgpack.unpackb(p)[1] if e["type"] == "BlockStored"]
    assert len(stored) >= 2 and stored[1]["parent_block_hash"] is not None
    for ev in stored:
        parent = ev["parent_block_hash"] or root
        for i, h in enumerate(ev["block_hashes"]):
            tokens = tuple(ev["token_ids"][i * BS : (i + 1) * BS])
            parent = hashlib.sha256(cbor2.dumps((parent, tokens, ev["extra_keys"][i]), canonical=True)).digest()
            assert h == parent and len(h) == 32


def test_stalled_subscriber_never_blocks_the_engine(default_lm):
    """A subscriber that never reads, a tiny high-water mark and queue: generation still finishes,
    the memory held stays bounded, and batches the publisher could not take are counted."""
    path = f"ipc:///tmp/prefixkv-test-events-{_free_port()}"
    engine = _engine(default_lm, endpoint=path, hwm=1, max_queue_size=2, buffer_steps=4)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.connect(path)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        done = threading.Event()

        def generate():
            _run(engine, [list(range(300 + 40 * i, 330 + 40 * i)) for i in range(8)], max_tokens=4)
            done.set()

        t = threading.Thread(target=generate, daemon=True)
        t.start()
        t.join(120)
        assert done.is_set(), "generation stalled behind the KV event subscriber"
        pub = engine.kv_event_publisher
        assert isinstance(pub, ZmqEventPublisher) and len(pub._buffer) <= 4 and pub._queue.qsize() <= 2
        # flood the queue faster than the thread can encode: the excess is dropped, counted, and shown
        for _ in range(20_000):
            pub.publish([])
        assert pub._queue.qsize() <= 2
        assert pub.num_dropped_batches > 0
        engine._update_stats()
        assert engine.get_stats().num_kv_events_dropped == pub.num_dropped_events
    finally:
        sub.close(0)
        engine.shutdown()
    assert engine.kv_event_publisher is None and not pub._thread.is_alive()


# -- configuration --------------------------------------------------------------------------------
def test_config_defaults_and_refusals():
    c = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == (
        "zmq",
        "tcp://*:5557",
        None,
        10_000,
        100_000,
        100_000,
        "",
    )
    assert KVEventsConfig.parse({}).publisher == "null" and not KVEventsConfig().publishes
    with pytest.raises(ValueError, match="unknown key.*'topics'"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "topics": "x"})
    with pytest.raises(ValueError, match="unknown event publisher 'kafka'"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="max_queue_size"):
        KVEventsConfig.parse({"max_queue_size": 0})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineArgs(kv_events_config="{enable")
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(kv_events_config={"endpoint": "tcp://*:1", "nope": 1})


def test_cli_flag_and_null_publisher(default_lm):
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}'])
    args = EngineArgs.from_cli_args(ns)
    assert args.enable_kv_cache_events and args.kv_events_config.publisher == "null"
    args.block_size, args.num_blocks = BS, 16
    engine = LLMEngine(args, loaded=default_lm)
    assert engine.kv_event_publisher is None  # null: events stay in the process for take_kv_events()
    _run(engine, [list(range(1, 10))], max_tokens=1)
    assert [type(e).__name__ for e in engine.take_kv_events()] == ["BlockStored"]


def test_endpoint_in_use_is_refused_at_startup():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{_free_port()}")
    first = ZmqEventPublisher(config)
    try:
        with pytest.raises(ValueError, match="cannot open"):
            ZmqEventPublisher(config)
    finally:
        first.shutdown()
    deadline = time.time() + 10
    while True:  # released (ZeroMQ closes sockets in its I/O thread, a moment later): bound again
        try:
            ZmqEventPublisher(config).shutdown()
            break
        except ValueError:
            assert time.time() < deadline, "the endpoint was never released"
            time.sleep(0.05)


END = (-1).to_bytes(8, "big", signed=True)


def _replay_publisher() -> tuple[ZmqEventPublisher, str]:
    replay = f"tcp://127.0.0.1:{_free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{_free_port()}", replay_endpoint=replay)
    return ZmqEventPublisher(config), replay


def _dealer(endpoint: str) -> zmq.Socket:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    return d


def test_malformed_replay_requests_get_an_error_reply():
    """A request of 4 frames (or any count but 2 and 3) was logged and left unanswered: the client
    waited for its own timeout. Every malformed request is answered with the end marker, its
    payload saying what was wrong."""
    pub, endpoint = _replay_publisher()
    try:
        pub.publish([])  # one batch buffered
        for frames in ([b"", b"\0" * 8, b"x"], [b"a", b"b", b"c"], [b"", b"short"], [b"\0" * 8, b"x", b"y", b"z"]):
            d = _dealer(endpoint)
            d.send_multipart(frames)
            assert d.poll(5000), f"no answer to {len(frames)} frames"
            reply = d.recv_multipart()
            assert reply[-2] == END and reply[-1].startswith(b"invalid replay request"), reply
            d.close()
        d = _dealer(endpoint)  # and a good request is still served
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        assert d.poll(5000)
        assert d.recv_multipart()[1] == (0).to_bytes(8, "big")
        d.close()
    finally:
        pub.shutdown()


def test_replay_socket_refuses_oversized_frames():
    """A 300 MB frame to the replay socket was taken whole (+600 MB RSS). ZeroMQ's MAXMSGSIZE
    disconnects a peer whose frame is longer than any legitimate request's: no answer, nothing
    kept, and the socket serves the next client."""
    from prefixkv.kv_events.publisher import REPLAY_MAX_FRAME

    pub, endpoint = _replay_publisher()
    try:
        assert pub._replay.getsockopt(zmq.MAXMSGSIZE) == REPLAY_MAX_FRAME
        assert 8 <= REPLAY_MAX_FRAME < 4096
        d = _dealer(endpoint)
        d.send_multipart([b"", b"\0" * (16 << 20)])
        assert not d.poll(1500), "an oversized request was read and answered"
        d.close()
        d = _dealer(endpoint)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        assert d.poll(5000) and d.recv_multipart()[-2] == END
        d.close()
    finally:
        pub.shutdown()
