"""Two engine replicas under Ray Serve sharing one Redis KV tier (a real redis-server): the router's
index learns which blocks sit in the shared tier from the replicas' tier events, and after every
replica's pool is cleared a prompt of that prefix is still served from the tier - not recomputed -
wherever it lands, with greedy outputs unchanged."""

from __future__ import annotations

import re
import time

import pytest

from ..tiers.conftest import redis_server  # noqa: F401 (a fixture)
from .conftest import BLOCK, start_cluster, stop_cluster

pytestmark = pytest.mark.slow(seconds=30)  # its own application (and a redis-server) on the package's Ray + Serve


@pytest.fixture(scope="module")
def cluster(ray_serve, replica_model, redis_server):  # noqa: F811
    c = start_cluster(replica_model, ray_serve, router="prefix-load", kv_tier=redis_server.url)
    yield c
    stop_cluster(c, wait=True)  # its replicas gone before redis_server stops under their tier writers


def tier_blocks(cluster) -> dict[str, float]:
    out = {}
    for line in cluster.client.get("/metrics").text.splitlines():
        m = re.match(r'^prefixkv:router_index_tier_blocks\{(?:replica="router",)?engine="(\w+)"\}\s+(\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def complete(cluster, prompt):
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    res = cluster.client.post("/v1/completions", json=body)
    assert res.status_code == 200, res.text
    return res.json()


def test_a_prefix_in_the_shared_tier_is_served_from_it_on_any_replica(cluster):
    prefix = "a document every replica may be asked about: " + "lorem ipsum " * 10
    first = complete(cluster, prefix)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    whole_blocks = first["usage"]["prompt_tokens"] // BLOCK
    deadline = time.time() + 30
    while tier_blocks(cluster).get("shared", 0) < whole_blocks:  # the tier's writer is asynchronous
        assert time.time() < deadline, f"the router never learned of the shared tier's blocks: {tier_blocks(cluster)}"
        time.sleep(0.2)
    assert cluster.client.post("/reset_prefix_cache").status_code == 200  # every replica's pool, not the tier
    cluster.wait_idle()
    again = complete(cluster, prefix)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (whole_blocks - 1) * BLOCK and cached % BLOCK == 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    m = cluster.wait_idle()
    hits = sum(v for (name, _), v in m.items() if name == "vllm:external_prefix_cache_hits_total")
    assert hits == cached
    assert tier_blocks(cluster)["shared"] >= whole_blocks  # the tier kept them through the reset
