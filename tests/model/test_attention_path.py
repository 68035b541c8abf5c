"""The switch between the gather path and Triton's kernels for attention's cached context
(model/attention_path.py): refused values, the CPU's own path unless Triton's interpreter runs."""

from __future__ import annotations

import pytest
import torch

from prefixkv.model.attention_path import ENV, uses_triton


def test_unknown_choice_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "flash")
    with pytest.raises(ValueError, match="PREFIXKV_CUDA_ATTENTION='flash'"):
        uses_triton(torch.device("cpu"))


def test_cpu_takes_triton_only_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv(ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not uses_triton(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert uses_triton(torch.device("cpu"))
    monkeypatch.setenv(ENV, "gather")
    assert not uses_triton(torch.device("cpu"))
    monkeypatch.delenv(ENV)
    assert not uses_triton(torch.device("cpu"))  # gather is the default


def test_cuda_takes_triton_by_default_and_gather_without_it(monkeypatch):
    """Triton's kernels are a GPU's default (measured faster on an H100); where Triton is missing
    the default falls back to the gather, and only an explicit request is an error."""
    import importlib.util

    monkeypatch.delenv(ENV, raising=False)
    has_triton = importlib.util.find_spec("triton") is not None
    assert uses_triton(torch.device("cuda")) is has_triton
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else object())
    assert not uses_triton(torch.device("cuda"))
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        uses_triton(torch.device("cuda"))
