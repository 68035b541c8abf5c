"""Publishers of KV event batches: ZeroMQ PUB with a replay ROUTER (vLLM's ZmqEventPublisher
protocol), or null.

The engine thread only encodes nothing and blocks on nothing: `publish()` assigns the batch its
sequence number and puts it in a bounded queue without waiting. When the queue is full (the
publisher thread cannot keep up) the batch is dropped and counted (`num_dropped_events`); its
sequence number is not reused, so a subscriber sees the gap. The thread encodes, sends
`[topic, seq as 8-byte big-endian, payload]` on the PUB socket - ZeroMQ drops, never blocks, for a
subscriber past the high-water mark - and keeps the last `buffer_steps` payloads for replay.

Replay (as vLLM): a client (REQ or DEALER) sends the first sequence number it wants as 8 bytes
big-endian to the ROUTER socket; it gets every buffered `[seq, payload]` from there on, then
`[-1 as 8 signed bytes, b""]`. A malformed request (another frame count, a start that is not 8
bytes) gets only the end marker, its payload `b"invalid replay request: ..."` saying why (the
client is not left waiting for its own timeout). A peer sending a frame longer than any request's
is disconnected by ZeroMQ before the frame is read (MAXMSGSIZE).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

try:
    import zmq
except ImportError:  # the kv-events extra: refused by name when a publisher is asked for
    zmq = None  # type: ignore[assignment]

from ..cache import KVCacheEvent
from .config import KVEventsConfig
from .wire import encode_batch, hash_converter, msgpack_missing

logger = logging.getLogger("prefixkv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The longest frame a replay request has is its 8-byte start (the other is the empty delimiter);
# ZeroMQ disconnects a peer whose frame is longer instead of buffering it (a 300 MB frame cost
# +600 MB). Room to spare, for clients that pad.
REPLAY_MAX_FRAME = 256


class EventPublisher:
    """Null publisher: takes batches and drops them (events on, publisher "null")."""

    num_published = 0
    num_dropped_events = 0

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        return

    def shutdown(self) -> None:
        return


def _ipv6(sock: zmq.Socket[bytes], endpoint: str) -> None:
    # an IPv6 address is written in brackets (tcp://[::1]:5557); ZeroMQ sockets are IPv4-only unless told
    if "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)


def _binds(endpoint: str) -> bool:
    # vLLM's rule: bind a stable address (wildcard, ipc, inproc), connect to anything else
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher(EventPublisher):
    SHUTDOWN_TIMEOUT = 1.0
    _POLL_S = 0.02  # how long the thread waits on an empty queue before looking at replay requests

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[tuple[int, float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._convert = hash_converter()
        self._topic = config.topic.encode("utf-8")
        self._next_seq = 0
        self.num_published = 0  # batches sent
        self.num_dropped_events = 0  # events in batches dropped because the queue was full
        self.num_dropped_batches = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            _ipv6(self._pub, config.endpoint)
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_FRAME)
                _ipv6(self._replay, config.replay_endpoint)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            where = f"{config.endpoint!r}" + (f" / {config.replay_endpoint!r}" if config.replay_endpoint else "")
            raise ValueError(f"kv_events_config: cannot open {where}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="prefixkv-kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoints(self) -> tuple[str, str | None]:
        """(PUB, replay) as bound or connected (ZeroMQ's LAST_ENDPOINT): the port an endpoint
        with port * got; None for no replay socket."""
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        return pub, replay

    # -- engine thread ------------------------------------------------------------------------
    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one batch (one engine step's events); never blocks."""
        if not self._running:
            return
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time(), list(events)))
        except queue.Full:
            self.num_dropped_batches += 1
            self.num_dropped_events += len(events)

    def shutdown(self) -> None:
        """Send what is queued (for at most SHUTDOWN_TIMEOUT seconds), stop the thread, close."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT * 2)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread did not stop; %d batches unsent", self._queue.qsize())
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- publisher thread ---------------------------------------------------------------------
    def _run(self) -> None:
        get = self._queue.get
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV event replay failed")
            try:
                item = get(timeout=self._POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode_batch(events, self._convert, ts, self.data_parallel_rank)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
                self._buffer.append((seq, payload))
                self.num_published += 1
            except zmq.Again:  # PUB never blocks; kept for connect-mode sockets with no peer yet
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("KV event publishing failed")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        # REQ clients send [identity, b"", start]; DEALER clients may omit the empty delimiter
        send = self._replay.send_multipart
        if len(frames) == 3 and frames[1] == b"":
            envelope, start_bytes = [frames[0], b""], frames[2]
        elif len(frames) == 2:
            envelope, start_bytes = [frames[0]], frames[1]
        else:
            # answered all the same (the envelope as a REQ or a DEALER client sent it), so the
            # client learns at once rather than at its own timeout
            envelope = [frames[0], b""] if len(frames) > 1 and frames[1] == b"" else [frames[0]]
            why = f"{len(frames) - len(envelope)} frames after the envelope; send one: the start sequence"
            logger.warning("invalid KV event replay request: %s", why)
            send([*envelope, END_SEQ, f"invalid replay request: {why}".encode()])
            return
        if len(start_bytes) != 8:
            why = f"the start sequence is {len(start_bytes)} bytes, not 8 (big-endian)"
            logger.warning("invalid KV event replay request: %s", why)
            send([*envelope, END_SEQ, f"invalid replay request: {why}".encode()])
            return
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                send([*envelope, seq.to_bytes(8, "big"), payload])
        send([*envelope, END_SEQ, b""])


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher | None:
    """The publisher a config asks for; None when events do not leave the process."""
    if config is None or not config.publishes:
        return None
    if config.publisher == "zmq":
        if zmq is None or msgpack_missing():
            raise ImportError(
                "KV cache events (kv_events_config / --kv-events-config) need pyzmq and msgpack: "
                "pip install 'prefixkv[kv-events]'"
            )
        return ZmqEventPublisher(config, data_parallel_rank)
    raise ValueError(f"unknown event publisher {config.publisher!r}")  # config already refused it
