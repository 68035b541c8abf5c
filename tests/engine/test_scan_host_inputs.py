"""A recurrent model's replayed mixed step, its scan's host half (engine/scan_host_inputs.py): the
segments, chains and conv windows checked against the same built position by position from the
step's own lists, the bound on segments (model/static_scan.segments_for) at its worst case, and
which steps must run eagerly."""

from __future__ import annotations

import random

from prefixkv.engine.scan_host_inputs import build_scan
from prefixkv.engine.scheduler_output import ScheduledRequest
from prefixkv.model.static_scan import segments_for
from prefixkv.sampling_params import SamplingParams

BS, K, NULL_BLOCK, MAX_SEQS = 4, 4, 63, 6


def chunk(rid: str, n: int, start: int, table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, [1] * n, start, table, True, SamplingParams(), None, [], [])


def test_segments_chains_and_conv_windows_against_the_requests_position_by_position():
    rng = random.Random(5)
    for _ in range(60):
        scheduled, qsl = [], [0]
        for i in range(rng.randrange(1, MAX_SEQS + 1)):
            n = rng.choice([1, BS + 2, rng.randrange(1, 15)])
            start = rng.choice([0, BS - 1, rng.randrange(0, 30)])
            table = rng.sample(range(20 * i, 20 * i + 20), -(-(start + n) // BS))  # no block shared
            scheduled.append(chunk(f"r{i}", n, start, table))
            qsl.append(qsl[-1] + n)
        size = qsl[-1] + rng.randrange(0, 5)
        segments = segments_for(size, MAX_SEQS, BS)
        plan = build_scan(scheduled, qsl, size, segments, MAX_SEQS, BS, K, NULL_BLOCK)
        pad, blocks, out = plan.pad_index.tolist(), plan.seg_blocks.tolist(), plan.out_index.tolist()
        chains, chain_len = plan.chains.tolist(), plan.chain_len.tolist()
        rows, ends = plan.conv_rows.tolist(), plan.conv_ends.tolist()
        zero_row = size + (MAX_SEQS + 1) * (K - 1)
        used = set()
        for r, sr in enumerate(scheduled):
            n, q0 = len(sr.token_ids), qsl[r]

            def source(local: int, r: int = r, q0: int = q0, size: int = size) -> int:  # the conv table's row
                return q0 + local if local >= 0 else size + r * (K - 1) + (K - 1 + local)

            assert plan.states[:, r].tolist() == ([sr.block_table[(sr.start - 1) // BS], 1] if sr.start else [0, 0])
            segs = chains[r][: chain_len[r]]
            covered = []
            for s in segs:
                seg_rows = [row for row in pad[s] if row != size]
                positions = [sr.start + row - q0 for row in seg_rows]
                assert len({p // BS for p in positions}) == 1  # one block a segment
                assert blocks[s] == sr.block_table[positions[0] // BS]
                local_end = positions[-1] + 1 - sr.start
                assert ends[s] == [source(local_end - K + 1 + j) for j in range(K - 1)]
                covered += seg_rows
                used.add(s)
            assert covered == list(range(q0, q0 + n))  # every row once, in order
            for i in range(n):
                assert [pad[out[q0 + i] // BS][out[q0 + i] % BS]] == [q0 + i]
                assert rows[q0 + i] == [source(i - K + 1 + k) for k in range(K)]
        for s in set(range(segments)) - used:  # padding segments: the zero row, the null block
            assert pad[s] == [size] * BS and blocks[s] == NULL_BLOCK
        for row in range(qsl[-1], size):
            assert rows[row] == [zero_row] * K


def test_the_bound_on_segments_holds_at_its_worst():
    # every request touching as many blocks as its tokens allow: block_size + 2 tokens from a block's last position
    for requests in range(1, MAX_SEQS + 1):
        scheduled = [chunk(f"r{i}", BS + 2, BS - 1, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(requests)]
        size = requests * (BS + 2)
        qsl = [i * (BS + 2) for i in range(requests + 1)]
        segments = segments_for(size, MAX_SEQS, BS)
        plan = build_scan(scheduled, qsl, size, segments, MAX_SEQS, BS, K, NULL_BLOCK)
        assert plan.chain_len.tolist()[:requests] == [3] * requests
        assert 3 * requests <= segments
    assert segments_for(5, 8, 4) == 5  # never more segments than tokens


def test_a_request_continuing_from_a_block_another_writes_first_walks_its_writers_chain():
    # a: 10 new tokens from 0 over blocks 10, 11, 12 (no state before); b: a hit on a's first two
    # blocks, 4 new tokens from 8 into block 13; c: a hit on b's block 13 (b's own, not a's), one
    # token from 12 into block 14; d: continues from its block 20, which no one writes here
    a = chunk("a", 10, 0, [10, 11, 12])
    b = chunk("b", 4, 8, [10, 11, 13])
    c = chunk("c", 1, 12, [10, 11, 13, 14])
    d = chunk("d", 2, 4, [20, 21])
    scheduled = [a, b, c, d]
    qsl = [0, 10, 14, 15, 17]
    size = 18
    segments = segments_for(size, MAX_SEQS, BS)
    plan = build_scan(scheduled, qsl, size, segments, MAX_SEQS, BS, K, NULL_BLOCK)
    chains, lens = plan.chains.tolist(), plan.chain_len.tolist()
    assert plan.seg_blocks.tolist()[:6] == [10, 11, 12, 13, 14, 21]
    assert [chains[r][: lens[r]] for r in range(4)] == [[0, 1, 2], [0, 1, 3], [0, 1, 3, 4], [5]]
    assert plan.states[:, :4].tolist() == [[0, 0, 0, 20], [0, 0, 0, 1]]  # b and c start from a's state: none
    ends = plan.conv_ends.tolist()
    # b's inputs before its chunk: a's rows 5-7 (segment 1's last three); c's: b's rows 11-13
    assert plan.conv_rows.tolist()[10] == [5, 6, 7, 10] and ends[1] == [5, 6, 7]
    assert ends[3] == [11, 12, 13] and plan.conv_rows.tolist()[14] == [11, 12, 13, 14]
    d_state = size + 3 * (K - 1)  # d reads its own state's columns
    assert plan.conv_rows.tolist()[15] == [d_state, d_state + 1, d_state + 2, 15]
