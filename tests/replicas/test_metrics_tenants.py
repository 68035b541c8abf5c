"""The replicas' router serves the aggregated /metrics itself: on a --require-cache-salt server with
an API key it needs the key, as a single server's /metrics does (issue 36, item 9)."""

from __future__ import annotations

import pytest

from .conftest import start_cluster, stop_cluster

pytestmark = pytest.mark.slow(seconds=30)  # its own application on the package's Ray + Serve: its deploy

KEY = "replicas-tenant-key"


@pytest.fixture(scope="module")
def cluster(ray_serve, replica_model):
    # the route under test is the router's own: one engine behind it is enough (one process less)
    c = start_cluster(replica_model, ray_serve, replicas=1, require_cache_salt=True, api_key=KEY)
    yield c
    stop_cluster(c)


def test_aggregated_metrics_need_the_key(cluster):
    assert cluster.client.get("/metrics").status_code == 401
    assert cluster.client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = cluster.client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and 'replica="router"' in r.text
    assert cluster.client.get("/health").status_code == 200  # probes stay open
