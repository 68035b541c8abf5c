"""KV cache events leaving the process: vLLM's KVEventsConfig, wire format and ZeroMQ publisher.

config.py     KVEventsConfig (vLLM's fields and defaults), parsed from JSON / dict, strict
wire.py       cache events -> vLLM's msgpack EventBatch (tagged maps, external block hashes)
publisher.py  ZmqEventPublisher: bounded queue, publisher thread, PUB + replay ROUTER sockets
docs/kv_events.md has the protocol and a subscriber.
"""

from .config import PUBLISHERS, KVEventsConfig
from .publisher import EventPublisher, ZmqEventPublisher, create_publisher
from .wire import encode_batch, event_to_wire, to_int_hash

__all__ = [
    "PUBLISHERS",
    "EventPublisher",
    "KVEventsConfig",
    "ZmqEventPublisher",
    "create_publisher",
    "encode_batch",
    "event_to_wire",
    "to_int_hash",
]
