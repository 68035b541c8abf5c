"""KV events of the tiers: a subscriber with plain pyzmq + msgpack rebuilds, per `medium`, what
the pool (GPU), the CPU tier, the disk tier and the Redis tier hold - exactly, through saves,
LRU evictions of the CPU and disk tiers, and loads back (promotions into the CPU tier)."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import msgpack
import redis
import zmq

from prefixkv.kv_events import to_int_hash
from prefixkv.tiers.redis import KEY_PREFIX

from .conftest import all_free, engine, free_port, run, tier
from .test_engine_tiers import prompts


def test_subscriber_rebuilds_every_tier_per_medium(tiny_model, tiny_loaded, redis_server, tmp_path):
    ps = prompts(4, 6)
    refs = [run(engine(tiny_model, tiny_loaded, enable_prefix_caching=False), p)[0] for p in ps]
    db = redis.Redis(host="127.0.0.1", port=redis_server.port)
    db.flushdb()
    port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    probe = engine(tiny_model, tiny_loaded, kv_offloading_size=0.001)
    value_bytes = probe.tiers.kv_nbytes + 300  # header and checksum: a few hundred bytes
    probe.tiers.close()
    # a CPU tier of ~25 blocks and a disk tier of ~30 (6 prompts of 11 blocks each): both evict
    eng = engine(
        tiny_model,
        tiny_loaded,
        kv_events_config=config,
        kv_offloading_size=25 * value_bytes / (1 << 30),
        kv_tier=[f"disk:{tmp_path / 'kv'}?size={30 * value_bytes}", redis_server.url],
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # the subscription reaches the publisher
    for p, r in zip(ps, refs):
        assert run(eng, p)[0] == r
        eng.tiers.flush()  # the disk and Redis writes of this request are in order before the next
    assert run(eng, ps[0]) == (refs[0], 36)  # back from the tiers (the pool thrashed)
    eng.tiers.flush()
    eng.take_kv_events()  # the last tier events go out now
    eng.shutdown()

    pool: Counter = Counter()
    tiers: dict[str, set] = defaultdict(set)
    while sub.poll(1000):
        _, _, payload = sub.recv_multipart()
        for ev in msgpack.unpackb(payload)[1]:
            medium = ev.get("medium")
            if ev["type"] == "BlockStored":
                assert len(ev["token_ids"]) == 4 * len(ev["block_hashes"])
                if medium == "GPU":
                    pool.update(ev["block_hashes"])
                else:
                    assert len(ev["block_hashes"]) == 1 and ev["block_size"] == 4
                    tiers[medium].update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                if medium == "GPU":
                    pool.subtract(ev["block_hashes"])
                    pool += Counter()
                else:
                    tiers[medium].difference_update(ev["block_hashes"])
    sub.close()

    ns = len(eng.tiers.namespace)
    cpu, disk = eng.tiers.tiers[0].store, eng.tiers.tiers[1].store
    blocks = eng.scheduler.kv_cache_manager.block_pool.blocks
    assert pool == Counter(to_int_hash(b.content_hash) for b in blocks if b.block_key is not None)
    assert tiers["CPU"] == {to_int_hash(k[ns:]) for k in cpu._values}
    assert tiers["DISK"] == {to_int_hash(bytes.fromhex(n[:-3])[ns:]) for n in disk._index}
    in_redis = {to_int_hash(bytes.fromhex(k[len(KEY_PREFIX) :].decode())[ns:]) for k in db.keys(b"prefixkv:*")}
    assert tiers["REDIS"] == in_redis and len(in_redis) == 6 * 11
    assert cpu.num_evicted > 0 and disk.num_evicted > 0  # removals were published too
    assert 0 < cpu.used_bytes <= cpu.capacity_bytes and 0 < disk.used_bytes <= disk.capacity_bytes
    assert tier(eng, "cpu").hits + tier(eng, "disk").hits + tier(eng, "redis").hits == 9
    assert all_free(eng)
