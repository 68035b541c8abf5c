"""The adapters an engine knows and the ones resident on the device.

`register` loads and validates an adapter folder once; requests naming a loaded adapter use the
loaded weights and never look at the folder again (it may be gone). An explicit reload
(`register(..., reload=True)`: the server's load route, `LLM.generate`) reads the files again and
compares their content hash (sha256 of adapter_config.json + weights): new content means a new id
and a new digest, so the cache never serves the old adapter's KV under the new weights.

At most `max_loras` adapters are resident, in device slots, least recently used first out; the
scheduler never runs more than `max_loras` distinct adapters in one step, so `prepare` always
finds room. Requests name adapters by the engine id (`LoRAAdapter.id`, >= 1; 0 = base).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from ..model.config import ModelConfig
from ..model.llama import LlamaModel
from .adapter import TARGETS, LoRAAdapter, load_adapter, target_shapes
from .layers import FUSED, SLICE_COUNTS, LoRALinear, LoRAMapping, attach_lora
from .request import LoRARequest


class LoRAManager:
    def __init__(
        self,
        config: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.config = config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes = target_shapes(config)
        self._ids = itertools.count(1)
        self.adapters: dict[int, LoRAAdapter] = {}  # every live adapter by engine id
        self._by_key: dict[tuple[str, str], LoRAAdapter] = {}  # (name, path) -> latest version
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._unloads: dict[str, int] = {}  # name -> times removed: a reload starts a new cache identity
        self._layers: list[dict[str, LoRALinear]] = []
        # cache extra keys ("lora", name, path, digest) of versions that can never be hit again
        # (unloaded, or replaced by new weights): the engine evicts their blocks first
        self.retired: set[tuple[str, str, str, str]] = set()
        self.num_loads = 0  # adapters written into a device slot (for tests and metrics)

    def attach(self, model: LlamaModel) -> None:
        self._layers = attach_lora(model, self.shapes, self.max_loras, self.max_lora_rank, self.dtype, self.device)

    # -- the adapters known --------------------------------------------------------------------
    def register(self, request: LoRARequest, reload: bool = False) -> LoRAAdapter:
        """The loaded adapter of `request` (loaded now if new; with `reload`, read again and
        replaced when its files' content changed). Raises ValueError on anything it cannot serve
        exactly."""
        name, path = getattr(request, "lora_name", None), getattr(request, "lora_path", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRARequest needs a non-empty lora_name, got {request!r}")
        if not isinstance(path, str) or not path:
            raise ValueError(f"LoRA adapter {name!r}: lora_path is empty")
        known = self._by_key.get((name, path))
        if known is not None and not reload:
            return known  # the loaded weights: the folder is never looked at again
        adapter = load_adapter(name, path, self.config, self.max_lora_rank)
        if known is not None and known.digest == adapter.digest:
            return known  # same content
        if known is not None:  # new weights under the same name and path: the old KV is dead
            self.retired.add(self._cache_key(known))
        adapter.id = next(self._ids)
        self.adapters[adapter.id] = adapter
        self._by_key[(name, path)] = adapter
        return adapter

    def remove(self, name: str) -> bool:
        """Forget every adapter named `name` (requests already running keep theirs until they end:
        their slot is only reused once no scheduled request names it), and make the blocks cached
        under it unreachable (a later load of the same name gets a new cache identity; the old
        blocks age out of the free list). Returns whether any was known."""
        keys = [k for k in self._by_key if k[0] == name]
        for k in keys:
            self.retired.add(self._cache_key(self._by_key.pop(k)))
        if keys:  # blocks cached under the removed adapter are never hit again, even by a reload
            self._unloads[name] = self._unloads.get(name, 0) + 1
        return bool(keys)

    def forget_unused(self, in_use: set[int]) -> None:
        """Drop the host copies of adapters that are neither registered nor used by a request."""
        current = {a.id for a in self._by_key.values()}
        for aid in [a for a in self.adapters if a not in current and a not in in_use]:
            del self.adapters[aid]
            self._resident.pop(aid, None)

    def _cache_digest(self, adapter: LoRAAdapter) -> str:
        """The digest that enters the block key: the weights' digest, made new by every unload."""
        unloads = self._unloads.get(adapter.name, 0)
        return adapter.digest if not unloads else f"{adapter.digest}/unloaded-{unloads}"

    def _cache_key(self, adapter: LoRAAdapter) -> tuple[str, str, str, str]:
        return ("lora", adapter.name, adapter.path, self._cache_digest(adapter))

    def resolve(self, request: LoRARequest, reload: bool = False) -> tuple[LoRARequest, int]:
        """Register `request` and return it with its weights digest filled in, and the engine id."""
        from dataclasses import replace

        adapter = self.register(request, reload)
        return replace(request, weights_digest=self._cache_digest(adapter)), adapter.id

    # -- the adapters resident -----------------------------------------------------------------
    def prepare(self, segments: list[tuple[int, int]]) -> LoRAMapping | None:
        """segments: (adapter id or 0, number of tokens) in batch order -> the step's mapping, with
        every adapter named made resident (least recently used ones out)."""
        if not any(aid for aid, _ in segments):
            return None
        slots = self.slots_for([aid for aid, _ in segments])
        return LoRAMapping.from_segments(
            [(slot, n) for slot, (_, n) in zip(slots, segments)],
            self.device,
            self.max_loras,
            self.max_lora_rank,
            self.dtype,
            SLICE_COUNTS,
        )

    def slots_for(self, adapter_ids: list[int]) -> list[int]:
        """Each entry's device slot (-1 for 0, the base model), every adapter named made resident
        (least recently used ones out)."""
        ids = {aid for aid in adapter_ids if aid}
        if len(ids) > self.max_loras:
            raise RuntimeError(f"{len(ids)} adapters in one step, max_loras={self.max_loras}")
        slot_of = {aid: self._make_resident(aid, ids) for aid in ids}
        return [slot_of[aid] if aid else -1 for aid in adapter_ids]

    def _make_resident(self, aid: int, needed: set[int]) -> int:
        slot = self._resident.get(aid)
        if slot is not None:
            self._resident.move_to_end(aid)
            return slot
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(a for a in self._resident if a not in needed)
            slot = self._resident.pop(victim)
        self._load_slot(self.adapters[aid], slot)
        self._resident[aid] = slot
        return slot

    def _load_slot(self, adapter: LoRAAdapter, slot: int) -> None:
        for layer_index, layer in enumerate(self._layers):
            for fused, (targets, _) in FUSED.items():
                if fused not in layer:  # a mixture-of-experts MLP (layers.attach_lora)
                    continue
                pieces = []
                for t in targets:
                    w = adapter.weights.get((layer_index, t))
                    pieces.append(
                        None if w is None else (w[0].to(self.device, self.dtype), w[1].to(self.device, self.dtype))
                    )
                layer[fused].set_slot(slot, pieces)
        self.num_loads += 1

    @property
    def resident_ids(self) -> list[int]:
        return list(self._resident)


__all__ = ["TARGETS", "LoRAManager"]
