"""gpt-oss as GGUF files written from tiny random transformers checkpoints by llama.cpp's converter
rules (gguf_convert.py: float32 experts with gate and up apart or fused, and OpenAI's MXFP4 experts
repacked as ggml's MXFP4): the config read back as llama.cpp reads it, the paged forward's logits
equal transformers' on the original checkpoint, greedy tokens through the engine equal with
caching off and on, chunked and preempted; YaRN read generically, and what cannot be honoured
refused by name."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.model import load_model
from prefixkv.model.config import ModelConfig
from prefixkv.model.gguf_file import GGUFFile
from prefixkv.model.layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION

from ..engine.engine_oracle import hf_generate, serve_and_compare
from .gguf_convert import write_gguf
from .test_model_gpt_oss import VOCAB, make_gpt_oss, paged_logits, random_mxfp4


def mxfp4_experts(hf) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every expert matrix of `hf` replaced by random MXFP4 values (dequantized as transformers
    dequantizes them); transformers' name -> OpenAI's (blocks, scales)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = hf.config
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(5)
    packed = {}
    for name, p in hf.state_dict(keep_vars=True).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows, cols = (2 * I, H) if name.endswith("gate_up_proj") else (H, I)
            blocks, scales = random_mxfp4((E, rows, cols), g)
            with torch.no_grad():
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[name] = (blocks.numpy(), scales.numpy())
    return packed


def written(tmp_path, layout: str, seed: int = 0):
    """(transformers model, GGUF path) for `layout`: split / fused float32 experts, or mxfp4."""
    hf = make_gpt_oss(seed=seed)
    packed = mxfp4_experts(hf) if layout == "mxfp4" else None
    path = tmp_path / f"gpt-oss-{layout}.gguf"
    write_gguf(path, hf, fused_gate_up=layout == "fused", mxfp4=packed)
    return hf, path


@pytest.mark.parametrize("layout", ["split", "fused", "mxfp4"])
def test_gguf_gpt_oss_logits_match_transformers(tmp_path, layout):
    hf, path = written(tmp_path, layout)
    if layout == "mxfp4":
        types = {t.name: t.tensor_type.name for t in GGUFFile(str(path)).tensors}
        assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    lm = load_model(str(path))
    cfg = lm.config
    assert cfg.architecture == "GptOssForCausalLM" and cfg.attention_sinks and cfg.attention_output_bias
    assert cfg.layer_windows == [7, None, 7, None] and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    }
    assert cfg.swiglu_limit == 7.0  # llama.cpp's fixed clamp, whatever the checkpoint said
    ids = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    hf.config.swiglu_limit = 7.0
    for layer in hf.model.layers:
        layer.mlp.experts.limit = 7.0
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(paged_logits(lm.model, ids), want, atol=1e-4, rtol=1e-4)


def test_gguf_gpt_oss_mxfp4_experts_load_exactly(tmp_path):
    """ggml's MXFP4 blocks dequantize to the very values of OpenAI's (both are exact)."""
    hf, path = written(tmp_path, "mxfp4")
    experts = load_model(str(path)).model.layers[1].mlp.experts
    src = hf.model.layers[1].mlp.experts
    I = hf.config.intermediate_size
    gate_up = src.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], gate and up interleaved
    assert torch.equal(experts.gate_up_weight[:, :I], gate_up[:, 0::2])
    assert torch.equal(experts.gate_up_weight[:, I:], gate_up[:, 1::2])
    assert torch.equal(experts.down_weight, src.down_proj.detach().transpose(1, 2))


def test_gguf_gpt_oss_engine_matches_transformers(tmp_path):
    hf, path = written(tmp_path, "mxfp4", seed=1)
    hf.config.swiglu_limit = 7.0
    for layer in hf.model.layers:
        layer.mlp.experts.limit = 7.0
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(30)]  # past the window of 7
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    max_new = 6
    with torch.no_grad():
        expected = [hf_generate(hf, p, max_new) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    base = {"dtype": "float32", "device": "cpu", "num_blocks": 64, "block_size": 8, "max_model_len": 64}
    for setting in (
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=9),  # chunked, after cached context
        dict(num_blocks=9, disable_hybrid_kv_cache_manager=True),  # two fit only sharing the prefix
    ):
        engine = serve_and_compare(path, prompts, params, expected, {**base, **setting}).llm_engine
        if setting.get("num_blocks") == 9:
            assert engine.scheduler.num_preemptions > 0


# ---------------------------------------------------------------------------------- metadata
def _meta(**extra) -> dict:
    p = "gpt-oss."
    return {
        "general.architecture": "gpt-oss",
        p + "embedding_length": 64,
        p + "attention.head_count": 4,
        p + "attention.head_count_kv": 2,
        p + "attention.key_length": 32,
        p + "block_count": 3,
        p + "feed_forward_length": 32,
        p + "expert_feed_forward_length": 32,
        p + "expert_count": 8,
        p + "expert_used_count": 2,
        p + "vocab_size": VOCAB,
        p + "attention.sliding_window": 128,
        p + "rope.freq_base": 150000.0,
        **{p + k: v for k, v in extra.items()},
    }


NAMES = {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.weight", "blk.0.attn_q.bias", "output.weight"}


def test_gpt_oss_metadata_read_as_llama_cpp_reads_it():
    cfg = ModelConfig.from_gguf_metadata(_meta(), NAMES)
    assert cfg.layer_types == [SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION]
    assert cfg.sliding_window == 128 and cfg.rope_scaling is None and cfg.attention_bias
    assert cfg.moe_intermediate_size == 32 and cfg.swiglu_alpha == 1.702 and not cfg.tie_word_embeddings


@pytest.mark.parametrize(
    "meta, names, match",
    [
        (_meta(), NAMES - {"blk.0.attn_sinks.weight"}, "without blk.0.attn_sinks.weight"),
        (_meta(expert_count=0), NAMES, "expert_count"),
        (
            _meta(**{"rope.scaling.type": "yarn", "rope.scaling.factor": 32.0}),
            NAMES,
            "without gpt-oss.rope.scaling.original_context_length",
        ),
        (
            _meta(
                **{
                    "rope.scaling.type": "yarn",
                    "rope.scaling.factor": 32.0,
                    "rope.scaling.original_context_length": 4096,
                    "rope.scaling.yarn_attn_factor": 1.2,
                }
            ),
            NAMES,
            "yarn_attn_factor",
        ),
        (_meta(**{"rope.scaling.type": "longrope"}), NAMES, "rope scaling type 'longrope'"),
    ],
)
def test_gpt_oss_metadata_refused_by_name(meta, names, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(meta, names)


def test_yarn_in_other_families_keeps_llama_cpp_rounding():
    """A Qwen3 file with YaRN: transformers' default rounding of the correction range, which is
    llama.cpp's (only gpt-oss, whose release says otherwise, leaves it unrounded)."""
    p = "qwen3."
    meta = {
        "general.architecture": "qwen3",
        p + "embedding_length": 64,
        p + "attention.head_count": 4,
        p + "attention.head_count_kv": 2,
        p + "block_count": 2,
        p + "feed_forward_length": 96,
        p + "vocab_size": VOCAB,
        p + "context_length": 131072,
        p + "rope.scaling.type": "yarn",
        p + "rope.scaling.factor": 4.0,
        p + "rope.scaling.original_context_length": 32768,
    }
    cfg = ModelConfig.from_gguf_metadata(meta, {"blk.0.attn_q_norm.weight"})
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert cfg.rope_scaling.get("truncate", True)
