"""CPU-memory tier: bytes by key, bounded in bytes, least recently used evicted first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from .registry import TierBackend, register_backend
from .spec import TierSpec


class CPUStore:
    name = "cpu"
    fast = True

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the CPU tier needs a positive size, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.spec = f"cpu:{capacity_bytes / (1 << 30):g}GiB"
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self.used_bytes = 0
        self.num_evicted = 0
        self.on_evict: Callable[[bytes], None] | None = None  # the tier manager's: a KV event per eviction

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: bytes) -> bytes | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)  # a hit is a use
        return value

    def get_many(self, keys: Sequence[bytes], sizes: Sequence[int] | None = None) -> list[bytes | None]:
        # in memory, put only by this engine: nothing to bound
        return [self.get(k) for k in keys]

    def contains(self, key: bytes) -> bool:
        return key in self._values

    def put(self, key: bytes, value: bytes) -> None:
        size = len(value)
        if size > self.capacity_bytes:
            return  # larger than the whole tier: not kept
        old = self._values.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old)
        values = self._values
        while self.used_bytes + size > self.capacity_bytes:
            evicted_key, evicted = values.popitem(last=False)
            self.used_bytes -= len(evicted)
            self.num_evicted += 1
            if self.on_evict is not None:
                self.on_evict(evicted_key)
        values[key] = value
        self.used_bytes += size

    def close(self) -> None:
        self._values.clear()
        self.used_bytes = 0


register_backend(
    TierBackend(
        name="cpu",
        medium="CPU",  # vLLM's offloading connector's name for its CPU tier
        prefixes=(),  # sized by --kv-offloading-size, never a --kv-tier entry
        parse=lambda text: TierSpec("cpu", text),
        build=lambda spec: CPUStore(spec.size_bytes or 0),
    )
)
