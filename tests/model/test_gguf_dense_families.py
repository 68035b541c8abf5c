"""GGUF files of Phi-3, OLMo 2, Granite, SmolLM3, Ernie 4.5, GLM-4 and Llama with attention biases, written from tiny
random transformers checkpoints by llama.cpp's converter rules (gguf_convert.py): the config read
back as llama.cpp reads it (Phi-3's partial rotary and LongRoPE factors, Granite's scales,
SmolLM3's fixed NoPE step, OLMo 2's whole-projection q/k norms), logits over chunks and decodes
equal transformers' on the original checkpoint, greedy tokens through the engine with caching off
and on, and what cannot be honoured refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import load_model
from prefixkv.model.config import ModelConfig

from ..engine.engine_oracle import hf_generate, serve_and_compare
from .gguf_convert import write_gguf
from .model_helpers import run_logits
from .test_model_hf_folder import BS, POOL, VOCAB, _common, _make


def make(kind: str):
    """`_make`'s checkpoints; SmolLM3 with the NoPE step llama.cpp fixes (every 4th layer)."""
    if kind != "smollm3":
        return _make(kind)
    import transformers as tf

    cfg = tf.SmolLM3Config(
        **_common(no_rope_layer_interval=4, num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=None)
    )
    torch.manual_seed(0)
    m = tf.SmolLM3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + (0.1 if "norm" in name else 0.08) * torch.randn_like(p))
    return m


@pytest.mark.parametrize("kind", ["phi3", "olmo2", "granite", "smollm3", "llama-bias", "ernie4_5", "glm4"])
def test_gguf_matches_transformers(tmp_path, kind):
    hf = make(kind)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, hf)
    lm = load_model(str(path))
    cfg = lm.config
    assert cfg.architecture == type(hf).__name__
    if kind == "phi3":
        assert cfg.partial_rotary_factor == 0.75 and cfg.exact_context == 96
        rs = cfg.rope_scaling
        assert rs["rope_type"] == "longrope" and rs["short_factor"] == pytest.approx([1.0 + 0.3 * i for i in range(12)])
        assert rs["factor"] == 256 / 96 and lm.model.rotary.attention_factor > 1
    if kind == "granite":
        multipliers = (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling)
        assert multipliers == pytest.approx((3.0, 0.4, 0.3, 2.5)) and cfg.attention_bias  # float32 in the file
    if kind == "smollm3":
        assert cfg.nope_layers == (3,) and cfg.tie_word_embeddings
    if kind == "olmo2":
        assert not cfg.qk_norm
    if kind == "ernie4_5":  # its rows unpermuted in the file, reordered at load as from an HF folder
        assert cfg.rope_interleaved and cfg.tie_word_embeddings
    if kind == "glm4":
        assert cfg.rope_interleaved and cfg.rotary_dim == 16 and cfg.attention_bias
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (45,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    caches = allocate_kv_cache(cfg, POOL, BS)
    blocks = torch.randperm(POOL, generator=g)[:6].tolist()
    l1, _ = run_logits(lm.model, caches, [(ids[:19], blocks, 0)], BS)
    l2, _ = run_logits(lm.model, caches, [(ids[:42], blocks, 19)], BS)
    dec = [run_logits(lm.model, caches, [(ids[:n], blocks, n - 1)], BS)[0] for n in (43, 44, 45)]
    torch.testing.assert_close(torch.cat([l1, l2, *dec]), ref, atol=1e-4, rtol=1e-4)


def test_gguf_phi3_engine_matches_transformers(tmp_path):
    """Through the engine: Phi-3's fused projections and LongRoPE, caching off and on, chunked;
    the context capped at the original one (the short factors' range)."""
    hf = make("phi3")
    path = tmp_path / "phi3.gguf"
    write_gguf(path, hf)
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(30)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    with torch.no_grad():
        expected = [hf_generate(hf, p, 6) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = {"dtype": "float32", "device": "cpu", "num_blocks": 48, "block_size": 8}
    for setting in (dict(enable_prefix_caching=False), dict(max_num_batched_tokens=9)):
        engine = serve_and_compare(path, prompts, params, expected, {**base, **setting}).llm_engine
        assert engine.max_model_len == 96


# ---------------------------------------------------------------------------------- metadata
def _meta(g_arch: str, **extra) -> dict:
    p = g_arch + "."
    return {
        "general.architecture": g_arch,
        p + "embedding_length": 64,
        p + "attention.head_count": 4,
        p + "attention.head_count_kv": 2,
        p + "block_count": 8,
        p + "feed_forward_length": 96,
        p + "vocab_size": VOCAB,
        p + "context_length": 4096,
        **{p + k: v for k, v in extra.items()},
    }


def test_metadata_read_as_llama_cpp_reads_it():
    smol = ModelConfig.from_gguf_metadata(_meta("smollm3"), set())
    assert smol.nope_layers == (3, 7)
    granite = ModelConfig.from_gguf_metadata(_meta("granite"), set())  # llama.cpp's defaults
    assert granite.attention_multiplier == 16**-0.5 and granite.embedding_multiplier == 1.0
    phi = ModelConfig.from_gguf_metadata(_meta("phi3", **{"attention.sliding_window": 2047}), set())
    assert phi.sliding_window == 2047 and phi.rope_scaling is None and phi.partial_rotary_factor == 1.0
    phi4 = ModelConfig.from_gguf_metadata(_meta("phi3", **{"attention.sliding_window": 0}), set())
    assert phi4.sliding_window is None


@pytest.mark.parametrize(
    "meta, names, match",
    [
        (_meta("olmo2", **{"attention.sliding_window": 4096}), set(), "OLMo 3's sliding layers"),
        (_meta("olmo2"), {"blk.0.attn_q.bias"}, "olmo2 with attention biases"),
        (_meta("phi3", **{"rope.scaling.attn_factor": 1.19}), set(), "attn_factor without LongRoPE"),
        (_meta("phi3"), {"blk.0.attn_qkv.bias"}, "attention biases"),
        (_meta("granite", **{"rope.dimension_count": 8}), set(), "partial rotary"),
    ],
)
def test_metadata_refused_by_name(meta, names, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(meta, names)
