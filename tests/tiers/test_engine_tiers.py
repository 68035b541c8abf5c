"""Engines with tiers on a tiny random Llama. Oracle: greedy float32 outputs with blocks loaded
from a tier equal outputs computed from scratch (prefix caching off), and every block is free
after the requests finish."""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
import subprocess

import pytest

from prefixkv.request import Request
from prefixkv.sampling_params import SamplingParams
from prefixkv.tiers import build as tier_build
from prefixkv.tiers.transfer import BlockTransfer

from .conftest import BLOCK, all_free, engine, make_tiny, run, tier

N_PROMPT = 40  # 10 blocks of 4; (40 - 1) // 4 = 9 blocks may be hits


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(N_PROMPT)] for _ in range(n)]


@pytest.fixture(scope="module")
def cases(tiny_model, tiny_loaded):
    """Five unrelated prompts and their outputs computed from scratch."""
    ps = prompts(1, 5)
    ref = engine(tiny_model, tiny_loaded, enable_prefix_caching=False)
    return ps, [run(ref, p)[0] for p in ps]


def thrash(eng, ps, refs):
    """B, C, D, E: 48 blocks through a 32-block pool, so nothing of A survives in it."""
    for p, r in zip(ps[1:], refs[1:]):
        assert run(eng, p)[0] == r


def test_cpu_tier_hit_after_the_pool_thrashed(tiny_model, tiny_loaded, cases):
    ps, refs = cases
    eng = engine(tiny_model, tiny_loaded, kv_offloading_size=0.01)
    assert run(eng, ps[0]) == (refs[0], 0)
    thrash(eng, ps, refs)
    assert _pool_hit_tokens(eng, ps[0]) == 0  # nothing of A is left in the pool
    tokens, cached = run(eng, ps[0])
    assert (tokens, cached) == (refs[0], 36)  # every block that may be a hit came from the CPU tier
    cpu = tier(eng, "cpu")
    assert cpu.hits >= 9 and cpu.bytes_loaded > 0 and cpu.saves >= 5 * 11 and cpu.errors == 0
    stats = eng.get_stats()
    assert stats.external_prefix_cache_hits == 36 and stats.external_prefix_cache_queries == 6 * N_PROMPT
    assert all_free(eng)


