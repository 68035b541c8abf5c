"""StageOutputCache on a real KVCacheManager: rows are readable only while their block keeps the
identity it had when they were written - eviction and reuse make them unreadable at once."""

from __future__ import annotations

import pytest
import torch

from prefixkv.cache import KVCacheManager
from prefixkv.memory.block_tensors import BlockTensors, BlockTensorSpec
from prefixkv.request import Request
from prefixkv.stage_outputs import StageOutputCache
from prefixkv.stage_outputs.specs import HIDDEN_STATES, spec_name

BS, D = 2, 3


def make(num_blocks: int):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    spec = BlockTensorSpec(spec_name(HIDDEN_STATES, torch.float32), (BS, D), torch.float32, 0, "cpu", lazy=True)
    tensors = BlockTensors([spec])
    assert tensors.bytes_per_block == BS * D * 4  # counted in the budget before it exists
    tensors.allocate(num_blocks, "cpu")
    assert not tensors.tensors  # lazy: allocated on first write
    return kv, StageOutputCache(tensors, kv.block_pool.blocks, BS)


def compute(kv, stage, req, allocate=True):
    """Allocate and 'compute' a whole request: rows = position + 100 * first token."""
    if allocate:
        assert kv.allocate_slots(req, req.num_tokens) is not None
    table = kv.get_block_ids(req.request_id)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(req.num_tokens)])
    rows = torch.tensor([[p + 100.0 * req.all_token_ids[0]] * D for p in range(req.num_tokens)])
    stage.write({HIDDEN_STATES: rows}, slots)
    stage.commit(table[: req.num_tokens // BS])
    return table


def test_rows_valid_while_cached_and_gone_after_eviction_and_reuse():
    kv, stage = make(3)
    a = Request("a", [1, 2, 3, 4, 5])  # two full blocks and a partial one
    table = compute(kv, stage, a)
    assert [stage.is_valid(b) for b in table] == [True, True, False]  # only full blocks
    rows = stage.read(table[:2], torch.float32)
    assert rows[:, 0].tolist() == [100.0, 101.0, 102.0, 103.0]
    kv.free(a)  # freed blocks keep their identity: still readable
    assert stage.is_valid(table[0]) and stage.is_valid(table[1])
    b = Request("b", [7, 8, 9, 10, 11])  # needs every block: a's cached blocks are evicted and reused
    assert kv.allocate_slots(b, 5) is not None
    assert not any(stage.is_valid(bid) for bid in table)  # before anything was written into them
    with pytest.raises(RuntimeError, match="not valid"):
        stage.read(table[:2], torch.float32)
    table_b = compute(kv, stage, b, allocate=False)
    assert stage.read(table_b[:2], torch.float32)[:, 0].tolist() == [700.0, 701.0, 702.0, 703.0]
    kv.free(b)
    again = Request("a2", [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(again)
    assert hits == [] and n == 0  # a's identity is gone with its rows


def test_reset_prefix_cache_invalidates_every_row():
    kv, stage = make(4)
    a = Request("a", [1, 2, 3, 4, 5])
    table = compute(kv, stage, a)
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert not any(stage.is_valid(b) for b in table)
    b = Request("b", [1, 2, 3, 4, 5])  # the same tokens again: new identity numbers, nothing stale
    assert kv.get_computed_blocks(b)[0] == []
    assert kv.allocate_slots(b, 5) is not None
    assert not any(stage.is_valid(bid) for bid in kv.get_block_ids("b"))


def test_hits_on_valid_blocks_read_back_what_was_written():
    kv, stage = make(8)
    a = Request("a", [1, 2, 3, 4, 5])
    compute(kv, stage, a)
    b = Request("b", [1, 2, 3, 4, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and stage.num_valid_prefix(hits) == 2
    assert stage.read([h.block_id for h in hits], torch.float32)[:, 0].tolist() == [100.0, 101.0, 102.0, 103.0]


def test_undeclared_output_is_refused_by_name():
    kv, stage = make(2)
    with pytest.raises(ValueError, match="'logits_aux'.*not declared"):
        stage.write({"logits_aux": torch.zeros(2, 4)}, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="not declared"):  # the declared name in another dtype
        stage.write({HIDDEN_STATES: torch.zeros(2, D, dtype=torch.float64)}, torch.tensor([0, 1]))
