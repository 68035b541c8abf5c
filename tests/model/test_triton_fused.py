"""The fused Triton steps a GPU runs (model/kernels/triton_fused.py: residual add + RMSNorm, rotary,
SiLU-and-multiply) against PyTorch's formulation (kernels/reference.py), and inside a model: on a GPU
compiled, on a CPU under Triton's interpreter (triton_interpreter.py). Their compile for an H100
without one is in test_triton_attention.py (triton_compile.py)."""

from __future__ import annotations

import random
from collections import Counter
from types import ModuleType
from typing import Any

import pytest
import torch

from prefixkv.model.kernels import gpu_fused
from prefixkv.model.kernels.reference import reference_add_rms_norm, reference_rotary, reference_silu_and_mul

from .triton_interpreter import FUSED, device, kernels_module

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def tf() -> ModuleType:
    return kernels_module(FUSED)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(device())


def _ulps(dtype: torch.dtype) -> float:
    """A tolerance of one rounding step or two: float32's, or bfloat16's. Triton's interpreter
    truncates float32 to bfloat16 where a GPU rounds to nearest, a step more."""
    if dtype == torch.float32:
        return 1e-5
    return 2**-7 if device().type == "cuda" else 2**-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (5, 64), (3, 200)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_pytorch(tf, dtype, rows, n, with_delta):
    gen = torch.Generator().manual_seed(rows * n)
    h = _randn(rows, n, dtype=dtype, gen=gen)
    delta = _randn(rows, n, dtype=dtype, gen=gen) if with_delta else None
    weight = _randn(n, dtype=dtype, gen=gen)
    want_h, want = reference_add_rms_norm(h.clone(), delta, weight, 1e-6)
    got = tf.add_rms_norm(h, delta, weight, 1e-6)
    # the residual sum, in place, rounded as PyTorch rounds it (the interpreter: truncated)
    if dtype == torch.float32 or device().type == "cuda":
        assert torch.equal(h, want_h)
    else:
        torch.testing.assert_close(h.float(), want_h.float(), rtol=_ulps(dtype), atol=_ulps(dtype))
    assert got.dtype == dtype and got.shape == want.shape
    # the row's sum of squares in another order: one rounding step of the dtype at most
    torch.testing.assert_close(got.float(), want.float(), rtol=_ulps(dtype), atol=_ulps(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (9, 3, 64)])
def test_rotary_in_place_on_the_qkv_rows_equals_pytorch(tf, dtype, heads, kv_heads, d):
    """q and k rotated together inside the qkv projection's rows (rows further apart than the
    heads), bit for bit PyTorch's rotation; v's columns untouched."""
    gen = torch.Generator().manual_seed(heads * d)
    T = 7
    qkv = _randn(T, (heads + 2 * kv_heads) * d, dtype=dtype, gen=gen)
    before = qkv.clone()
    angles = torch.rand(T, d // 2, generator=gen) * 6.0
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype).to(device())
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype).to(device())
    qk = qkv[:, : (heads + kv_heads) * d].view(T, heads + kv_heads, d)
    want = reference_rotary(qk, cos.unsqueeze(1), sin.unsqueeze(1))
    # the model's entry point takes it on a GPU (a CPU keeps its own kernels), here on a copy
    probe = qk.clone()
    assert gpu_fused.rotary_(probe, cos.unsqueeze(1), sin.unsqueeze(1)) is (device().type == "cuda")
    tf.rotary_(qk, cos, sin)
    if device().type == "cuda":
        assert torch.equal(probe, qk)
    if dtype == torch.float32 or device().type == "cuda":
        assert torch.equal(qk, want)
    else:  # the interpreter truncates each product to bfloat16 where PyTorch and a GPU round it
        torch.testing.assert_close(qk.float(), want.float(), rtol=_ulps(dtype), atol=_ulps(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (9, 3, 64), (3, 3, 24)])
