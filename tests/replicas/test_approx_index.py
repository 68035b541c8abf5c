"""The fallback without KV events: `--router prefix --router-index approx` learns where prefixes
are from what it sent, and same-prefix requests still share one replica's cache."""

from __future__ import annotations

import pytest

from .conftest import BLOCK, start_cluster, stop_cluster
from .test_routing import complete, per_engine

pytestmark = pytest.mark.slow(seconds=30)  # its own application on the package's Ray + Serve: its deploy


@pytest.fixture(scope="module")
def cluster(ray_serve, replica_model):
    c = start_cluster(replica_model, ray_serve, router="prefix", router_index="approx")
    yield c
    stop_cluster(c)


def test_approx_index_keeps_a_prefix_on_one_replica(cluster):
    for turn in range(3):
        prefix = f"{turn} conversation: " + "the same long opening " * 4
        before = per_engine(cluster, "prefixkv:router_requests_total")
        first = complete(cluster, prefix + "one")
        second = complete(cluster, prefix + "two")
        after = per_engine(cluster, "prefixkv:router_requests_total")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix) - 2 * BLOCK
        assert sorted(after[k] - before.get(k, 0) for k in after) == [0, 2]
    # the index holds what the router sent, per replica (no events behind it)
    assert sum(per_engine(cluster, "prefixkv:router_index_blocks").values()) > 0
    cluster.wait_idle()