@pytest.mark.parametrize(("max_tokens", "through_host"), [(6, False), (9, False), (9, True)])
def test_steps_scheduled_ahead_save_and_load_as_steps_in_order(
    tiny_model, tiny_loaded, cases, max_tokens, through_host, monkeypatch
):
    """Async scheduling (a GPU's default) with a CPU tier: a decode scheduled ahead completes a
    block before its last token is known; the block is copied out after that step all the same
    and keyed when the step is booked. Five requests at once (9 tokens: each one's last step
    completes a block), then the pool thrashed and the first asked again: the same outputs, the
    same blocks saved and the same hits as in order; steps ran ahead; every block free.
    `through_host`: the copies take a GPU's path (sealed when the step is booked)."""
    if through_host:
        monkeypatch.setattr(tier_build, "BlockTransfer", functools.partial(BlockTransfer, through_host=True))
    ps, _ = cases
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def serve(async_scheduling: bool) -> tuple:
        eng = engine(tiny_model, tiny_loaded, kv_offloading_size=0.01, async_scheduling=async_scheduling)
        assert eng.runner.kv_connector._through_host == through_host
        ids = [eng.add_request(p, greedy) for p in ps]
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        cpu = tier(eng, "cpu")
        saved = (cpu.saves, cpu.bytes_saved, cpu.errors)
        for p in ps[1:]:  # the pool thrashed: what comes back of the first prompt comes from the tier
            run(eng, p)
        again = run(eng, ps[0])
        assert all_free(eng)
        return [done[i] for i in ids], saved, again, eng.num_steps_ahead

    want = serve(False)
    got = serve(True)
    assert got[:3] == want[:3]
    assert want[1][0] == 5 * ((N_PROMPT + max_tokens - 1) // BLOCK)  # every completed block, once
    assert got[2][1] == want[2][1] > 0 and got[3] > 0 and want[3] == 0


def _probe(prompt):
    return Request("probe", prompt, sampling_params=SamplingParams())


def _pool_hit_tokens(eng, prompt) -> int:
    kv = eng.scheduler.kv_cache_manager
    req = _probe(prompt)
    n = kv.get_computed_blocks(req, record_stats=False)[1]
    kv.free(req)
    return n


def test_disk_tier_survives_a_new_engine_and_refuses_foreign_or_corrupt_values(
    tiny_model, tiny_loaded, cases, tmp_path
):
    ps, refs = cases
    folder = tmp_path / "kv"
    first = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    assert run(first, ps[0]) == (refs[0], 0)
    assert run(first, ps[1]) == (refs[1], 0)
    first.tiers.flush()
    assert tier(first, "disk").saves == 2 * 11

    # a new engine (a restart): its first request of a known prefix is served from the disk tier
    second = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    assert run(second, ps[0]) == (refs[0], 36)
    assert tier(second, "disk").hits == 9 and all_free(second)

    # another model (other weights) sharing the folder never finds these blocks
    other_dir = make_tiny(tmp_path / "other", seed=1)
    from prefixkv.model import load_model

    other = engine(other_dir, load_model(other_dir), kv_tier=f"disk:{folder}")
    expected = run(engine(other_dir, other.loaded, enable_prefix_caching=False), ps[1])[0]
    assert run(other, ps[1]) == (expected, 0)
    assert tier(other, "disk").hits == 0

    # one flipped byte in the KV of prompt 1's block 3, and prompt 0's block 5 stored under the key
    # of its block 2 (a value that is not the block asked for): each chain stops at the refused block
    third = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    keys1 = [third.tiers.key(h).hex() + ".kv" for h in _hashes(third, ps[1])]
    keys0 = [third.tiers.key(h).hex() + ".kv" for h in _hashes(third, ps[0])]
    assert set(keys1 + keys0) <= set(os.listdir(folder))
    data = bytearray((folder / keys1[3]).read_bytes())
    data[len(data) // 2] ^= 1
    (folder / keys1[3]).write_bytes(bytes(data))
    shutil.copy(folder / keys0[5], folder / keys0[2])
    assert run(third, ps[1]) == (refs[1], 12)
    assert run(third, ps[0]) == (refs[0], 8)
    disk = tier(third, "disk")
    assert disk.rejected == 2 and disk.hits == 3 + 2
    assert all_free(third)


def _hashes(eng, prompt):
    kv = eng.scheduler.kv_cache_manager
    req = _probe(prompt)
    hashes = kv.get_block_hashes(req)
    kv.free(req)
    return hashes[: (len(prompt) - 1) // 4]


def test_unwritable_disk_tier_serves_by_recomputing(tiny_model, tiny_loaded, cases, tmp_path, caplog):
    ps, refs = cases
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    caplog.set_level(logging.WARNING, logger="prefixkv")
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{blocker}/kv")  # cannot be created, even as root
    assert run(eng, ps[0]) == (refs[0], 0)
    eng.tiers.flush()
    assert tier(eng, "disk").errors >= 1 and not tier(eng, "disk").available
    assert "cannot be used" in caplog.text

    # a tier that stops accepting writes mid-run (its folder replaced by a file): same
    folder = tmp_path / "kv"
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}", kv_offloading_size=0.01)
    assert run(eng, ps[0]) == (refs[0], 0)
    eng.tiers.flush()
    shutil.rmtree(folder)
    folder.write_text("the disk is gone")
    caplog.clear()
    for p, r in zip(ps[1:], refs[1:]):
        assert run(eng, p)[0] == r
    eng.tiers.flush()
    assert tier(eng, "disk").errors >= 1 and "failed" in caplog.text
    assert run(eng, ps[0]) == (refs[0], 36)  # the CPU tier still serves
    assert all_free(eng)


def test_full_disk_serves_by_recomputing(tiny_model, tiny_loaded, cases, tmp_path, caplog):
    """A real full file system (a 16 KiB tmpfs: room for 4 of the 11 values of a prompt): the
    writes that do not fit fail with ENOSPC, the tier warns, counts and backs off, and every
    request is still served, equal to computing from scratch."""
    ps, refs = cases
    folder = tmp_path / "small"
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(folder)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"a small tmpfs cannot be mounted here (needs CAP_SYS_ADMIN): {mount.stderr.decode()[:200]}")
    try:
        caplog.set_level(logging.WARNING, logger="prefixkv")
        eng = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
        assert run(eng, ps[0]) == (refs[0], 0)
        eng.tiers.flush()
        disk = tier(eng, "disk")
        assert disk.errors >= 1 and disk.saves_dropped >= 1 and not disk.available
        assert 1 <= disk.saves < 11 and "No space left on device" in caplog.text
        thrash(eng, ps, refs)  # served while the tier is down or refusing writes
        assert run(eng, ps[0])[0] == refs[0]  # its first blocks may come back from the full disk
        assert all_free(eng)
        eng.tiers.close()
    finally:
        subprocess.run(["umount", str(folder)], check=True)
