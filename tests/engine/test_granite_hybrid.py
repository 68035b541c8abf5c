"""Granite 4 (GraniteMoeHybridForCausalLM: Mamba2 mixers and NoPE or rotary attention layers,
Granite's four multipliers, a shared MLP beside routed experts or alone) through the model and
the whole engine, against transformers on tiny random checkpoints: logits over chunks split
mid-block and a decode, greedy tokens with caching off and on, chunked and preempted, every block
free afterwards."""

from __future__ import annotations

import pytest
import torch

from prefixkv.model import ModelConfig, load_model
from prefixkv.model.moe import SparseMoeBlock

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import assert_recurrent_engine_matches_transformers
from .test_qwen3_5 import _chunked_logits

MAX_NEW = 8


def make_granite_hybrid(experts: int = 4, position: str | None = None, seed: int = 0, vocab: int = 258):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["linear_attention", "attention", "linear_attention", "attention"],
        num_local_experts=experts,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_expand=2,
        mamba_chunk_size=16,
        position_embedding_type=position,
        embedding_multiplier=3.0,
        residual_multiplier=0.4,
        attention_multiplier=0.2,
        logits_scaling=2.5,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    model = GraniteMoeHybridForCausalLM(config).eval()
    with torch.no_grad():  # a state and attention that matter: larger weights than the init's
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.1)
            elif name.endswith(("A_log", "dt_bias")):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("kind", ["moe", "dense", "rope"])
def test_logits_match_transformers(tmp_path, kind):
    """One prefill in two chunks (the second starting mid-block), then a decode step."""
    hf = make_granite_hybrid(experts=0 if kind == "dense" else 4, position="rope" if kind == "rope" else None)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    config = ModelConfig.from_hf_folder(str(tmp_path))
    assert config.nope_layers == (() if kind == "rope" else (1, 3)) and config.attention_multiplier == 0.2
    model = load_model(str(tmp_path)).model
    assert all(isinstance(layer.mlp, SparseMoeBlock) == (kind != "dense") for layer in model.layers)
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(str(tmp_path), ids), ref, atol=1e-4, rtol=1e-4)


def test_engine_matches_transformers(tmp_path):
    hf = make_granite_hybrid()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    assert_recurrent_engine_matches_transformers(str(tmp_path), hf, MAX_NEW)


def test_refused_by_name():
    base = {"architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="position_embedding_type='alibi'"):
        ModelConfig.from_hf_dict({**base, "position_embedding_type": "alibi", "mamba_n_heads": 4})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**base, "layer_types": ["mamba", "cross"], "mamba_n_heads": 4})


@pytest.mark.parametrize("experts", [4, 0])
def test_gguf_matches_transformers(tmp_path, experts):
    """A GGUF file by llama.cpp's converter rules (GraniteHybridModel): logits, and the engine's
    tokens with experts."""
    from ..model.gguf_convert import write_granite_hybrid_gguf

    hf = make_granite_hybrid(experts=experts, vocab=264)  # the converter pads the vocabulary to a multiple of 8
    path = str(tmp_path / "granite4.gguf")
    write_granite_hybrid_gguf(tmp_path / "granite4.gguf", hf)
    config = load_model(path).config
    assert config.layer_types == ["mamba", "full_attention", "mamba", "full_attention"]
    assert config.nope_layers == (1, 3) and config.num_experts == experts and not config.shared_expert_gated
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(path, ids), ref, atol=1e-4, rtol=1e-4)
    if experts:
        assert_recurrent_engine_matches_transformers(path, hf, MAX_NEW)
