"""The dequantized-weights cache (prefixkv/model/weight_cache.py): a warm load gives the fresh load's
parameters bit for bit, and a damaged entry is found, removed and written again - never used.

The loads are of a tiny GGUF (Q8_0 matrices, written by tests/model/test_model_gguf_file.py's
helper from transformers' own Llama): the cache keeps whatever a GGUF's load dequantizes, so its
checks do not need the default model, whose every cold load costs ~5 s of dequantization and a
540 MB write (eight of them here)."""

from __future__ import annotations

import functools
import logging
import os
import shutil

import pytest
import torch

from prefixkv.model import load_model, weight_cache
from prefixkv.model.llama import LlamaModel

from .test_model_gguf_file import _write_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_gguf(path, "llama")
    return str(path)


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_cache, "folder", lambda: tmp_path / "weights")
    monkeypatch.delenv(weight_cache.ENV_SWITCH, raising=False)
    return tmp_path / "weights"


def fresh(gguf_path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The parameters as a load without the cache makes them (dequantized now)."""
    os.environ[weight_cache.ENV_SWITCH] = "0"
    try:
        model = load_model(gguf_path, dtype=dtype).model
    finally:
        del os.environ[weight_cache.ENV_SWITCH]
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def fresh_params(gguf_path):
    """fresh(dtype), dequantized once per dtype in this module (the tests only read them)."""
    return functools.cache(functools.partial(fresh, gguf_path))


@pytest.fixture(scope="module")
def float32_entry(tmp_path_factory, gguf_path):
    """An entry as a cold float32 load writes it, made once: each damage test damages a copy."""
    folder = tmp_path_factory.mktemp("pristine") / "weights"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weight_cache, "folder", lambda: folder)
        mp.delenv(weight_cache.ENV_SWITCH, raising=False)
        load_model(gguf_path, dtype=torch.float32)
    (entry,) = entries(folder)
    return entry


def assert_same(model: LlamaModel, want: dict[str, torch.Tensor]) -> None:
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def entries(folder) -> list:
    return sorted(folder.glob("*.pkvw"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_load_equals_fresh_dequantization(cache_folder, monkeypatch, gguf_path, fresh_params, dtype):
    want = fresh_params(dtype)
    assert not entries(cache_folder)  # the switch kept the cache out
    cold = load_model(gguf_path, dtype=dtype).model  # dequantizes and writes the entry
    assert_same(cold, want)
    (entry,) = entries(cache_folder)

    def no_dequantization(self, weights):
        raise AssertionError("the warm load dequantized")

    monkeypatch.setattr(LlamaModel, "load_hf_weights", no_dequantization)
    warm = load_model(gguf_path, dtype=dtype).model
    assert_same(warm, want)
    assert entries(cache_folder) == [entry]
    # the parameters are the file's mapping (copy-on-write): writing one leaves the file as it is
    warm.norm.weight.data.add_(1.0)
    assert_same(load_model(gguf_path, dtype=dtype).model, want)


def damage_truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4096)


def damage_flip(path) -> None:
    with open(path, "r+b") as f:  # one bit of a weight in the middle of the data
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


def damage_header(path) -> None:
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\xff\xff\xff")


def damage_empty(path) -> None:
    open(path, "wb").close()


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip, damage_header, damage_empty])
def test_a_damaged_entry_is_rebuilt_never_used(cache_folder, caplog, gguf_path, fresh_params, float32_entry, damage):
    want = fresh_params(torch.float32)
    cache_folder.mkdir(parents=True)
    entry = cache_folder / float32_entry.name  # where this load looks for its entry
    shutil.copyfile(float32_entry, entry)
    damage(entry)
    with caplog.at_level(logging.INFO, logger="prefixkv"):
        model = load_model(gguf_path, dtype=torch.float32).model
    assert "damaged" in caplog.text and "dequantizing" in caplog.text
    assert_same(model, want)
    assert entries(cache_folder) == [entry]  # written again, whole
    assert weight_cache.load(entry, dict(model.named_parameters())) is not None


def test_store_and_load_small_tensors(tmp_path):
    params = {
        "a": torch.randn(3, 70),
        "b": torch.randn(5).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "c": torch.arange(weight_cache.CHUNK // 4 + 17, dtype=torch.float32),  # spans two checked pieces
    }
    path = tmp_path / "m-k.pkvw"
    weight_cache.store(path, params)
    got = weight_cache.load(path, {k: torch.nn.Parameter(v, requires_grad=False) for k, v in params.items()})
    assert got is not None and got.keys() == params.keys()
    for k, v in params.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
        assert got[k].numel() == 0 or got[k].data_ptr() % weight_cache.ALIGN == 0
    # another layout than the model's: not used (and kept)
    assert weight_cache.load(path, {"a": torch.nn.Parameter(torch.zeros(3, 71))}) is None
    assert path.exists()
    # a newer entry of the same model and dtype replaces the older; a killed writer's old temporary goes too
    left = tmp_path / ".weights-killed"
    left.write_bytes(b"partial")
    os.utime(left, (0, 0))
    recent = tmp_path / ".weights-writing"
    recent.write_bytes(b"in progress")
    newer = tmp_path / "m-k2.pkvw"
    weight_cache.store(newer, params)
    assert sorted(tmp_path.glob("*.pkvw")) == [newer]
    assert not left.exists() and recent.exists()  # (a concurrent writer's is left alone)


def test_the_key_follows_the_file(tmp_path, default_gguf_path):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(open(default_gguf_path, "rb").read())
    first = weight_cache.entry_path(str(copy), torch.float32)
    assert weight_cache.entry_path(str(copy), torch.float32) == first
    assert weight_cache.entry_path(str(copy), torch.bfloat16) != first
    os.utime(copy, ns=(1, 1))  # touched: another key (the same model's family)
    touched = weight_cache.entry_path(str(copy), torch.float32)
    assert touched != first and touched.name.split("-")[0] == first.name.split("-")[0]
    with open(copy, "r+b") as f:  # a changed header at the same size and time: another key
        f.seek(100)
        f.write(b"x")
    os.utime(copy, ns=(1, 1))
    assert weight_cache.entry_path(str(copy), torch.float32) != touched


def test_the_folder_keeps_what_loads_can_use_within_its_bound(tmp_path, monkeypatch):
    """Writing an entry removes the entries whose GGUF is gone (a deleted clone, venv or temporary
    folder) and those of another format version, then the least recently used ones while the folder
    is over PREFIXKV_WEIGHT_CACHE_MAX_GB; the entry written stays, and a load marks its entry used."""
    monkeypatch.delenv(weight_cache.ENV_MAX_GB, raising=False)
    folder = tmp_path / "weights"
    params = {"w": torch.randn(64, 64)}

    def made(name: str) -> tuple:
        source = tmp_path / f"{name}.gguf"
        source.write_bytes(b"GGUF")
        entry = folder / f"{name}-key.pkvw"
        weight_cache.store(entry, params, source=str(source))
        return entry, source

    (a, _), (b, b_source) = made("a"), made("b")
    assert entries(folder) == [a, b]
    b_source.unlink()
    c, _ = made("c")
    assert entries(folder) == [a, c]  # b's GGUF is gone
    older = folder / "older-key.pkvw"  # an entry of the format before (no source named)
    older.write_bytes(weight_cache._PREFIX.pack(weight_cache.MAGIC, 1, 2) + b"{}")
    d, _ = made("d")
    assert entries(folder) == [a, c, d]

    size = a.stat().st_size
    monkeypatch.setenv(weight_cache.ENV_MAX_GB, str(2.5 * size / 2**30))  # room for two entries
    for entry, t in ((a, 100), (c, 200), (d, 300)):
        os.utime(entry, (t, t))
    assert weight_cache.load(a, {"w": torch.nn.Parameter(params["w"], requires_grad=False)}) is not None
    e, _ = made("e")
    assert entries(folder) == [a, e]  # c and d were the least recently used (a was just loaded)
    monkeypatch.setenv(weight_cache.ENV_MAX_GB, "0")
    f, _ = made("f")
    assert entries(folder) == [f]  # the entry written stays, whatever the bound

    monkeypatch.setenv(weight_cache.ENV_MAX_GB, "lots")
    with pytest.raises(ValueError, match=weight_cache.ENV_MAX_GB):
        weight_cache.entry_path(str(tmp_path / "a.gguf"), torch.float32)
