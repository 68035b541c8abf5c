"""A decode step's layers in one native call (csrc/decode_layers.cpp, LlamaModel.decode_layers)
against the layer-by-layer path: the same hidden states and the same KV cache, bit for bit, on the
default model and on a tiny Qwen2 (q/k/v bias, four query heads a KV head); and the steps and
models it leaves to the layer-by-layer path."""

from __future__ import annotations

import shutil

import pytest
import torch

from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import load_model
from prefixkv.model.kernels import ops

from .model_helpers import make_step
from .test_model_hf_folder import _common, _write_tokenizer

BS = 16

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler: the PyTorch path runs"
)


def _needs_kernel(dtype):
    if not ops.decode_layers_available(dtype):
        pytest.skip(f"no small-batch linear for {dtype} on this CPU: decode steps run layer by layer")


class _DefaultModels(dict):
    """The default model per dtype, loaded and laid out for the CPU at its first use (a dtype
    whose tests skip for want of the kernel is never loaded)."""

    def __missing__(self, dtype):
        lm = self[dtype] = load_model(None, dtype=dtype)
        lm.model.pack_for_cpu()
        return lm


@pytest.fixture(scope="module")
def default_models():
    return _DefaultModels()


def _tiny(folder, dtype, kind="Qwen2", **extra):
    """A tiny random `kind` (transformers' class names: Qwen2, Qwen3, Mistral) with head dim 32
    and four query heads a KV head, loaded and laid out as the engine does."""
    import transformers as tf

    cfg = getattr(tf, kind + "Config")(**_common(head_dim=32, num_attention_heads=8, num_key_value_heads=2, **extra))
    torch.manual_seed(0)
    hf = getattr(tf, kind + "ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    lm = load_model(str(folder), dtype=dtype)
    lm.model.pack_for_cpu()
    return lm


class _Spy:
    """Counts the fused calls that ran."""

    def __init__(self, monkeypatch):
        self.ran = 0
        real = ops.decode_layers

        def spy(*args, **kwargs):
            done = real(*args, **kwargs)
            self.ran += bool(done)
            return done

        monkeypatch.setattr(ops, "decode_layers", spy)


def _decode_both_ways(lm, lengths, steps, spy, *, shared_blocks=0, seed=0):
    """Prefill sequences of `lengths` tokens, then `steps` decode steps of all of them, once with
    the fused path and once layer by layer, each on its own copy of the prefilled cache. Asserts
    equal hidden states and caches after every step; returns the fused calls that ran."""
    model, cfg = lm.model, lm.config
    g = torch.Generator().manual_seed(seed)
    per = (max(lengths) + steps + BS - 1) // BS
    pool = len(lengths) * per + 4
    perm = torch.randperm(pool, generator=g).tolist()
    tables = [perm[i * per : (i + 1) * per] for i in range(len(lengths))]
    for table in tables[1:]:  # the first `shared_blocks` blocks of every table the same (a cascade)
        table[:shared_blocks] = tables[0][:shared_blocks]
    tokens = [torch.randint(100, cfg.vocab_size - 1, (n,), generator=g).tolist() for n in lengths]
    if shared_blocks:
        for t in tokens[1:]:
            t[: shared_blocks * BS] = tokens[0][: shared_blocks * BS]
    # the prompts are prefilled once and the cache copied: a prefill is no decode step (the fused
    # path leaves it to the layers), so both paths' decode steps start from the same K/V
    caches = {fused: allocate_kv_cache(cfg, pool, BS, dtype=model.dtype) for fused in (True, False)}
    seqs = [(t, table, 0) for t, table in zip(tokens, tables)]
    if shared_blocks:  # the first writes the shared blocks; the others find them cached
        ids, pos, meta = make_step(seqs[:1], BS)
        model(ids, pos, caches[True], meta)
        seqs = [(t, table, shared_blocks * BS) for t, table in zip(tokens[1:], tables[1:])]
    ids, pos, meta = make_step(seqs, BS)
    model(ids, pos, caches[True], meta)
    for dst, src in zip(caches[False], caches[True]):
        dst.copy_(src)
    ran_before = spy.ran
    try:
        for _ in range(steps):
            seqs = [(t, table, len(t) - 1) for t, table in zip(tokens, tables)]
            out = {}
            for fused in (True, False):
                model.fused_decode = fused
                ids, pos, meta = make_step(seqs, BS)
                out[fused] = model(ids, pos, caches[fused], meta)
            assert torch.equal(out[True], out[False])
            for a, b in zip(caches[True], caches[False]):
                assert torch.equal(a, b)
            nxt = model.compute_logits(out[True]).argmax(-1).tolist()
            for t, token in zip(tokens, nxt):
                t.append(token)
    finally:
        model.fused_decode = True
    return spy.ran - ran_before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths",
    [
        [37],  # one sequence: the attention splits its keys into parts, merged (one CPU: none)
        [300],  # a longer context, split in more parts
        [5, 70, 1, 33, 129],  # ragged, padded slot rows
        # the most rows the fused path takes, ragged over one to four blocks (short: their prefill
        # only sets up the K/V the decode steps read)
        [4 + 3 * i for i in range(16)],
    ],
)
def test_default_model_fused_steps_equal_layer_by_layer(default_models, monkeypatch, dtype, lengths):
    _needs_kernel(dtype)
    spy = _Spy(monkeypatch)
    assert _decode_both_ways(default_models[dtype], lengths, 3, spy) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_bias_and_four_query_heads_a_kv_head(tmp_path, monkeypatch, dtype):
    _needs_kernel(dtype)
    lm = _tiny(tmp_path, dtype)
    assert lm.config.attention_bias and lm.model.decode_layers is not None
    spy = _Spy(monkeypatch)
    assert _decode_both_ways(lm, [9, 40, 17], 4, spy) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequences_sharing_a_prefix_read_it_each_without_the_cascade(default_models, monkeypatch, dtype):
    """Sequences sharing four leading blocks: with the native kernel a decode step reads each whole
    context in place on both paths (the cascade is for chunks, and for the PyTorch path)."""
    _needs_kernel(dtype)
    two_decodes = [(list(range(100, 180)), [0, 1, 2, 3, 4, 5], 79)] * 2
    assert make_step(two_decodes, BS)[2].plan(BS, torch.device("cpu")).prefix_slots is None
    with ops.disabled():  # a fresh step: the plan is cached per metadata
        assert make_step(two_decodes, BS)[2].plan(BS, torch.device("cpu")).prefix_slots is not None
    spy = _Spy(monkeypatch)
    assert _decode_both_ways(default_models[dtype], [80, 90, 100], 3, spy, shared_blocks=4) == 3
    # past the fused path's rows the layers read in place too (no cascade): equal as ever
    assert _decode_both_ways(default_models[dtype], [70 + i for i in range(17)], 1, spy, shared_blocks=4) == 0


