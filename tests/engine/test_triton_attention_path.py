"""The engine with attention's context read by Triton's paged kernels (PREFIXKV_CUDA_ATTENTION=triton):
on a GPU compiled, on a CPU under Triton's interpreter (tests/model/triton_interpreter.py), the
model's CUDA wiring end to end. Tiny random checkpoints; greedy float32 tokens equal transformers'
with caching off and on (a prefix shared past the cascade's threshold, so decodes and chunks after it
attend to it once and to their own suffix in place), a small chunk budget, a sliding window, Gemma
4's two head sizes and KV-shared layers; every block free after."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from prefixkv import SamplingParams
from prefixkv.model.attention import CASCADE_MIN_TOKENS

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _make, _write_tokenizer
from ..model.triton_interpreter import device, kernels_module
from .engine_oracle import serve_and_compare

MAX_NEW = 4


@pytest.fixture
def triton_calls(monkeypatch) -> Counter:
    """The Triton path switched on; its kernels' calls counted by (kernel, keys from a prefix's end)."""
    kernels = kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_ATTENTION", "triton")
    calls: Counter = Counter()
    for name in ("paged_decode", "paged_prefill"):
        real = getattr(kernels, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name, kwargs.get("start", 0) > 0] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return calls


def serve_on_triton(folder, hf, seed: str) -> None:
    """`hf` saved at `folder` served on Triton's kernels: greedy tokens equal transformers' with
    caching off and on and a small chunk budget, for prompts sharing a prefix past the cascade's
    threshold and one apart."""
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(CASCADE_MIN_TOKENS + 8)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 10))] for _ in range(3)]
    prompts.append([rng.randrange(256) for _ in range(7)])
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    base = dict(dtype="float32", device=str(device()), num_blocks=64, block_size=8, max_model_len=96)
    for kwargs in (dict(enable_prefix_caching=False), dict(enable_prefix_caching=True), dict(max_num_batched_tokens=9)):
        serve_and_compare(folder, prompts, params, expected, {**base, **kwargs})


@pytest.mark.parametrize("kind", ["llama", "mistral-swa"])
def test_engine_on_triton_kernels_matches_transformers(tmp_path, triton_calls, kind):
    serve_on_triton(tmp_path, _make(kind), kind)
    assert triton_calls["paged_decode", False] and triton_calls["paged_prefill", False]
    if kind == "llama":  # the shared prefix attended to once (the cascade), each suffix in place
        assert triton_calls["paged_decode", True] and triton_calls["paged_prefill", True]


def test_gemma4_on_triton_kernels_matches_transformers(tmp_path, triton_calls):
    """Gemma 4's two head sizes (16 and 32 here; 256 and 512 released) and its KV-shared layers,
    which attend over earlier layers' blocks as a decode does, on Triton's kernels."""
    from .test_gemma4 import make_gemma4

    serve_on_triton(tmp_path, make_gemma4("small"), "gemma4")
    assert triton_calls["paged_decode", False] and triton_calls["paged_prefill", False]