@pytest.mark.parametrize("layout", ["qkv_rows", "own", "normed"])
def test_rotary_write_kv_equals_the_rotation_then_the_writes(tf, dtype, heads, kv_heads, d, layout):
    """One kernel: q and k rotated in place bit for bit as rotary_ rotates them, and k, v copied to
    their slots of the caches as index_copy_ copies them; no other slot touched. Layouts: q, k, v
    inside the qkv projection's rows, or q and k their own tensors; "normed": q and k RMS-normed
    by their weights first (a q/k norm), as add_rms_norm norms each head."""
    gen = torch.Generator().manual_seed(heads * d + len(layout))
    T, num_slots = 6, 40
    width = (heads + 2 * kv_heads) * d
    qkv = _randn(T, width, dtype=dtype, gen=gen)
    q = qkv[:, : heads * d].view(T, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(T, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(T, kv_heads, d)
    if layout == "own":
        q, k = q.clone(), k.clone()
    angles = torch.rand(T, d // 2, generator=gen) * 6.0
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype).to(device())
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype).to(device())
    k_cache = _randn(num_slots, kv_heads, d, dtype=dtype, gen=gen)
    v_cache = _randn(num_slots, kv_heads, d, dtype=dtype, gen=gen)
    slots = torch.randperm(num_slots, generator=gen)[:T].to(device())
    norms = None
    want_q, want_k = q.clone(), k.clone()
    if layout == "normed":
        norms = (_randn(d, dtype=dtype, gen=gen), _randn(d, dtype=dtype, gen=gen), 1e-6)
        want_q = tf.add_rms_norm(want_q.contiguous(), None, norms[0], norms[2])
        want_k = tf.add_rms_norm(want_k.contiguous(), None, norms[1], norms[2])
    tf.rotary_(want_q, cos, sin)
    tf.rotary_(want_k, cos, sin)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    want_kc.index_copy_(0, slots, want_k)
    want_vc.index_copy_(0, slots, v)
    v_before = v.clone()
    if norms is not None:  # each token alone first: its bits must not depend on the batch
        alone = [(q[t : t + 1].clone(), k[t : t + 1].clone()) for t in range(T)]
        for t, (q1, k1) in enumerate(alone):
            scratch = (k_cache.clone(), v_cache.clone())
            tf.rotary_write_kv_(q1, k1, v[t : t + 1], cos[t : t + 1], sin[t : t + 1], *scratch, slots[t : t + 1], norms)
    tf.rotary_write_kv_(q, k, v, cos, sin, k_cache, v_cache, slots, norms)
    if norms is not None:
        assert torch.equal(q, torch.cat([q1 for q1, _ in alone])) and torch.equal(k, torch.cat([k1 for _, k1 in alone]))
    if norms is None or (dtype == torch.float32 and device().type == "cpu"):
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
    elif dtype == torch.float32:
        # A GPU sums a head's squares in the order its tile's layout gives: [heads, D] here, [D] in
        # add_rms_norm, so the float32 sums may differ in the last bit (seen at D=64 on an H200)
        torch.testing.assert_close(q, want_q, rtol=_ulps(dtype), atol=_ulps(dtype))
        torch.testing.assert_close(k, want_k, rtol=_ulps(dtype), atol=_ulps(dtype))
        want_kc.index_copy_(0, slots, k)  # the copy itself still exact
    elif device().type == "cuda":
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
    else:  # the interpreter's truncation to bfloat16 lands elsewhere in the norm's two roundings
        torch.testing.assert_close(q.float(), want_q.float(), rtol=2 * _ulps(dtype), atol=2 * _ulps(dtype))
        torch.testing.assert_close(k.float(), want_k.float(), rtol=2 * _ulps(dtype), atol=2 * _ulps(dtype))
        want_kc.index_copy_(0, slots, k)  # the copy itself still exact
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)
    assert torch.equal(v, v_before)


