"""Files in a disk tier's folder that are not values the engine wrote: a FIFO (a read that never
returns, as on a hung network mount) and a huge sparse file. Each is refused without being read:
the request is computed (output equal to scratch), promptly, no loader thread is stuck, the
process shuts down, and no more than a block's bytes are ever read."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import httpx
import pytest

from prefixkv.request import Request
from prefixkv.sampling_params import SamplingParams
from prefixkv.tiers.value import encode_header

from ..server.conftest import Server
from .conftest import all_free, engine, run, tier
from .test_engine_tiers import prompts

GIB = 1 << 30


def _block_file(eng, prompt: list[int], index: int) -> str:
    """The disk tier's file name of the prompt's block `index`."""
    kv = eng.scheduler.kv_cache_manager
    req = Request("probe", prompt, sampling_params=SamplingParams())
    hashes = kv.get_block_hashes(req)
    return eng.tiers.key(hashes[index]).hex() + ".kv"


def test_value_nbytes_is_the_size_of_a_value():
    """The size the disk tier expects before reading equals what the manager writes."""
    from prefixkv.tiers.value import value_nbytes

    for n_tokens, extras in ((4, None), (20, b"x" * 30), (8000, b"y" * 70000), (1, b"")):
        head = encode_header(b"k" * 40, b"\0" * 4 * n_tokens, extras)
        assert value_nbytes(40, 4 * n_tokens, None if extras is None else len(extras), 1000) == len(head) + 1000 + 16


def test_a_big_sparse_file_in_place_of_a_block_is_refused_unread(tiny_model, tiny_loaded, tmp_path):
    """A 3 GiB sparse file (no disk space) named as block 0's value was read whole (+3 GiB) before
    its size was found wrong: it is refused from its size, the request computed."""
    prompt = prompts(7, 1)[0]
    ref = run(engine(tiny_model, tiny_loaded, enable_prefix_caching=False), prompt)[0]
    folder = tmp_path / "kv"
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    path = folder / _block_file(eng, prompt, 0)
    with open(path, "wb") as f:
        f.truncate(3 * GIB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.monotonic()
    assert run(eng, prompt) == (ref, 0)
    assert time.monotonic() - t0 < 4
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 256 << 10, f"peak RSS grew by {grown_kib >> 10} MiB"
    disk = tier(eng, "disk")
    assert disk.rejected == 1 and disk.hits == 0 and disk.errors == 0
    assert all_free(eng)


def test_a_fifo_in_place_of_a_block_is_refused_without_blocking(tiny_model, tiny_loaded, tmp_path):
    prompt = prompts(8, 1)[0]
    ref = run(engine(tiny_model, tiny_loaded, enable_prefix_caching=False), prompt)[0]
    folder = tmp_path / "kv"
    eng = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    os.mkfifo(folder / _block_file(eng, prompt, 0))
    t0 = time.monotonic()
    assert run(eng, prompt) == (ref, 0)
    assert time.monotonic() - t0 < eng.tiers.load_timeout_s - 1  # not the load deadline: refused at once
    disk = tier(eng, "disk")
    assert disk.rejected == 1 and disk.errors == 0
    assert all_free(eng)


@pytest.mark.slow
def test_a_fifo_in_the_disk_tier_neither_delays_a_request_nor_blocks_sigterm(tiny_model, tmp_path):
    """The issue's reproduction against `prefixkv serve`: every value file of a filled disk tier
    replaced by a FIFO. The request took the 5 s load deadline, then the loader thread stayed
    blocked in open() and SIGTERM never ended the server (the executor's threads are joined at exit)."""
    ids = prompts(9, 1)[0]
    folder = tmp_path / "kv"
    flags = (tiny_model, "--block-size", "4", "--kv-tier", f"disk:{folder}", "--dtype", "float32")
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = Server(*flags)
    try:
        body["model"] = httpx.get(first.base + "/v1/models").json()["data"][0]["id"]
        cold = httpx.post(first.base + "/v1/completions", json=body, timeout=60).json()
    finally:
        first.stop()
    names = [n for n in os.listdir(folder) if n.endswith(".kv")]
    assert len(names) == 11
    for name in names:
        os.unlink(folder / name)
        os.mkfifo(folder / name)
    second = Server(*flags)
    try:
        t0 = time.monotonic()
        r = httpx.post(second.base + "/v1/completions", json=body, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == cold["choices"][0]["text"]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert took < 4, f"the request took {took:.1f} s"
        second.wait_idle()
        t0 = time.monotonic()
        second.proc.send_signal(signal.SIGTERM)
        try:
            second.proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 15 s of SIGTERM")
        assert second.proc.returncode == 0, second.output()
    finally:
        second.stop()


HUNG_STORE = """
import threading, time
from prefixkv.tiers.manager import TierManager

class Hung:  # a store whose reads never return (a hung network mount: O_NONBLOCK does not help)
    name, spec, fast = "disk", "disk:/hung", False
    def get(self, key): threading.Event().wait()
    def get_many(self, keys, sizes=None): threading.Event().wait()
    def put(self, key, value): pass
    def contains(self, key): return False
    def close(self): pass

tiers = TierManager([Hung()], b"n" * 16, 64)
tiers.load_timeout_s = 0.2
fetch = tiers.start_fetch([b"h" * 32] * 3, list(range(12)), None, 4, 0, 2)
while not fetch.ready():
    time.sleep(0.01)
assert tiers.take_fetched(fetch, 0) == []  # given up at the deadline: computed
tiers.close()
print("closed", flush=True)
"""


def test_a_load_that_never_returns_does_not_hold_the_exit(tmp_path):
    """The process ends (close, then interpreter exit) with a loader thread stuck in a read."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG_STORE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": root},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: it waits for its stuck loader thread")
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 20


def test_other_kinds_of_files_are_refused_as_values():
    """A directory, a Unix socket, a file of another size: b"" (rejected by the checks), never
    an error that would take the tier down."""
    import shutil
    import socket as socketlib
    import tempfile

    from prefixkv.tiers.disk import DiskStore

    folder = tempfile.mkdtemp(prefix="kv")  # short: a Unix socket's path is at most 107 bytes
    sock = socketlib.socket(socketlib.AF_UNIX)
    try:
        store = DiskStore(folder)
        keys = [bytes([i]) * 4 for i in range(4)]
        os.mkdir(os.path.join(folder, keys[0].hex() + ".kv"))
        sock.bind(os.path.join(folder, keys[1].hex() + ".kv"))
        with open(os.path.join(folder, keys[2].hex() + ".kv"), "wb") as f:
            f.write(b"x" * 100)
        store.put(keys[3], b"y" * 64)
        assert store.get_many(keys, [64, 64, 64, 64]) == [b"", b"", b"", b"y" * 64]
        assert store.get(keys[2]) == b"x" * 100  # without a size: a regular file is read
        assert store.get(b"\xff" * 4, 64) is None  # no file: a miss
    finally:
        sock.close()
        shutil.rmtree(folder)
