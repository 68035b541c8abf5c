"""A replayed mixed step's host tensors (engine/mixed_host_inputs.py): rows, sequences, block tables
and the tile map, checked against the same built token by token from the step's own lists; and the
token counts captured (cuda_graphs.mixed_capture_sizes)."""

from __future__ import annotations

import random

import pytest
import torch

from prefixkv.engine.cuda_graphs import MIXED_LADDER, mixed_capture_sizes
from prefixkv.engine.mixed_host_inputs import MixedHostBuffer, build_mixed, tile_map
from prefixkv.engine.scheduler_output import ScheduledRequest
from prefixkv.model.static_mixed import MixedLayout
from prefixkv.sampling_params import SamplingParams

BS, NULL_SLOT, PAD_SEQ = 4, 4 * 63, 9


def chunk(rid: str, tokens: list[int], start: int, table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, start, table, True, SamplingParams(), None, [], [])


def test_tile_map_names_each_sequences_tiles_in_order_then_the_padding_sequence():
    got = tile_map([5, 0, 1, 8, 9], 4, 9, PAD_SEQ)
    assert got.tolist() == [
        [0, 0, 2, 3, 3, 4, 4, 4, PAD_SEQ],  # 2 + 0 + 1 + 2 + 3 tiles of 4 tokens
        [0, 1, 0, 0, 1, 0, 1, 2, 0],
    ]
    with pytest.raises(ValueError, match="do not fit"):
        tile_map([5, 9], 4, 4, PAD_SEQ)


def test_a_mixed_step_built_against_its_requests_row_by_row():
    rng = random.Random(3)
    for _ in range(30):
        scheduled = []
        for i in range(rng.randrange(1, 6)):
            n = rng.choice([1, 1, rng.randrange(1, 14)])
            start = rng.randrange(0, 30)
            table = rng.sample(range(60), -(-(start + n) // BS) + rng.randrange(0, 2))  # a block ahead sometimes
            scheduled.append(chunk(f"r{i}", [rng.randrange(500) for _ in range(n)], start, table))
        total = sum(len(sr.token_ids) for sr in scheduled)
        size = total + rng.randrange(0, 5)
        tiles = size // 4 + len(scheduled)
        host = build_mixed(scheduled, size, tiles, 4, PAD_SEQ, BS, NULL_SLOT, max_blocks=16)
        ids, positions, slots, qsl = [], [], [], [0]
        for sr in scheduled:
            for j, t in enumerate(sr.token_ids):
                p = sr.start + j
                ids.append(t)
                positions.append(p)
                slots.append(sr.block_table[p // BS] * BS + p % BS)
            qsl.append(len(ids))
        pad = size - total
        assert host.tokens.tolist() == [ids + [0] * pad, positions + [0] * pad, slots + [NULL_SLOT] * pad]
        assert host.query_start_loc == qsl
        lens = [len(sr.token_ids) for sr in scheduled]
        assert host.seqs.tolist() == [qsl[:-1], lens, [sr.start + n for sr, n in zip(scheduled, lens)]]
        for row, sr in zip(host.tables.tolist(), scheduled):
            assert row[: len(sr.block_table)] == sr.block_table
        assert host.tile_map.tolist() == tile_map(lens, 4, tiles, PAD_SEQ).tolist()


def test_a_mixed_step_refuses_what_does_not_fit():
    ok = chunk("a", [1, 2], 6, [4, 5])
    with pytest.raises(ValueError, match="does not fit"):
        build_mixed([ok], 1, 4, 4, PAD_SEQ, BS, NULL_SLOT, max_blocks=16)
    with pytest.raises(IndexError, match="request b: position 9 lies past its 2 blocks"):
        build_mixed([ok, chunk("b", [1, 2], 8, [1, 2])], 8, 6, 4, PAD_SEQ, BS, NULL_SLOT, max_blocks=16)
    # a table longer than the buffers' width is cut: its blocks past the width hold no position
    cut = build_mixed([chunk("c", [7], 3, [8, 9, 10])], 4, 2, 4, PAD_SEQ, BS, NULL_SLOT, max_blocks=1)
    assert cut.tables.tolist() == [[8]]


def test_mixed_capture_sizes():
    full = {"cudagraph_mode": "FULL"}
    assert mixed_capture_sizes(2048, full) == list(MIXED_LADDER)
    assert mixed_capture_sizes(100, full) == [8, 16, 32, 48, 64, 96, 100]  # max_num_batched_tokens last
    assert mixed_capture_sizes(8192, full)[-1] == 2048
    assert mixed_capture_sizes(8192, {**full, "max_capture_size": 600})[-3:] == [384, 512, 600]
    assert mixed_capture_sizes(64, {**full, "cudagraph_capture_sizes": [128, 1, 32, 8]}) == [1, 8, 32]
    # whether mixed steps are captured at all is mixed_graph_choice.policy's (its own test)
    for other in (None, 3, {}, {"cudagraph_mode": "FULL_DECODE_ONLY"}):
        assert mixed_capture_sizes(2048, other) == list(MIXED_LADDER)


def test_the_host_buffers_span_holds_the_step_as_the_device_reads_it():
    """MixedHostBuffer lays a built step out as the device's buffers (MixedLayout): its span, copied
    alone into zeros, gives every view of that size the step's values - steps of several sizes one
    after another (their headers overlap), later sequences' entries zeros (no tokens)."""
    layout = MixedLayout(max_tokens=32, max_seqs=6, max_blocks=8, tile_tokens=4)
    buffer = MixedHostBuffer(layout)
    rng = random.Random(5)
    for size in (32, 8, 16, 8, 32):
        scheduled = []
        for i in range(rng.randrange(1, 5)):
            n = rng.randrange(1, size // 4 + 1)
            start = rng.randrange(0, 12)
            table = rng.sample(range(60), -(-(start + n) // BS))
            scheduled.append(chunk(f"r{i}", [rng.randrange(500) for _ in range(n)], start, table))
        step = build_mixed(scheduled, size, layout.tiles(size), 4, 6, BS, NULL_SLOT, max_blocks=8)
        lo, hi = buffer.fill(step, size)
        device = torch.zeros_like(buffer.flat)
        device[lo:hi] = buffer.flat[lo:hi]
        tokens, seqs, tiles, tables = layout.views(device, size)
        n, width = step.tables.shape
        assert torch.equal(tokens, step.tokens) and torch.equal(tiles, step.tile_map)
        assert torch.equal(seqs[:, :n], step.seqs) and not seqs[:, n:].any()
        assert torch.equal(tables[:n, :width], step.tables)
