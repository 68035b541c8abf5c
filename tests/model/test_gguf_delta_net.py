"""Qwen3-Next and Qwen3.5 (dense and MoE) as GGUF files written from tiny random transformers
checkpoints by llama.cpp's converter rules (gguf_convert.write_delta_net_gguf: Qwen3-Next's fused
projections split, Qwen3.5's value heads tiled, A as -exp(A_log), centred norms as 1 + w, a
multi-token-prediction block appended): the config read back, logits over chunks split mid-block
equal transformers' on the original checkpoint, greedy tokens through the engine with caching
off and on, chunked and preempted."""

from __future__ import annotations

import pytest
import torch

from prefixkv.model import load_model
from prefixkv.model.config import ModelConfig
from prefixkv.model.gguf_file import GGUFFile
from prefixkv.model.moe import SparseMoeBlock

from ..engine.engine_oracle import assert_recurrent_engine_matches_transformers
from ..engine.test_qwen3_5 import _chunked_logits
from ..engine.test_qwen3_5 import make as make_qwen3_5
from ..engine.test_qwen3_next import make_qwen3_next
from .gguf_convert import write_delta_net_gguf


def make(kind: str):
    return make_qwen3_next() if kind == "qwen3next" else make_qwen3_5(kind)


@pytest.mark.parametrize("kind", ["qwen3next", "dense", "moe"])
def test_gguf_logits_match_transformers(tmp_path, kind):
    hf = make(kind)
    path = str(tmp_path / f"{kind}.gguf")
    write_delta_net_gguf(path, hf, mtp_blocks=0 if kind == "qwen3next" else 1)
    config = ModelConfig.from_gguf_metadata(GGUFFile(path).metadata, {t.name for t in GGUFFile(path).tensors})
    assert config.architecture == type(hf).__name__ and config.num_hidden_layers == 4
    assert config.layer_types == hf.config.layer_types and config.rotary_dim == 4
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    model = load_model(path).model
    if kind == "qwen3next":  # its dense layer (mlp_only_layers) has no router in the file
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [True, True, False, True]
    else:
        assert all(isinstance(layer.mlp, SparseMoeBlock) == (kind == "moe") for layer in model.layers)
    ids = torch.randint(0, 250, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(_chunked_logits(path, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3next", "moe"])
def test_gguf_engine_matches_transformers(tmp_path, kind):
    hf = make(kind)
    path = str(tmp_path / f"{kind}.gguf")
    write_delta_net_gguf(path, hf, mtp_blocks=0 if kind == "qwen3next" else 1)
    assert_recurrent_engine_matches_transformers(path, hf, 8)


def test_gguf_delta_net_refusals():
    p = "qwen35."
    meta = {
        "general.architecture": "qwen35",
        p + "embedding_length": 64,
        p + "attention.head_count": 4,
        p + "attention.head_count_kv": 2,
        p + "attention.key_length": 16,
        p + "block_count": 4,
        p + "feed_forward_length": 96,
        p + "vocab_size": 258,
        p + "ssm.time_step_rank": 4,
        p + "ssm.group_count": 2,
        p + "ssm.state_size": 16,
        p + "ssm.inner_size": 64,
        p + "rope.scaling.type": "linear",
        p + "rope.scaling.factor": 2.0,
    }
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM with rope scaling"):
        ModelConfig.from_gguf_metadata(meta, set())
    with pytest.raises(ValueError, match="without qwen3next.expert_count"):
        next_meta = {k.replace("qwen35", "qwen3next"): v for k, v in meta.items() if "scaling" not in k}
        ModelConfig.from_gguf_metadata({**next_meta, "general.architecture": "qwen3next"}, set())
