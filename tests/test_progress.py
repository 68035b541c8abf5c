"""Start-up stages that say what they do (prefixkv/progress.py), the engine's summary line, and the
install-time warm-up (prefixkv/model/warmup.py)."""

from __future__ import annotations

import logging
import re
import time

import torch

from prefixkv.model import default_model_path, row_split, warmup, weight_cache
from prefixkv.model.kernels import ops
from prefixkv.progress import Stages, announced


def test_a_slow_stage_says_what_it_does_while_it_runs(caplog):
    with caplog.at_level(logging.INFO, logger="prefixkv"):
        with announced("compiling something", after=0.05):
            time.sleep(0.3)
            said = caplog.text  # the line is out before the stage ends
        with announced("something quick", after=1.0):
            pass
    assert "compiling something..." in said
    # at least the sleep; a loaded machine (the suite's other worker) may add to it
    done = re.search(r"compiling something: done in (\d+\.\d) s", caplog.text)
    assert done and float(done.group(1)) >= 0.3, caplog.text
    assert "something quick" not in caplog.text


def test_stages_sum_up_in_one_line():
    stages = Stages()
    with stages.stage("model", "loading"):
        time.sleep(0.1)
    with stages.stage("model", "loading"):
        time.sleep(0.1)
    # at least the sleeps, summed; a loaded machine (the suite's other worker) may add to them
    assert stages.times["model"] >= 0.2
    # the line's form over known times: an empty block can take 0.3 s on a loaded 2-core machine
    stages.times = {"model": 0.84, "instant": 0.01, "KV cache": 1.5}
    line = stages.summary()
    assert re.fullmatch(r"\d+\.\d s \(model 0\.8 s, KV cache 1\.5 s\)", line), line


def test_the_engine_logs_its_stages(caplog):
    from prefixkv import LLM

    with caplog.at_level(logging.INFO, logger="prefixkv"):
        LLM(device="cpu", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    (ready,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready in")]
    assert "model" in ready and "weight layout" in ready, ready


def test_warmup_builds_the_kernels_and_caches_the_weights(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(ops, "available", lambda: calls.append("kernels") or True)
    monkeypatch.setattr(row_split, "available", lambda: calls.append("row_split") or False)
    monkeypatch.setattr(weight_cache, "folder", lambda: tmp_path)
    with caplog.at_level(logging.INFO, logger="prefixkv"):
        assert warmup.main(["--dtype", "bfloat16"]) == 0
    assert calls == ["kernels", "row_split"]
    assert "native CPU kernels ready, row-split products not used" in caplog.text
    (entry,) = tmp_path.glob("*.pkvw")
    assert entry == weight_cache.entry_path(default_model_path(), torch.bfloat16)