def test_steps_it_leaves_to_the_layers(default_models, monkeypatch):
    lm = default_models[torch.float32]
    _needs_kernel(torch.float32)
    spy = _Spy(monkeypatch)
    # more rows than the small-batch linear takes
    assert _decode_both_ways(lm, [10 + i for i in range(17)], 1, spy) == 0
    # a step with a prompt and a decode together
    model, cfg = lm.model, lm.config
    caches = allocate_kv_cache(cfg, 16, BS)
    a, b = list(range(100, 120)), list(range(200, 230))
    ids, pos, meta = make_step([(a, [0, 1], 0)], BS)
    model(ids, pos, caches, meta)
    ids, pos, meta = make_step([(a + [7], [0, 1], 20), (b, [2, 3], 0)], BS)
    model(ids, pos, caches, meta)
    assert spy.ran == 0
    # with the kernels off
    with ops.disabled():
        ids, pos, meta = make_step([(a + [7, 8], [0, 1], 21)], BS)
        model(ids, pos, caches, meta)
    assert spy.ran == 0


@pytest.mark.parametrize("kind, extra", [("Mistral", {"sliding_window": 8}), ("Qwen3", {})])
def test_models_it_does_not_take(tmp_path, kind, extra):
    _needs_kernel(torch.float32)
    lm = _tiny(tmp_path, torch.float32, kind, **extra)
    assert lm.config.sliding_window == extra.get("sliding_window")
    assert lm.config.qk_norm == (kind == "Qwen3")
    assert lm.model.decode_layers is None  # a window / q and k norms: layer by layer


def test_a_model_not_laid_out_for_the_cpu_runs_layer_by_layer(tmp_path):
    _needs_kernel(torch.float32)
    _tiny(tmp_path, torch.float32)
    assert load_model(str(tmp_path), dtype=torch.float32).model.decode_layers is None  # no pack_for_cpu
