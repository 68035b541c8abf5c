"""Routed experts laid out for the CPU's kernels (model/packed_experts.py): after
LlamaModel.pack_for_cpu every experts module (Qwen3-MoE's, gpt-oss's biased and clamped ones) is a
PackedExperts of the layout the dense layers got - or oneDNN's alone where a second copy of the
experts would not fit - its 3-D parameters gone, the model's weight digest unchanged, and its
logits those of the plain experts within float32's rounding."""

from __future__ import annotations

import pytest
import torch

from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import load_model
from prefixkv.model.kernels import ops
from prefixkv.model.layers import DualLayoutLinear, PackedLinear, packed_linear_works
from prefixkv.model.packed_experts import PackedExperts
from prefixkv.tiers.namespace import weights_digest

from .model_helpers import run_logits
from .test_model_gpt_oss import make_gpt_oss
from .test_model_hf_folder import _write_tokenizer
from .test_model_moe import make_moe


def _folder(kind: str, tmp_path) -> str:
    hf = make_gpt_oss() if kind == "gpt_oss" else make_moe("qwen3_moe")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    return str(tmp_path)


@pytest.mark.skipif(not packed_linear_works(torch.float32), reason="oneDNN's packed layout is not in this torch")
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("experts_fit", [True, False])
def test_packed_experts_equal_the_plain_ones(tmp_path, monkeypatch, kind, experts_fit):
    from prefixkv.model import llama, packed_experts

    monkeypatch.setattr(packed_experts, "time_one_expert", lambda experts, kind: (1.0, 0.5))  # the layout pays
    folder = _folder(kind, tmp_path)
    plain, packed = load_model(folder), load_model(folder)
    digest = weights_digest(packed.model)
    if not experts_fit:  # the dense layers' second copy fits, the experts' does not
        dense = sum(m.weight.numel() * 4 for m in packed.model.layers.modules() if isinstance(m, torch.nn.Linear))
        monkeypatch.setattr(llama, "keeps_two_layouts", lambda size, native: size <= dense)
    assert packed.model.pack_for_cpu()
    experts = [layer.mlp.experts for layer in packed.model.layers]
    assert all(isinstance(e, PackedExperts) for e in experts)
    assert not any(p.dim() == 3 for p in packed.model.parameters())  # the 3-D parameters given back
    assert weights_digest(packed.model) == digest
    dual = isinstance(packed.model.layers[0].self_attn.qkv_proj, DualLayoutLinear)
    want = DualLayoutLinear if dual and experts_fit else PackedLinear
    assert all(isinstance(m, want) for e in experts for m in (*e.gate_up, *e.down))
    ids = list(range(40, 60))
    out = []
    for lm in (plain, packed):
        caches = allocate_kv_cache(lm.config, 8, 8)
        steps = [(18, 0), (19, 18), (20, 18)]  # (tokens so far, of which cached): a prefill, decodes
        out.append(torch.cat([run_logits(lm.model, caches, [(ids[:n], [3, 1, 6], c)], 8)[0] for n, c in steps]))
    torch.testing.assert_close(out[1], out[0], atol=2e-5, rtol=1e-4)


def test_native_kernels_off_still_run_the_packed_experts(tmp_path, monkeypatch):
    """With the native kernels switched off after packing (ops.disabled), the experts' products
    fall back as the dense layers' do."""
    from prefixkv.model import packed_experts

    monkeypatch.setattr(packed_experts, "time_one_expert", lambda experts, kind: (1.0, 0.5))
    folder = _folder("qwen3_moe", tmp_path)
    plain, packed = load_model(folder), load_model(folder)
    if not packed.model.pack_for_cpu():
        pytest.skip("nothing to lay out on this CPU")
    assert all(isinstance(layer.mlp.experts, PackedExperts) for layer in packed.model.layers)
    ids = list(range(40, 58))
    out = []
    for lm in (plain, packed):
        caches = allocate_kv_cache(lm.config, 8, 8)
        with ops.disabled():
            out.append(run_logits(lm.model, caches, [(ids, [3, 1, 6], 0)], 8)[0])
    torch.testing.assert_close(out[1], out[0], atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not packed_linear_works(torch.float32), reason="oneDNN's packed layout is not in this torch")
def test_experts_stay_plain_where_their_layout_times_slower(tmp_path, monkeypatch, caplog):
    """The layout is kept only where one expert's products ran faster in it here (timed against
    F.linear on the plain parameters, whose candidate gives the same products); else the experts
    stay as they are, said once."""
    import logging

    from prefixkv.model import packed_experts
    from prefixkv.model.moe import Experts

    folder = _folder("qwen3_moe", tmp_path)
    lm = load_model(folder)
    experts = lm.model.layers[0].mlp.experts
    plain_ms, packed_ms = packed_experts.time_one_expert(experts, PackedLinear)
    assert plain_ms > 0 and packed_ms > 0
    candidate = packed_experts.PackedExperts(experts.expert_products(count=1), PackedLinear, {})
    assert candidate.num_experts == 1
    x = torch.randn(5, lm.config.hidden_size)
    torch.testing.assert_close(candidate._one(x, 0), experts._one(x, 0), atol=1e-5, rtol=1e-4)
    monkeypatch.setattr(packed_experts, "time_one_expert", lambda experts, kind: (0.5, 1.0))
    with caplog.at_level(logging.INFO, logger="prefixkv.model.packed_experts"):
        assert lm.model.pack_for_cpu()
    assert all(isinstance(layer.mlp.experts, Experts) for layer in lm.model.layers)
    said = [r.getMessage() for r in caplog.records if r.name == "prefixkv.model.packed_experts"]
    assert len(said) == 1 and "kept as plain parameters" in said[0]
