"""Feed the router's PrefixIndex from one replica's KV events (ZeroMQ SUB + replay DEALER).

Order of things, so no batch is lost or applied twice: subscribe first, then ask the replay socket
for everything from sequence 0 (a replica just started has sent little; what it sent before the
subscription joined - ZeroMQ's slow joiner - comes back this way), apply it, then apply live
batches past the last replayed one. A hole in the live sequence (the publisher dropped a batch,
or the socket did) is asked for again; when the replay buffer no longer has it, the replica's
entries are dropped (`cleared`), as docs/kv_events.md advises: the index under-claims, never
over-claims. Runs as one asyncio task per replica on the ingress's event loop, so the index needs
no lock.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Hashable
from typing import Any

import zmq
import zmq.asyncio

from ..router import PrefixIndex

logger = logging.getLogger("prefixkv.replicas")
END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "*")


def event_bind_host(host: str | None) -> str:
    """The interface a replica binds its KV-event sockets on: the server's `--host`, so events
    (every prompt's token ids) are reachable exactly where the API is. Loopback by default; "*"
    (every interface) only for a wildcard --host; a host name is resolved to its address."""
    if not host or host == "localhost":
        return "127.0.0.1"
    if host in WILDCARD_HOSTS:
        return "*"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def tcp_endpoint(host: str, port: int | str) -> str:
    """tcp://host:port, an IPv6 address in brackets (ZeroMQ's form)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _ipv6(sock: zmq.Socket[Any], endpoint: str) -> None:
    if "[" in endpoint:  # ZeroMQ sockets are IPv4-only unless told
        sock.setsockopt(zmq.IPV6, 1)


class EventFeed:
    def __init__(
        self, index: PrefixIndex, replica: Hashable, host: str, pub_port: int, replay_port: int, topic: str
    ) -> None:
        self.index = index
        self.replica = replica
        self.pub = tcp_endpoint(host, pub_port)
        self.replay = tcp_endpoint(host, replay_port)
        self.topic = topic.encode()
        self.next_seq = 0
        self.num_batches = 0
        self.num_gaps = 0
        self._ctx = zmq.asyncio.Context.instance()

    async def _replay_from(self, start: int) -> int | None:
        """Apply every buffered batch from `start`; the first sequence number the replica still had
        (None: nothing buffered at or after start)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        _ipv6(dealer, self.replay)
        dealer.connect(self.replay)
        first: int | None = None
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                seq_bytes, payload = frames[-2], frames[-1]
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return first
                if first is None:
                    first = seq
                if seq >= self.next_seq:
                    self._apply(seq, payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.index.apply_batch(self.replica, payload)
        self.next_seq = seq + 1
        self.num_batches += 1

    async def _catch_up(self, start: int) -> None:
        first = await self._replay_from(start)
        if first is not None and first > start:  # the buffer lost part of the hole: forget, start over
            self.num_gaps += 1
            logger.warning(
                "replica %s: KV events %d..%d are gone; dropping its index entries", self.replica, start, first
            )
            self.index.cleared(self.replica)
            await self._replay_from(first)

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        _ipv6(sub, self.pub)
        sub.connect(self.pub)
        try:
            await asyncio.sleep(0.05)  # let the subscription reach the publisher before the replay
            await self._catch_up(0)
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq < self.next_seq:
                    continue  # already had it from the replay
                if seq > self.next_seq:
                    await self._catch_up(self.next_seq)
                    if seq < self.next_seq:
                        continue
                self._apply(seq, payload)
        finally:
            sub.close(linger=0)
