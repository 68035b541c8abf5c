"""Qwen3.5 (Qwen3-Next's decoder with the gated delta nets' input projections split in the
checkpoint; dense MLPs, or routed experts in every layer) and its released vision-language
checkpoints served text-only, against transformers' Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and
Qwen3_5ForConditionalGeneration on tiny random checkpoints: logits over chunks split mid-block,
greedy tokens through the engine with caching off and on, chunked and preempted, every block free
after."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from prefixkv import LLM
from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import AttentionMetadata, ModelConfig, load_model
from prefixkv.model.moe import SparseMoeBlock

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import assert_recurrent_engine_matches_transformers

MAX_NEW = 8
TEXT = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    max_position_embeddings=256,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=257,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)


def make(kind: str, tie: bool = False, **overrides):
    """A random Qwen3.5 of `kind` (dense, moe, vl: the dense one under a vision encoder)."""
    import transformers as tf

    torch.manual_seed(0)
    text = {**TEXT, "tie_word_embeddings": tie, **overrides}
    if kind == "dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
    elif kind == "moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text, **EXPERTS))
    else:
        ids = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
        # the outer config's tie_word_embeddings wins over its text config's (as transformers ties)
        text["tie_word_embeddings"] = not tie
        config = tf.Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=tie, **ids)
        model = tf.Qwen3_5ForConditionalGeneration(config)
    model.eval()
    with torch.no_grad():  # an input-dependent state and attention that matter: larger weights than the init's
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if "linear_attn.norm" in name:  # a plain norm weight
                p.normal_(1, 0.1)
            elif "norm" in name:  # zero-centred norms start at 0: make the folded 1 + w count
                p.normal_(0, 0.1)
            elif "in_proj" in name or "out_proj" in name or "q_proj" in name or "k_proj" in name:
                p.normal_(0, 0.2)
    return model


def _save(hf, folder: Path) -> str:
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return str(folder)


def _chunked_logits(folder: str, ids: torch.Tensor) -> torch.Tensor:
    loaded = load_model(folder)
    config, model, bs = loaded.config, loaded.model, 8
    caches = allocate_kv_cache(config, 8, bs)
    table = torch.tensor([[3, 5, 1, 6]])
    got = []
    with torch.no_grad():
        for a, b in ((0, 11), (11, 20), (20, 21)):
            slots = torch.tensor([table[0, p // bs].item() * bs + p % bs for p in range(a, b)])
            meta = AttentionMetadata(slots, [0, b - a], [b], table)
            got.append(model.compute_logits(model(ids[a:b], torch.arange(a, b), caches, meta)))
    return torch.cat(got)


def assert_chunked_logits_match(path: str, hf) -> None:
    """`_chunked_logits` of 21 seeded tokens equal transformers' logits of them."""
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(path, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind, tie", [("dense", False), ("dense", True), ("moe", False), ("vl", False), ("vl", True)])
def test_qwen3_5_logits_match_transformers(tmp_path, kind, tie):
    """One prefill in two chunks (the second starting mid-block), then a decode step."""
    hf = make(kind, tie=tie)
    folder = _save(hf, tmp_path)
    config = ModelConfig.from_hf_folder(folder)
    assert config.tie_word_embeddings == tie and config.rotary_dim == 4
    model = load_model(folder).model
    assert all(isinstance(layer.mlp, SparseMoeBlock) == (kind == "moe") for layer in model.layers)
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(folder, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def vision_language(tmp_path_factory):
    hf = make("vl")
    return hf, _save(hf, tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.mark.parametrize("kind", ["moe", "vl"])
def test_qwen3_5_engine_matches_transformers(tmp_path, vision_language, kind):
    hf, folder = vision_language if kind == "vl" else (make(kind), None)
    assert_recurrent_engine_matches_transformers(folder or _save(hf, tmp_path), hf, MAX_NEW)


def test_vision_language_checkpoint_served_text_only(vision_language, caplog):
    """The vision encoder is left out, said once at load; a request with an image is refused."""
    _, folder = vision_language
    with caplog.at_level(logging.INFO, logger="prefixkv.model.qwen3_5"):
        llm = LLM(folder, dtype="float32", device="cpu", num_blocks=16, block_size=8, max_model_len=64)
    said = [r.getMessage() for r in caplog.records if r.name == "prefixkv.model.qwen3_5"]
    assert len(said) == 1 and "text-only" in said[0] and "vision encoder" in said[0]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    with pytest.raises(ValueError, match="text-only"):
        llm.chat(messages)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_qwen3_5_configs_by_model_type():
    """Each config by its model_type alone; the MoE one routes every layer and renormalises its
    top-k weights whatever its config says (transformers' Qwen3.5 router); the released configs'
    multimodal rotary keys read as the plain rotary."""
    mrope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    mrope |= {"mrope_section": [1, 1, 0], "mrope_interleaved": True}
    dense = ModelConfig.from_hf_dict({**TEXT, "model_type": "qwen3_5_text", "rope_parameters": mrope})
    assert dense.architecture == "Qwen3_5ForCausalLM" and dense.num_experts == 0
    assert dense.rope_theta == 1e7 and dense.rotary_dim == 4 and dense.is_recurrent
    moe = ModelConfig.from_hf_dict(
        {**TEXT, **EXPERTS, "model_type": "qwen3_5_moe_text", "norm_topk_prob": False, "mlp_only_layers": [1]}
    )
    assert moe.architecture == "Qwen3_5MoeForCausalLM" and moe.norm_topk_prob
    assert all(moe.is_moe_layer(i) for i in range(4))
    vl = ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe", "text_config": {**TEXT, **EXPERTS}})
    assert vl.architecture == "Qwen3_5MoeForConditionalGeneration" and vl.num_experts == 4
    with pytest.raises(ValueError, match="attn_output_gate"):  # attention without the output gate
        ModelConfig.from_hf_dict({**TEXT, "model_type": "qwen3_5_text", "attn_output_gate": False})


def test_split_projections_refused_by_name(tmp_path):
    """A delta net layer missing one of its four input projections, or with one of the wrong
    shape, is a ValueError naming it."""
    from safetensors.torch import load_file, save_file

    folder = _save(make("dense"), tmp_path / "base")
    weights = load_file(str(Path(folder) / "model.safetensors"))
    cases = {
        "in_proj_z": {k: v for k, v in weights.items() if k != "model.layers.2.linear_attn.in_proj_z.weight"},
        "in_proj_b.weight of shape": {
            **weights,
            "model.layers.0.linear_attn.in_proj_b.weight": torch.zeros(3, 64),
        },
    }
    for i, (match, broken) in enumerate(cases.items()):
        target = tmp_path / str(i)
        shutil.copytree(folder, target)
        save_file(broken, str(target / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            load_model(str(target))
