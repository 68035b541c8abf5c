"""The typed plans that cross between the two halves of the KV connector (connector.py), one layer
below the engine so that its SchedulerOutput and ModelRunnerOutput can carry them: loads and
saves go from the scheduler half down to the worker half in the SchedulerOutput, and the values a
save produced come back up in the ModelRunnerOutput."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import BlockStored


@dataclass(slots=True)
class KVLoad:
    """Copy these (checked) KV bytes into block `block_id` before this step's forward."""

    block_id: int
    kv: memoryview


@dataclass(slots=True)
class KVSave:
    """Copy block `block_id` out after this step's forward and store it under `key`."""

    block_id: int
    key: bytes
    head: bytes  # value header (value.encode_header)
    event: BlockStored | None = None  # with KV events on: the block's event, published per tier once stored
    # (request id, block index) of a block whose last token was still being sampled when the step
    # was planned (async scheduling): no hash, so no key or header yet. The worker half returns
    # its bytes unsealed, and the scheduler half keys and seals them when the step is booked
    owner: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class SavedBlock:
    """What the worker half made of a KVSave: the whole value (header, KV bytes, checksum, MAC),
    for the scheduler half to put in its tiers; for a save with an `owner`, the block's KV bytes
    alone."""

    save: KVSave
    value: bytes
