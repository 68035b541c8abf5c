"""DecodeHostInputs: a replayed decode step's host tensors from a block-table mirror kept from step
to step. Checked against the same tensors built row by row from the step's own lists, over steps
where tables are carried over, replaced (a block added), and rows leave, arrive and move."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from prefixkv.engine.decode_host_inputs import DecodeHostInputs
from prefixkv.engine.scheduler_output import ScheduledRequest
from prefixkv.sampling_params import SamplingParams

BS, NULL_SLOT = 4, 4 * 63


def decode(rid: str, start: int, table: list[int], token: int = 7) -> ScheduledRequest:
    return ScheduledRequest(rid, [token], start, table, True, SamplingParams(), None, [], [])


def reference(scheduled: list[ScheduledRequest], size: int, ids_on_device: bool):
    b = len(scheduled)
    ids = [0 if ids_on_device else sr.token_ids[0] for sr in scheduled] + [0] * (size - b)
    positions = [sr.start for sr in scheduled] + [0] * (size - b)
    slots = [sr.block_table[p // BS] * BS + p % BS for sr, p in zip(scheduled, positions)] + [NULL_SLOT] * (size - b)
    lens = [p + 1 for p in positions[:b]] + [0] * (size - b)
    width = max(p // BS + 1 for p in positions[:b])
    tables = [sr.block_table[: p // BS + 1] for sr, p in zip(scheduled, positions)]
    return ids, positions, slots, lens, width, tables


def check(host: DecodeHostInputs, scheduled: list[ScheduledRequest], size: int, ids_on_device: bool) -> None:
    step = host.build(scheduled, size, ids_on_device)
    rows, lens, tables = step.rows, step.lens, step.tables
    ids, positions, slots, want_lens, width, want_tables = reference(scheduled, size, ids_on_device)
    assert rows.dtype == torch.long and lens.dtype == torch.int32 and tables.dtype == np.int32
    assert rows.tolist() == [ids, positions, slots] and lens.tolist() == want_lens
    assert tables.shape == (len(scheduled), width)
    for row, want in zip(tables.tolist(), want_tables):  # past a row's blocks: never read
        assert row[: len(want)] == want
    # the span holds the step whole, laid out as the device reads it
    lo, hi = step.span
    copied = torch.zeros_like(host.flat)
    copied[lo:hi] = host.flat[lo:hi]
    d_rows, d_lens, d_tables = host.layout.views(copied, size)
    assert d_rows.tolist() == rows.tolist() and d_lens.tolist() == lens.tolist()
    assert d_tables[: len(scheduled), :width].tolist() == tables.tolist()


@pytest.mark.parametrize("pinned", [False, True])
def test_steps_equal_the_row_by_row_build(pinned):
    """(`pinned`: page-locked, as on a GPU, where one is present.)"""
    if pinned and not torch.cuda.is_available():
        pytest.skip("page-locked memory needs CUDA")
    rng = random.Random(0)
    host = DecodeHostInputs(max_batch=16, max_blocks=8, block_size=BS, null_slot=NULL_SLOT, pinned=pinned)
    assert host.flat.is_pinned() == pinned
    free = iter(range(1, 10_000))
    running: dict[str, tuple[int, list[int]]] = {}  # request -> (position, its current table)
    for step in range(120):
        for rid in list(running):
            if rng.random() < 0.05 or running[rid][0] + 1 >= 8 * BS:  # past the buffers: not replayed
                del running[rid]  # finished: the rows after it move up
        while len(running) < 12 and rng.random() < 0.5:
            start = rng.randrange(0, 20)
            running[f"r{step}-{len(running)}"] = (start, [next(free) for _ in range(start // BS + 1)])
        for rid, (pos, table) in running.items():
            pos += 1
            if pos // BS >= len(table):  # a block added: the scheduler hands on a new list
                table = [*table, next(free)]
            running[rid] = (pos, table)
        order = list(running)
        if rng.random() < 0.1:
            rng.shuffle(order)
        scheduled = [decode(rid, *running[rid], token=step) for rid in order]
        if scheduled:
            size = next(s for s in (1, 2, 4, 8, 16) if s >= len(scheduled))
            check(host, scheduled, size, ids_on_device=rng.random() < 0.5)


def test_a_row_is_rewritten_only_when_its_table_is_a_new_list():
    host = DecodeHostInputs(max_batch=4, max_blocks=4, block_size=BS, null_slot=NULL_SLOT)
    table = [5, 6]
    host.build([decode("a", 4, table)], 1, False)
    host.tables[0, 0] = 99  # the mirror is not read back from the list while the list is the same
    rows = host.build([decode("a", 0, table)], 1, False).rows
    assert rows[2, 0] == 99 * BS
    rows = host.build([decode("a", 0, [5, 6])], 1, False).rows  # an equal but new list: rewritten
    assert rows[2, 0] == 5 * BS


def test_a_position_past_its_table_is_refused_by_name():
    host = DecodeHostInputs(max_batch=4, max_blocks=4, block_size=BS, null_slot=NULL_SLOT)
    with pytest.raises(IndexError, match="request b: position 8 lies past its 2 blocks"):
        host.build([decode("a", 3, [1]), decode("b", 8, [2, 3])], 2, False)


def test_blocks_past_the_buffers_width_are_left_out():
    host = DecodeHostInputs(max_batch=2, max_blocks=2, block_size=BS, null_slot=NULL_SLOT)
    step = host.build([decode("a", 5, [3, 4, 9])], 2, False)
    assert step.rows[2].tolist() == [4 * BS + 1, NULL_SLOT] and step.lens.tolist() == [6, 0]
    assert step.tables.tolist() == [[3, 4]] and np.array_equal(host.num_blocks[:1], [2])


def test_a_recurrent_models_rows_name_the_state_blocks():
    """For a recurrent model two more rows: the block holding position - 1's state to read (a row
    at a block's first position reads the block before; at position 0 any block, the device reads
    none), the slot's block to write, and the null block for padding; the first three rows as
    without."""
    host = DecodeHostInputs(max_batch=4, max_blocks=4, block_size=BS, null_slot=NULL_SLOT, recurrent=True)
    scheduled = [decode("a", 5, [3, 6]), decode("b", 4, [2, 9]), decode("c", 0, [5])]
    step = host.build(scheduled, 4, False)
    rows, lens = step.rows, step.lens
    assert tuple(rows.shape) == (5, 4)
    r = rows.numpy()
    np.testing.assert_array_equal(r[3, :3], [6, 2, 5])
    np.testing.assert_array_equal(r[4], [6, 9, 5, NULL_SLOT // BS])
    plain = DecodeHostInputs(max_batch=4, max_blocks=4, block_size=BS, null_slot=NULL_SLOT)
    assert plain.build(scheduled, 4, False).rows.tolist() == rows[:3].tolist()
    assert lens.tolist() == [6, 5, 1, 0]


@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize("ids_on_device", [False, True])
def test_a_batch_of_one_writes_what_a_batch_of_two_writes_for_its_row(recurrent, ids_on_device):
    """A step of one request takes scalar writes: its row equals that request's row in a step of
    two (the vector path), at a block's first, middle and last positions, padded or not."""
    for pos in (0, 3, 4, 5, 7, 8):
        table = [9, 4, 7]
        one = DecodeHostInputs(max_batch=4, max_blocks=4, block_size=BS, null_slot=NULL_SLOT, recurrent=recurrent)
        two = DecodeHostInputs(max_batch=4, max_blocks=4, block_size=BS, null_slot=NULL_SLOT, recurrent=recurrent)
        for size in (1, 2):
            a = one.build([decode("a", pos, table, token=11)], size, ids_on_device)
            b = two.build([decode("a", pos, table, token=11), decode("b", 2, [5])], 2, ids_on_device)
            assert a.rows[:, 0].tolist() == b.rows[:, 0].tolist() and a.lens[0] == b.lens[0]
            assert a.tables.tolist() == [table[: pos // BS + 1]]
            if size == 2:  # the padding row
                assert a.rows[:, 1].tolist() == [0, 0, NULL_SLOT, 0, NULL_SLOT // BS][: a.rows.shape[0]]
                assert a.lens[1] == 0
    with pytest.raises(IndexError, match="request a: position 12 lies past its 3 blocks"):
        one.build([decode("a", 12, [9, 4, 7])], 1, False)
