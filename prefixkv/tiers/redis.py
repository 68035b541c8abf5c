"""Redis tier: values shared by every engine that points at the same Redis database.

Every call has a short socket timeout and no retries: a Redis that is down or slow raises at
once (or after the timeout), and the tier manager serves without it until it answers again.
The bound on memory is Redis's own (`maxmemory` with an LRU `maxmemory-policy`, set on the
server); keys are namespaced by the engine's cache identity (namespace.py), so a database shared
by several models or engines never mixes their blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .registry import TierBackend, register_backend
from .spec import TierSpec, parse_load_mode

DEFAULT_TIMEOUT_S = 0.5
KEY_PREFIX = b"prefixkv:"


class RedisStore:
    name = "redis"
    fast = False

    def __init__(self, url: str, timeout_s: float | None = None) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(
                f"the Redis KV tier {url!r} needs the redis package: pip install 'prefixkv[redis]'"
            ) from e

        parts = urlsplit(url)
        query = parse_qs(parts.query)
        if timeout_s is None:
            timeout_s = float(query.pop("timeout", [DEFAULT_TIMEOUT_S])[0])
        # `?load=sync`: looked up on the engine thread at admission (default async: docs/tiers.md)
        self.sync_load = parse_load_mode(query.pop("load", ["async"])[0], url)
        if query:
            raise ValueError(f"unknown option(s) {', '.join(query)} in the Redis tier {url!r} (known: timeout, load)")
        if timeout_s <= 0:
            raise ValueError(f"the Redis tier's timeout must be positive, got {timeout_s}")
        self.spec = url
        self.timeout_s = timeout_s
        clean = parts._replace(query="").geturl()
        self.client: Any = redis.Redis.from_url(
            clean,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )

    @staticmethod
    def _key(key: bytes) -> bytes:
        return KEY_PREFIX + key.hex().encode()

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self.client.get(self._key(key))
        return value

    def get_many(self, keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> list[bytes | None]:
        # `sizes` unused: MGET returns whole values (Redis bounds a string at 512 MB)
        if not keys:
            return []
        values: list[bytes | None] = self.client.mget([self._key(k) for k in keys])
        return values

    def contains(self, key: bytes) -> bool:
        return bool(self.client.exists(self._key(key)))

    def put(self, key: bytes, value: bytes) -> None:
        self.client.set(self._key(key), value)

    def close(self) -> None:
        self.client.close()


register_backend(
    TierBackend(
        name="redis",
        medium="REDIS",
        prefixes=("redis://", "rediss://", "unix://"),
        parse=lambda text: TierSpec("redis", text),  # the store parses its own URL when built
        build=lambda spec: RedisStore(spec.target),
        usage="redis://host:port/db[?timeout=0.5][&load=sync]",
    )
)
