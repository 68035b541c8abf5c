"""A one-row step's products with the step before folded in (model/kernels/triton_gemv.py): against
the engine's separate kernels (the residual add + RMSNorm, SiLU-and-multiply) then F.linear, the
folded step's values bit for bit (an identity weight shows them), and inside a model's decode step:
six kernels a layer where the layer by layer path runs nine, the same tokens. On a GPU compiled, on
a CPU under Triton's interpreter."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import AttentionMetadata, load_model
from prefixkv.model.kernels import gpu_fused

from .test_model_hf_folder import _make, _write_tokenizer
from .triton_interpreter import FUSED, GEMV, device, kernels_module

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def on_device(monkeypatch):
    kernels_module(FUSED)
    kernels_module(GEMV)
    monkeypatch.setattr(gpu_fused, "run_on_cpu", device().type == "cpu")
    monkeypatch.setattr(gpu_fused, "_module", None)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K, N", [(64, 48), (576, 960), (100, 1000)])  # a width that is no power of two
def test_norm_linear_is_the_norm_then_the_product(on_device, dtype, K, N):
    gen = torch.Generator().manual_seed(K + N)
    h, delta = _randn(1, K, dtype=dtype, gen=gen), _randn(1, K, dtype=dtype, gen=gen)
    norm_w = (1 + _randn(K, dtype=torch.float32, gen=gen, scale=0.1)).to(dtype)
    weight = _randn(N, K, dtype=dtype, gen=gen, scale=K**-0.5)
    for d in (delta, None):
        stream = h.clone()
        normed = gpu_fused.add_rms_norm(stream, d, norm_w, 1e-5)  # (in place: stream becomes h + delta)
        assert normed is not None
        got = gpu_fused.norm_linear(h, d, norm_w, 1e-5, weight)
        assert got is not None
        new_h, out = got
        assert torch.equal(new_h, stream) and (d is not None or new_h is h)
        assert torch.equal(h, stream if d is None else h)  # h itself untouched
        tol = 1e-5 if dtype == torch.float32 else 2**-6
        torch.testing.assert_close(out.float(), F.linear(normed, weight).float(), rtol=tol, atol=tol)
        # an identity product shows the folded norm's values: the separate kernel's bit for bit
        eye = torch.eye(K, dtype=dtype, device=device())
        folded = gpu_fused.norm_linear(h, d, norm_w, 1e-5, eye)
        assert folded is not None and torch.equal(folded[1], normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K, N", [(64, 48), (1536, 576), (100, 70)])
def test_silu_linear_is_silu_and_mul_then_the_product(on_device, dtype, K, N):
    gen = torch.Generator().manual_seed(K * N)
    gate_up = _randn(1, 2 * K, dtype=dtype, gen=gen, scale=2.0)
    weight = _randn(N, K, dtype=dtype, gen=gen, scale=K**-0.5)
    act = gpu_fused.silu_and_mul(gate_up)
    out = gpu_fused.silu_linear(gate_up, weight)
    assert act is not None and out is not None
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(out.float(), F.linear(act, weight).float(), rtol=tol, atol=tol)
    folded = gpu_fused.silu_linear(gate_up, torch.eye(K, dtype=dtype, device=device()))
    assert folded is not None and torch.equal(folded, act)


def test_what_the_folded_products_do_not_take(on_device):
    gen = torch.Generator().manual_seed(0)
    h = _randn(2, 64, dtype=torch.float32, gen=gen)
    w = _randn(32, 64, dtype=torch.float32, gen=gen)
    norm_w = torch.ones(64, device=device())
    assert gpu_fused.norm_linear(h, None, norm_w, 1e-5, w) is None  # two rows
    assert gpu_fused.norm_linear(h[:1], None, norm_w, 1e-5, w.bfloat16()) is None  # another dtype
    assert gpu_fused.norm_linear(h[:1], None, norm_w, 1e-5, w.t()) is None  # not contiguous
    assert gpu_fused.silu_linear(h[:1], w) is None  # 64 columns: not gate and up of 64 each


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_one_row_step_folds_three_kernels_a_layer_and_keeps_its_tokens(tmp_path, on_device, monkeypatch, kind):
    """A model's one-row decode step with `one_row_products` on: the final hidden state within
    rounding of the layer by layer path's, the same K/V written; counted under the interpreter, per
    layer two norm-and-product kernels and one SiLU-and-product kernel in place of two norms, SiLU
    and three products, the attention's own kernels as before."""
    from prefixkv.model.kernels import ops

    counting = device().type == "cpu"
    if counting:
        from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(ops, "_enabled", False)  # the CPU's native kernels would stand in for Triton's
    monkeypatch.setenv("PREFIXKV_CUDA_ATTENTION", "triton")
    dev = device()
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=dev).model
    assert model.one_row_products_unsupported() is None
    n = model.config.num_hidden_layers
    bs = 4
    runs = []
    for folded in (False, True):
        model.one_row_products = folded
        caches = allocate_kv_cache(model.config, 4, bs, dtype=torch.float32, device=dev)
        prompt = AttentionMetadata(torch.arange(6), [0, 6], [6], torch.tensor([[0, 1]]))
        model(torch.tensor([5, 17, 99, 3, 42, 7]), torch.arange(6), caches, prompt)
        launched: collections.Counter[str] = collections.Counter()
        if counting:
            real_run = InterpretedFunction.run

            def run(self, *args, launched=launched, real_run=real_run, **kwargs):  # type: ignore[no-untyped-def]
                launched[self.fn.__name__.strip("_")] += 1
                return real_run(self, *args, **kwargs)

            monkeypatch.setattr(InterpretedFunction, "run", run)
        decode = AttentionMetadata(torch.tensor([6]), [0, 1], [7], torch.tensor([[0, 1]]))
        hidden = model(torch.tensor([11]), torch.tensor([6]), caches, decode)
        if counting:
            monkeypatch.setattr(InterpretedFunction, "run", real_run)
        runs.append((hidden, caches, launched))
    (plain, plain_caches, plain_kernels), (hidden, caches, kernels) = runs
    torch.testing.assert_close(hidden, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, plain_caches):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if not counting:
        return
    assert plain_kernels["add_rms_norm_kernel"] == 2 * n + 1 and plain_kernels["silu_and_mul_kernel"] == n
    assert kernels == {
        "prologue_gemv_kernel": 3 * n,
        "rotary_write_kv_kernel": n,
        "decode_kernel": n,
        "add_rms_norm_kernel": 1,  # the final norm
    }, kernels


def test_which_models_fold_them(tmp_path):
    """Llama's own layers only: projection biases (Qwen2), another norm (Gemma's 1 + weight) or
    LoRA adapters keep the layer by layer path, and say why."""
    from prefixkv.model.gemma import GemmaRMSNorm

    reasons = {}
    for kind in ("llama", "qwen2"):
        folder = tmp_path / kind
        _make(kind).save_pretrained(folder, safe_serialization=True)
        _write_tokenizer(folder)
        reasons[kind] = load_model(str(folder), dtype=torch.float32, device="cpu").model
    llama = reasons["llama"]
    assert llama.one_row_products_unsupported() is None
    assert "with a bias" in (reasons["qwen2"].one_row_products_unsupported() or "")
    llama.lora_context = object()  # LoRA attached after a first answer: asked at every step
    assert llama.one_row_products_unsupported() == "LoRA adapters are attached"
    llama.lora_context = None
    llama._one_row_unsupported = False  # asked again below
    llama.norm = GemmaRMSNorm(llama.config.hidden_size, 1e-6)
    assert llama.one_row_products_unsupported() == "its final norm is GemmaRMSNorm"
