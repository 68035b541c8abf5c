"""Row-split products (prefixkv/model/row_split.py): a split product is the whole product's bits,
row for row, in every shape the default model multiplies; the layers split only while switched on
and only products of many rows; a failing block raises instead of crashing the process; and a
whole model's outputs do not change when a step splits."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.model import row_split
from prefixkv.model.kernels import build, ops
from prefixkv.model.layers import DualLayoutLinear, PackedLinear, packed_linear_works

pytestmark = pytest.mark.skipif(not row_split.available(), reason="row-split products are not built here")

# (in, out) of the default model's products: fused q/k/v, o, fused gate/up, down - and an odd one
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (48, 37)]
DTYPES = [dt for dt in (torch.float32, torch.bfloat16) if packed_linear_works(dt)]


@pytest.fixture
def two_threads():
    """Two torch threads for the test, whatever an earlier test left set (a split needs two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU splits nothing")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_split_rows_are_the_whole_products_bits(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    op = torch.ops.prefixkv.row_split_linear
    try:
        with torch.inference_mode():
            for fan_in, fan_out in SHAPES:
                weight = torch.randn(fan_out, fan_in, generator=g).to(dtype)
                bias = torch.randn(fan_out, generator=g).to(dtype) if fan_in == 48 else None
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
                for rows in (1, 31, 64, 95, 96, 128, 129, 191, 500, 761, 1024):
                    x = torch.randn(rows, fan_in, generator=g).to(dtype)
                    whole = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                    for block in (32, row_split.BLOCK_ROWS, 128):
                        split = op(x, packed, bias, fan_out, block)
                        assert torch.equal(split, whole), (fan_in, fan_out, rows, block)
    finally:
        torch.set_num_threads(before)


@TWO_CPUS
@pytest.mark.parametrize("kind", [PackedLinear, DualLayoutLinear])
def test_layers_split_only_while_on_and_only_many_rows(kind, monkeypatch, two_threads):
    calls: list[int] = []
    real = row_split._op

    def counting(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(row_split, "_op", counting)
    g = torch.Generator().manual_seed(2)
    layer = kind(torch.randn(96, 64, generator=g))
    many = torch.randn(3, row_split.MIN_ROWS, 64, generator=g)  # batched leading dims are flattened
    few = torch.randn(row_split.MIN_ROWS - 1, 64, generator=g)
    with torch.inference_mode():
        want = layer(many)
        assert calls == []  # off: whole products
        row_split.set_active(True)
        try:
            got = layer(many)
            layer(few)
            with ops.disabled():  # native kernels switched off: whole again
                layer(many)
        finally:
            row_split.set_active(False)
    assert calls == [3 * row_split.MIN_ROWS]
    assert torch.equal(got, want) and got.shape == (3, row_split.MIN_ROWS, 96)


def test_a_failing_block_raises_and_the_process_lives_on():
    """A block whose product fails raises out of the operator (an exception thrown inside the
    OpenMP region would end the process), and the operator works on afterwards."""
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(16, 64), 8)
    with torch.inference_mode():
        with pytest.raises(RuntimeError):
            torch.ops.prefixkv.row_split_linear(torch.randn(300, 48), packed, None, 16, 64)  # 48 columns, not 64
        with pytest.raises(RuntimeError, match="contiguous"):
            torch.ops.prefixkv.row_split_linear(torch.randn(64, 300).t(), packed, None, 16, 64)
        x = torch.randn(300, 64)
        whole = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        assert torch.equal(torch.ops.prefixkv.row_split_linear(x, packed, None, 16, 64), whole)


def test_built_once_and_reused():
    """The operator the module loaded came from the kernels' cache, and asking again rebuilds
    nothing (cpu_kernels' own test covers building into a fresh folder)."""
    flags, link = row_split._build_flags()
    args = (build.compiler(), [row_split.SOURCE], [], flags, link)
    path = build.build(*args, name="prefixkv-row-split")
    assert path.name.startswith("prefixkv-row-split-") and path.parent == build.cache_dir()
    stamp = path.stat().st_mtime_ns
    assert build.build(*args, name="prefixkv-row-split") == path and path.stat().st_mtime_ns == stamp


@pytest.fixture
def one_engine_at_a_time():
    """The engine of one dtype is freed before the next dtype's is built."""
    yield
    gc.collect()


@TWO_CPUS
@pytest.mark.usefixtures("one_engine_at_a_time")
@pytest.mark.parametrize("dtype", [str(dt).removeprefix("torch.") for dt in DTYPES])  # the dtypes the model packs
def test_model_outputs_do_not_change_when_steps_split(dtype, monkeypatch, two_threads):
    """Every prompt position's logprobs (a ~390-token step: 6 blocks of products) and the generated
    tokens' logprobs bit for bit, split or whole (oneDNN's layout: the many-row native linear, which
    shares its rows out by itself, is not chosen here)."""
    monkeypatch.setattr(ops, "blocked_linear_available", lambda dtype=None: False)
    llm = LLM(
        dtype=dtype,
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,  # a ~400-token step, not the default 1 GiB
        cpu_thread_policy="fixed",
        enable_prefix_caching=False,
    )
    words = "river mountain quiet engine paper lantern violet harbor copper signal garden winter".split()
    prompts = [" ".join(words[(i * 5 + s) % len(words)] for i in range(n)) for s, n in ((0, 300), (1, 90))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)

    def run() -> list:
        out = llm.generate(prompts, params, use_tqdm=False)
        return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]

    whole = run()
    calls: list[int] = []
    real = row_split._op
    monkeypatch.setattr(row_split, "_op", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    row_split.set_active(True)
    try:
        split = run()
    finally:
        row_split.set_active(False)
    assert split == whole
    # every layer's four products of the prefill split (and the head's on prompt positions); the
    # decode steps' few rows whole
    assert len(calls) >= 4 * 30 and min(calls) >= row_split.MIN_ROWS