def test_rotary_write_kv_writes_no_slot_out_of_range(tf):
    """A slot past the cache (or negative) is not written: the kernel never writes past it."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_randn(3, 2, 8, dtype=torch.float32, gen=gen) for _ in range(3))
    cos, sin = torch.ones(3, 8, device=device()), torch.zeros(3, 8, device=device())
    caches = torch.zeros(2, 5, 2, 8, device=device())  # k's and v's, 4 slots each and one beyond
    slots = torch.tensor([1, 4, -1], device=device())
    tf.rotary_write_kv_(q, k, v, cos, sin, caches[0, :4], caches[1, :4], slots)
    assert torch.equal(caches[0, 1], k[0]) and torch.equal(caches[1, 1], v[0])
    assert caches[:, [0, 2, 3, 4]].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (3, 2 * 96), (2, 2, 2 * 1100)])
def test_silu_and_mul_matches_pytorch(tf, dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = _randn(*shape, dtype=dtype, gen=gen) * 4
    got = tf.silu_and_mul(gate_up)
    want = reference_silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    # Triton's exponential against PyTorch's: one rounding step of the dtype at most
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * _ulps(dtype), atol=2 * _ulps(dtype))


def test_the_switch_and_the_conditions(tf, monkeypatch):
    """CUDA only (a CPU tensor only with the tests' `run_on_cpu`), not with PREFIXKV_CUDA_KERNELS=0,
    and only on the layouts the kernels take."""
    monkeypatch.setattr(gpu_fused, "run_on_cpu", False)
    assert gpu_fused.add_rms_norm(torch.ones(2, 8), None, torch.ones(8), 1e-6) is None
    # CPU tensors through the kernels only under the interpreter; a GPU's compiled kernels take its own
    monkeypatch.setattr(gpu_fused, "run_on_cpu", device().type == "cpu")
    x = torch.ones(2, 8, device=device())
    assert gpu_fused.add_rms_norm(x, None, torch.ones(8, device=device()), 1e-6) is not None
    ones = torch.ones(8, dtype=torch.float64, device=device())
    assert gpu_fused.add_rms_norm(x.t(), None, torch.ones(2, device=device()), 1e-6) is None  # not contiguous
    assert gpu_fused.add_rms_norm(x, None, ones, 1e-6) is None  # another dtype
    assert gpu_fused.silu_and_mul(torch.ones(2, 7, device=device())) is None  # no gate/up halves
    heads_apart = torch.ones(2, 3, 8, device=device()).transpose(0, 1)
    assert not gpu_fused.rotary_(heads_apart, torch.ones(3, 8, device=device()), torch.ones(3, 8, device=device()))
    # the rotation with the cache write: each argument's condition refused alone
    dev = device()
    q, k, tables = torch.ones(3, 4, 8, device=dev), torch.ones(3, 2, 8, device=dev), torch.ones(3, 8, device=dev)
    cache, slots = torch.zeros(10, 2, 8, device=device()), torch.arange(3, device=device())
    args = dict(q=q, k=k, v=k.clone(), cos=tables, sin=tables, k_cache=cache, v_cache=cache.clone(), slots=slots)
    assert gpu_fused.rotary_write_kv_(**args)
    weight = torch.ones(8, device=device())
    assert gpu_fused.rotary_write_kv_(**args, norms=(weight, weight, 1e-6))
    assert not gpu_fused.rotary_write_kv_(**args, norms=(weight, weight.double(), 1e-6))  # another dtype
    assert not gpu_fused.rotary_write_kv_(**args, norms=(weight, torch.ones(16, device=device())[::2], 1e-6))
    refused = {
        "q": q.transpose(0, 1).contiguous().transpose(0, 1),  # heads not contiguous in a row
        "v": torch.ones(3, 2, 8, dtype=torch.float64, device=device()),
        "cos": torch.ones(2, 8, device=device()),
        "k_cache": torch.zeros(10, 2, 16, device=device())[:, :, :8],
        "v_cache": torch.zeros(11, 2, 8, device=device()),
        "slots": slots.to(torch.int32),
    }
    for name, bad in refused.items():
        assert not gpu_fused.rotary_write_kv_(**{**args, name: bad}), name
    monkeypatch.delenv(gpu_fused.ENV_SWITCH, raising=False)
    assert gpu_fused.switched_on()
    monkeypatch.setenv(gpu_fused.ENV_SWITCH, "0")
    assert not gpu_fused.switched_on()
    if torch.cuda.is_available():
        assert gpu_fused.silu_and_mul(torch.ones(2, 8, device="cuda")) is None
    monkeypatch.setenv(gpu_fused.ENV_SWITCH, "off")  # not a value it takes: refused, not ignored
    with pytest.raises(ValueError, match="PREFIXKV_CUDA_KERNELS='off'"):
        gpu_fused.switched_on()


@pytest.fixture
def fused_calls(tf, monkeypatch) -> Counter:
    """The fused kernels on `device()` (CPU tensors under the interpreter, the CPU's native kernels
    off), their calls counted."""
    from prefixkv.model.kernels import ops

    calls: Counter = Counter()
    monkeypatch.setattr(gpu_fused, "run_on_cpu", device().type == "cpu")
    monkeypatch.setattr(gpu_fused, "_module", None)
    monkeypatch.setattr(ops, "_enabled", False)
    for name in ("add_rms_norm", "rotary_", "rotary_write_kv_", "silu_and_mul"):
        real = getattr(tf, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(tf, name, counted)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_engine_on_fused_kernels_matches_transformers(tmp_path, fused_calls, kind):
    """Greedy float32 tokens of the engine with every norm, rotation (with the K/V write) and SiLU
    on the fused kernels equal transformers', with caching off and on; every block free after.
    qwen3: the rotation after the q/k norms."""
    from prefixkv import SamplingParams

    from ..conftest import hf_greedy
    from ..engine.engine_oracle import serve_and_compare
    from .test_model_hf_folder import _make, _write_tokenizer

    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    rng = random.Random(kind)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [hf_greedy(hf, p, 4) for p in prompts]
    base = dict(dtype="float32", device=str(device()), num_blocks=32, block_size=8, max_model_len=64)
    for caching in (False, True):
        serve_and_compare(tmp_path, prompts, params, expected, {**base, "enable_prefix_caching": caching})
    # two norms a layer and the first one, one rotation (with qwen3's q/k norms) and the K/V
    # write and one SiLU a layer, every step (two layers); no rotation or q/k norm alone
    rotations = fused_calls["rotary_write_kv_"]
    assert fused_calls["add_rms_norm"] == 2 * rotations + rotations // 2 > 0
    assert fused_calls["silu_and_mul"] == rotations and fused_calls["rotary_"] == 0
