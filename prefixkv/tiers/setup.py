"""Builds the tiers an engine was configured with and plugs them into its scheduler and runner."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .cpu import CPUStore
from .disk import DEFAULT_DISK_BYTES, DiskStore
from .manager import TierManager
from .namespace import config_digest, secret_key_tag, tier_namespace, tokenizer_digest, weights_digest
from .spec import parse_spec, split_specs
from .store import KVStore
from .transfer import BlockTransfer, block_nbytes

if TYPE_CHECKING:
    from ..engine.llm_engine import LLMEngine

logger = logging.getLogger("prefixkv")


def build_stores(kv_offloading_size: float | None, kv_tier: object) -> list[KVStore]:
    """CPU first (fastest), then the --kv-tier entries in the order given. A disk or Redis tier
    that cannot be reached now is still built: it is tried again later (the engine serves)."""
    stores: list[KVStore] = []
    if kv_offloading_size:
        stores.append(CPUStore(int(kv_offloading_size * (1 << 30))))
    for text in split_specs(kv_tier):  # type: ignore[arg-type]
        spec = parse_spec(text)
        if spec.kind == "disk":
            stores.append(_disk(spec.target, spec.size_bytes, spec.sync_load))
        else:
            from .redis import RedisStore

            stores.append(RedisStore(spec.target))
    return stores


def _disk(path: str, size: int | None, sync_load: bool) -> KVStore:
    try:
        return DiskStore(path, size or DEFAULT_DISK_BYTES, sync_load)
    except OSError as e:
        logger.warning("KV tier disk:%s cannot be used (%s); serving without it", path, e)
        return _Unusable("disk", f"disk:{path}", e)


class _Unusable:
    """A tier whose folder could not be created: every call fails, so the manager counts the error,
    warns once, and backs off (the engine serves by recomputing)."""

    fast = False

    def __init__(self, name: str, spec: str, error: OSError) -> None:
        self.name, self.spec, self.error = name, spec, error

    def get(self, key: bytes) -> bytes | None:
        raise self.error

    def get_many(self, keys: object, sizes: object = None) -> list[bytes | None]:
        raise self.error

    def put(self, key: bytes, value: bytes) -> None:
        raise self.error

    def contains(self, key: bytes) -> bool:
        raise self.error

    def close(self) -> None:
        pass


def attach_tiers(engine: LLMEngine) -> TierManager:
    config = engine.config
    stores = build_stores(config.kv_offloading_size, config.kv_tier)
    kv = engine.scheduler.kv_cache_manager
    block_tensors = engine.block_tensors
    caches = block_tensors.kv_caches
    block_dim = next(s.block_dim for n, s in block_tensors.specs.items() if n.startswith("kv."))
    parts = [(c, block_dim) for c in caches]
    if engine.stage_outputs is not None:  # a block's stage outputs travel with its KV (transfer.py)
        stage_names = sorted(n for n in block_tensors.specs if n.startswith("stage."))
        parts += [(block_tensors.ensure(n), block_tensors.specs[n].block_dim) for n in stage_names]
    # the value layout (so whether stage outputs travel) is part of the cache identity
    layout = [(tuple(t.select(dim, 0).shape), str(t.dtype)) for t, dim in parts]
    loaded = engine.loaded
    mm = loaded.multimodal  # a vision-language model: its encoder and preprocessing decide image rows
    secret = config.tier_secret_bytes()  # never logged: the log says only whether there is one
    vision = (mm.encoder, mm.config, mm.processor) if mm is not None else (None, None, None)
    namespace = tier_namespace(
        weights=weights_digest(loaded.model, vision[0]),
        config=config_digest(loaded.config, vision[1], vision[2]),
        dtype=str(engine.dtype),
        tokenizer=tokenizer_digest(engine.tokenizer),
        kv_layout=layout,
        block_size=config.block_size,
        device_type=engine.device.type,
        root_hash=kv.none_hash,
        secret_tag=secret_key_tag(secret) if secret is not None else None,
    )
    transfer_nbytes = block_nbytes(parts)
    tiers = TierManager(stores, namespace, transfer_nbytes, secret=secret)
    if kv.block_pool.events is not None:  # KV events on: the tiers publish theirs too (medium CPU/DISK/REDIS)
        tiers.enable_events()
    engine.scheduler.tiers = tiers
    tiers.carries_stage_outputs = engine.stage_outputs is not None
    engine.runner.kv_transfer = BlockTransfer(parts, tiers)
    logger.info(
        "KV tiers: %s%s",
        ", ".join(t.spec for t in tiers.tiers),
        " (values authenticated: HMAC-SHA256 under the tier secret)" if secret is not None else "",
    )
    return tiers
