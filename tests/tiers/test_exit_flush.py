"""A process that ends right after generating (an offline script: no flush, no close) still
writes its queued saves: the slow tiers' writers are drained at interpreter exit."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import engine, run, tier
from .test_engine_tiers import prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_script_that_ends_leaves_every_queued_save_on_disk(tiny_model, tiny_loaded, tmp_path):
    folder, prompt = tmp_path / "kv", prompts(5, 1)[0]
    script = os.path.join(os.path.dirname(__file__), "exiting_engine.py")
    # 0.1 s per write: the 11 values are still mostly queued when generate() returns
    proc = subprocess.run(
        [sys.executable, script, tiny_model, str(folder), "0.1", ",".join(map(str, prompt))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len([n for n in os.listdir(folder) if n.endswith(".kv")]) == 11

    # and the next run finds the whole prefix: every block that may be a hit
    second = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    assert run(second, prompt)[1] == 36 and tier(second, "disk").hits == 9
