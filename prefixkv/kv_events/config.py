"""KVEventsConfig: where and how KV cache events are published, vLLM's fields and defaults.

`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"topic": "kv-events"}'` on the command line, `LLM(kv_events_config={...})` offline. Unknown keys and
publishers are refused by name (a typo would otherwise publish nothing, silently).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False  # record BlockStored / BlockRemoved / AllBlocksCleared
    publisher: str | None = None  # "null" or "zmq"; None: "zmq" when events are on, else "null"
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has '*', '::', ipc:// or inproc://, else connected
    replay_endpoint: str | None = None  # ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches (one per engine step) kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket: beyond it ZeroMQ drops for that subscriber
    max_queue_size: int = 100_000  # batches waiting for the publisher thread: beyond it new ones are dropped
    topic: str = ""  # first frame of every message; subscribers filter on its prefix

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv_events_config: enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config: unknown event publisher {self.publisher!r}; choose one of {', '.join(PUBLISHERS)}"
            )
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config: {name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(
                f"kv_events_config: replay_endpoint must be a string or null, got {self.replay_endpoint!r}"
            )
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"kv_events_config: {name} must be an integer >= {low}, got {value!r}")
        if self.publisher == "zmq" and not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"kv_events_config: endpoint {self.endpoint!r} is not a tcp://, ipc:// or inproc:// address"
            )

    @property
    def publishes(self) -> bool:
        """Whether events leave the process (events on and a publisher other than null)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """A config from itself, a dict, or its JSON text (the CLI flag); None stays None."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}"
            )
        return cls(**value)
