"""Pinned prefixes written to a pin file and pinned again by a new engine (a restart): their blocks
read from the disk tier that outlived the first engine, kept through a flood, outputs unchanged;
a file of another model is refused, unusable entries are named and dropped."""

from __future__ import annotations

import json
import logging

import pytest

from .conftest import all_free, engine, tier
from .test_engine_tiers import cases, run, thrash  # noqa: F401 (cases: a fixture)


def pinned_blocks(eng) -> int:
    return eng.kv_cache_manager.pins.num_pinned_blocks


def listed(path) -> list[list[int]]:
    return [p["token_ids"] for p in json.loads(path.read_text())["pins"]]


def test_a_restart_pins_again_from_the_disk_tier(tiny_model, tiny_loaded, cases, tmp_path, caplog):  # noqa: F811
    ps, refs = cases
    pins = tmp_path / "pins.json"
    flags = dict(kv_tier=f"disk:{tmp_path / 'kv'}", pinned_prefixes_file=str(pins))
    first = engine(tiny_model, tiny_loaded, **flags)
    assert run(first, ps[0]) == (refs[0], 0)
    assert first.pins.pin(ps[0]) == 40
    assert listed(pins) == [ps[0]]
    first.tiers.flush()

    with caplog.at_level(logging.INFO, logger="prefixkv.engine.prefix_pins"):
        second = engine(tiny_model, tiny_loaded, **flags)
    assert pinned_blocks(second) == 10
    assert tier(second, "disk").hits == 9  # every block but the last (recomputed for its logits)
    assert "restored 1 of 1 pinned prefixes" in caplog.text and "36 of them read from a cache tier" in caplog.text
    thrash(second, ps, refs)  # 48 blocks of other prompts through the 32-block pool
    assert run(second, ps[0]) == (refs[0], 36)  # from the pool: the pin kept it
    assert tier(second, "disk").hits == 9
    assert second.pins.unpin(ps[0]) == 40
    assert listed(pins) == [] and all_free(second)


def test_without_a_tier_the_prefix_is_computed_again_and_reset_empties_the_file(tiny_model, tiny_loaded, tmp_path):
    pins = tmp_path / "pins.json"
    first = engine(tiny_model, tiny_loaded, pinned_prefixes_file=str(pins))
    prefix = list(range(3, 23))
    run(first, prefix)
    assert first.pins.pin(prefix) == 20
    second = engine(tiny_model, tiny_loaded, pinned_prefixes_file=str(pins))
    assert pinned_blocks(second) == 5
    assert second.reset_prefix_cache()  # pins dropped with the cache: the file follows
    assert listed(pins) == [] and all_free(second)


def test_unusable_entries_are_named_and_another_models_file_is_refused(tiny_model, tiny_loaded, tmp_path, caplog):
    pins = tmp_path / "pins.json"
    first = engine(tiny_model, tiny_loaded, pinned_prefixes_file=str(pins))
    good = list(range(3, 23))
    run(first, good)
    first.pins.pin(good)
    data = json.loads(pins.read_text())
    data["pins"] += [{"token_ids": [10**9] * 8, "cache_salt": None, "lora": None}, {"token_ids": "nope"}]
    pins.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="prefixkv.engine.prefix_pins"):
        second = engine(tiny_model, tiny_loaded, pinned_prefixes_file=str(pins))
    assert pinned_blocks(second) == 5
    assert "out of the vocabulary" in caplog.text and "entry 2" in caplog.text
    assert listed(pins) == [good]  # rewritten to what is pinned

    data = json.loads(pins.read_text())
    data["model"] = "some/other-model"
    pins.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not of"):
        engine(tiny_model, tiny_loaded, pinned_prefixes_file=str(pins))
    assert json.loads(pins.read_text())["model"] == "some/other-model"  # never written over
