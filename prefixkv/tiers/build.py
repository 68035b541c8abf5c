"""Builds an engine's KV connector: both halves from its options, its per-block tensors and its
model's identity - the null ones when no tier is configured."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..memory.block_tensors import KV_PREFIX
from ..model import LoadedModel
from ..stage_outputs.specs import STAGE_PREFIX  # a block's stage-output rows travel with its KV
from .connector import SchedulerConnector, WorkerConnector
from .manager import TierManager
from .namespace import config_digest, secret_key_tag, tier_namespace, tokenizer_digest, weights_digest
from .null import NULL_SCHEDULER_CONNECTOR, NULL_WORKER_CONNECTOR
from .registry import build_stores
from .scheduler_connector import TierSchedulerConnector
from .transfer import BlockTransfer, block_nbytes

logger = logging.getLogger("prefixkv")


class TierOptions(Protocol):
    """The engine options the tiers read (EngineArgs)."""

    @property
    def kv_offloading_size(self) -> float | None: ...

    @property
    def kv_tier(self) -> str | Sequence[str] | None: ...

    @property
    def block_size(self) -> int: ...

    @property
    def enable_kv_cache_events(self) -> bool: ...

    @property
    def enable_stage_output_cache(self) -> bool: ...

    def tier_secret_bytes(self) -> bytes | None: ...


class BlockSlots(Protocol):
    """The engine's per-block tensors (BlockTensors), allocated."""

    @property
    def specs(self) -> Mapping[str, Any]: ...

    @property
    def kv_caches(self) -> list[torch.Tensor]: ...

    def ensure(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class KVConnector:
    scheduler: SchedulerConnector  # for the Scheduler's constructor
    worker: WorkerConnector  # for the ModelRunner's constructor
    manager: TierManager | None  # the tiers themselves (flush, close, namespace); None without tiers


NULL_CONNECTOR = KVConnector(NULL_SCHEDULER_CONNECTOR, NULL_WORKER_CONNECTOR, None)


def build_kv_connector(
    options: TierOptions,
    block_tensors: BlockSlots,
    loaded: LoadedModel,
    tokenizer: Any,
    *,
    dtype: torch.dtype,
    device: torch.device,
    root_hash: bytes,
) -> KVConnector:
    """`root_hash`: the NONE_HASH of the scheduler's KV cache manager (its hash function and seed
    are part of the cache identity). `tokenizer`: the engine's (it may not be the model's)."""
    if not (options.kv_offloading_size or options.kv_tier):
        return NULL_CONNECTOR
    stores = build_stores(options.kv_offloading_size, options.kv_tier)
    specs = block_tensors.specs
    block_dim = next(s.block_dim for n, s in specs.items() if n.startswith(KV_PREFIX))
    parts = [(c, block_dim) for c in block_tensors.kv_caches]
    stage = options.enable_stage_output_cache
    stage_names = sorted(n for n in specs if n.startswith(STAGE_PREFIX)) if stage else []
    # its rows are written when a step is booked (stage_outputs/store.py), and move then
    parts += [(block_tensors.ensure(n), specs[n].block_dim) for n in stage_names]
    # the value layout (so whether stage outputs travel) is part of the cache identity
    layout = [(tuple(t.select(dim, 0).shape), str(t.dtype)) for t, dim in parts]
    mm = loaded.multimodal  # a vision-language model: its encoder and preprocessing decide image rows
    secret = options.tier_secret_bytes()  # never logged: the log says only whether there is one
    vision = (mm.encoder, mm.config, mm.processor) if mm is not None else (None, None, None)
    namespace = tier_namespace(
        weights=weights_digest(loaded.model, vision[0]),
        config=config_digest(loaded.config, vision[1], vision[2]),
        dtype=str(dtype),
        tokenizer=tokenizer_digest(tokenizer),
        kv_layout=layout,
        block_size=options.block_size,
        device_type=device.type,
        root_hash=root_hash,
        secret_tag=secret_key_tag(secret) if secret is not None else None,
    )
    manager = TierManager(
        stores,
        namespace,
        block_nbytes(parts),
        secret=secret,
        kv_events=options.enable_kv_cache_events,  # the tiers publish theirs too (their own medium)
        carries_stage_outputs=stage,
    )
    logger.info(
        "KV tiers: %s%s",
        ", ".join(t.spec for t in manager.tiers),
        " (values authenticated: HMAC-SHA256 under the tier secret)" if secret is not None else "",
    )
    return KVConnector(
        TierSchedulerConnector(manager, options.block_size),
        BlockTransfer(parts, secret=secret, booked=len(stage_names)),
        manager,
    )
