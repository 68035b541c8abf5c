"""Where a replica binds its KV-event sockets (`--host`), without Ray: the host mapping, and the
publisher bound on a concrete address with an ephemeral port (LAST_ENDPOINT)."""

from __future__ import annotations

import pytest
import zmq

from prefixkv.kv_events import KVEventsConfig, ZmqEventPublisher
from prefixkv.replicas.event_feed import event_bind_host, tcp_endpoint


@pytest.mark.parametrize(
    "host, bind",
    [
        ("127.0.0.1", "127.0.0.1"),
        ("localhost", "127.0.0.1"),
        (None, "127.0.0.1"),
        ("", "127.0.0.1"),
        ("0.0.0.0", "*"),
        ("::", "*"),
        ("::1", "::1"),
        ("10.1.2.3", "10.1.2.3"),
    ],
)
def test_event_bind_host_follows_the_server_host(host, bind):
    assert event_bind_host(host) == bind


def test_tcp_endpoints_bracket_ipv6():
    assert tcp_endpoint("127.0.0.1", 5) == "tcp://127.0.0.1:5"
    assert tcp_endpoint("::1", "*") == "tcp://[::1]:*"
    assert tcp_endpoint("*", "*") == "tcp://*:*"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_publisher_binds_a_concrete_host_on_an_ephemeral_port(host):
    ep = tcp_endpoint(host, "*")
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=ep, replay_endpoint=ep))
    try:
        pub_ep, replay_ep = pub.endpoints
        shown = f"[{host}]" if ":" in host else host
        assert pub_ep.startswith(f"tcp://{shown}:") and replay_ep.startswith(f"tcp://{shown}:")
        assert pub_ep != replay_ep
        # reachable there: a replay request is answered
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        if ":" in host:
            dealer.setsockopt(zmq.IPV6, 1)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(5000), "no replay answer"
        assert dealer.recv_multipart()[-2] == (-1).to_bytes(8, "big", signed=True)
        dealer.close()
    finally:
        pub.shutdown()
