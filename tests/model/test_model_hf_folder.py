"""Tiny random Llama / Mistral / Qwen2 / Qwen3 saved as HF folders, loaded by our loader,
compared with transformers' forward."""

import json
from pathlib import Path

import pytest
import torch

from bench.byte_tokenizer import write_byte_tokenizer
from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import ModelConfig, build_model, load_model

from .model_helpers import run_logits

BS = 8
POOL = 32
VOCAB = 300


def _write_tokenizer(folder):
    write_byte_tokenizer(Path(folder))


def _common(**kw):
    d = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # < the 45-token test sequences: exercises the rotary cache growing on demand
        max_position_embeddings=32,
        bos_token_id=256,
        eos_token_id=257,
    )
    d.update(kw)
    return d


def _make(kind, **extra):
    import transformers as tf

    if kind == "llama":
        cfg = tf.LlamaConfig(**_common(rope_theta=5000.0, **extra))
        cls = tf.LlamaForCausalLM
    elif kind == "llama3-rope-tied":
        cfg = tf.LlamaConfig(
            **_common(
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            )
        )
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(**_common(head_dim=32, sliding_window=None))
        cls = tf.MistralForCausalLM
    elif kind == "mistral-swa":  # a sliding window shorter than every step below
        cfg = tf.MistralConfig(**_common(head_dim=32, sliding_window=7))
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**_common(num_key_value_heads=1))
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**_common(head_dim=24))
        cls = tf.Qwen3ForCausalLM
    elif kind == "smollm3":  # NoPE every 2nd layer (no rotary there), tied embeddings
        cfg = tf.SmolLM3Config(
            **_common(no_rope_layer_interval=2, num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=None)
        )
        cls = tf.SmolLM3ForCausalLM
    elif kind == "granite":  # its four multipliers, tied embeddings, biases on the attention projections
        cfg = tf.GraniteConfig(
            **_common(
                embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5,
                tie_word_embeddings=True, attention_bias=True,
            )
        )  # fmt: skip
        cls = tf.GraniteForCausalLM
    elif kind == "olmo2":  # post-norm blocks, q/k normed over their whole projections
        cfg = tf.Olmo2Config(**_common(pad_token_id=None))
        cls = tf.Olmo2ForCausalLM
    elif kind == "phi3":  # fused q/k/v and gate/up, rotary over 3/4 of each head, LongRoPE (short factors)
        rotary_half = int(32 * 0.75) // 2
        longrope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.3 * i for i in range(rotary_half)],
            "long_factor": [2.0 + i for i in range(rotary_half)],
        }
        cfg = tf.Phi3Config(  # head size hidden / heads = 32 (Phi-3 reads no head_dim)
            **_common(num_attention_heads=2, num_key_value_heads=1, pad_token_id=None, max_position_embeddings=256),
            original_max_position_embeddings=96,
            rope_parameters=longrope,
        )
        cls = tf.Phi3ForCausalLM
    elif kind == "olmo3":  # OLMo 2's block, sliding (window 24) and full layers in turn, the full ones on YaRN
        kinds = ["sliding_attention", "full_attention"] * 2  # (two of each: two KV-cache groups)
        cfg = tf.Olmo3Config(
            **_common(pad_token_id=None, num_hidden_layers=4, sliding_window=24, layer_types=kinds),
            rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
        )
        cls = tf.Olmo3ForCausalLM
    elif kind == "ernie4_5":  # the interleaved rotary (pairs 2i, 2i + 1), tied embeddings
        cfg = tf.Ernie4_5Config(**_common(head_dim=32, tie_word_embeddings=True, pad_token_id=None))
        cls = tf.Ernie4_5ForCausalLM
    elif kind == "glm4":  # sandwich norms, q/k/v biases, the interleaved rotary over half of each head
        cfg = tf.Glm4Config(**_common(head_dim=32, pad_token_id=None))
        cls = tf.Glm4ForCausalLM
    elif kind == "llama-bias":  # attention_bias: q/k/v and the output projection
        cfg = tf.LlamaConfig(**_common(attention_bias=True))
        cls = tf.LlamaForCausalLM
    elif kind == "qwen3-yarn":  # YaRN past a 16-token original context, its ramp untruncated
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
        cfg = tf.Qwen3Config(**_common(head_dim=24, rope_parameters=dict(yarn, truncate=False, beta_fast=16.0)))
        cls = tf.Qwen3ForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(0)
    m = cls(cfg).eval()
    with torch.no_grad():  # randomize everything, incl. biases and norm weights
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return m


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        "llama3-rope-tied",
        "llama-bias",
        "mistral",
        "mistral-swa",
        "qwen2",
        "qwen3",
        "qwen3-yarn",
        "smollm3",
        "granite",
        "olmo2",
        "olmo3",
        "phi3",
        "ernie4_5",
        "glm4",
    ],
)
def test_hf_folder_matches_transformers(tmp_path, kind):
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True, **({"max_shard_size": "60KB"} if kind == "llama" else {}))
    _write_tokenizer(tmp_path)
    if kind == "llama":
        assert (tmp_path / "model.safetensors.index.json").exists()  # sharded
    lm = load_model(str(tmp_path))
    cfg = lm.config
    if kind == "qwen2":
        assert cfg.attention_bias and hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if kind == "qwen3-yarn":
        assert cfg.rope_scaling["rope_type"] == "yarn" and lm.model.rotary.attention_factor > 1
    if kind == "olmo3":
        assert cfg.layer_windows == [24, None, 24, None] and cfg.rope_scaling["rope_type"] == "yarn"
        assert lm.model.local_rotary is not None
    if kind == "smollm3":
        assert cfg.nope_layers == (1, 3) and cfg.tie_word_embeddings
    if kind == "ernie4_5":
        assert cfg.rope_interleaved and cfg.tie_word_embeddings
    if kind == "glm4":
        assert cfg.rope_interleaved and cfg.rotary_dim == 16 and cfg.attention_bias
    if kind == "llama-bias":
        assert cfg.attention_output_bias and hf.model.layers[0].self_attn.o_proj.bias is not None
    if kind.startswith("qwen3"):
        assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 24
    if kind == "llama3-rope-tied":
        assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.sliding_window == {"mistral-swa": 7, "olmo3": 24}.get(kind)
    assert cfg.eos_token_id == [257] and lm.tokenizer.eos_token_ids == {257}

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (45,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    caches = allocate_kv_cache(cfg, POOL, BS)
    blocks = torch.randperm(POOL, generator=g)[:6].tolist()
    # two chunks (second attends to the first's cached blocks) + 3 decode steps
    l1, _ = run_logits(lm.model, caches, [(ids[:19], blocks, 0)], BS)
    l2, _ = run_logits(lm.model, caches, [(ids[:42], blocks, 19)], BS)
    dec = [run_logits(lm.model, caches, [(ids[:n], blocks, n - 1)], BS)[0] for n in (43, 44, 45)]
    ours = torch.cat([l1, l2] + dec)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_sliding_window_batched_steps_match_transformers(tmp_path):
    """Window 7: a decode batch of sequences of different lengths (each reads only its last 7
    positions) and a chunk after cached context, in one step, equal transformers per sequence."""
    hf = _make("mistral-swa")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    lm = load_model(str(tmp_path))
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (30, 12, 5, 21)]
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    caches = allocate_kv_cache(lm.config, POOL, BS)
    tables = torch.randperm(POOL, generator=g)[:16].view(4, 4).tolist()
    # step 1: prefill all but the last token (or the last 9 for sequence 3, as a later chunk)
    cut = [len(s) - 1 for s in seqs[:3]] + [12]
    run_logits(lm.model, caches, [(s[:c], t, 0) for s, t, c in zip(seqs, tables, cut)], BS)
    # step 2: three decodes and one 9-token chunk after 12 cached tokens, together
    out, rows = run_logits(lm.model, caches, [(s, t, c) for s, t, c in zip(seqs, tables, cut)], BS)
    for ref, a, b, s, c in zip(refs, rows[:-1], rows[1:], seqs, cut):
        torch.testing.assert_close(out[a:b], ref[c : len(s)], atol=1e-4, rtol=1e-4)


def test_mixed_sliding_window_layers_are_read_per_layer():
    base = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
    )
    mixed = ModelConfig.from_hf_dict(dict(base, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert mixed.layer_windows == [None, 8]
    off = ModelConfig.from_hf_dict(dict(base, use_sliding_window=False, sliding_window=8))
    assert off.sliding_window is None and off.layer_windows == [None, None]
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_hf_dict(dict(base, architectures=["LlamaForCausalLM"], layer_types=["sliding_attention"] * 2))


def test_build_model_random_init():
    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        qk_norm=True,
    )
    m = build_model(cfg, torch.float32, "cpu")
    caches = allocate_kv_cache(cfg, 4, 4)
    logits, _ = run_logits(m, caches, [([1, 2, 3, 4, 5], [2, 0], 0)], 4)
    assert logits.shape == (5, 50) and torch.isfinite(logits).all() and logits.abs().sum() > 0
    # the cache really holds the K/V written through slot_mapping: block 2 full, block 0 slot 0
    assert caches[0][:, 2].abs().sum() > 0 and caches[0][:, 0, 0].abs().sum() > 0
    assert caches[0][:, 0, 1:].abs().sum() == 0 and caches[0][:, 1].abs().sum() == 0


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": 10,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 16,
            }
        )
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(tmp_path))


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    hf = _make("llama")
    hf.config.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"nope")
    with pytest.raises(ValueError, match="x.bin"):
        load_model(str(bad))


def test_config_old_style_rope_and_eos_list():
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 16,
            "rope_theta": 500000.0,
            "eos_token_id": [5, 6],
            "bos_token_id": 4,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert cfg.rope_theta == 500000.0 and cfg.eos_token_id == [5, 6] and cfg.head_dim == 4
    assert cfg.rope_scaling["rope_type"] == "llama3"
    new = ModelConfig.from_hf_dict(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 16,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        }
    )
    assert new.rope_theta == 1e6 and new.rope_scaling is None and new.attention_bias
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 16,
                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
            }
        )


def test_yarn_rotary_matches_transformers():
    """YaRN's frequencies and attention factor as transformers computes them: the original context
    from the scaling or the config's top level, a null factor from the two lengths (DeepSeek-V3),
    mscale / mscale_all_dim, a given attention factor, a truncated or untruncated ramp."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from prefixkv.model.layers import rope_attention_factor, rope_inv_freq

    base = {"vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 32}
    cases = [
        ({"factor": 4.0, "original_max_position_embeddings": 4096}, {"max_position_embeddings": 16384}),
        ({"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}, {"max_position_embeddings": 4096}),
        ({"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}, {"original_max_position_embeddings": 4096}),
        ({"factor": None, "original_max_position_embeddings": 4096}, {"max_position_embeddings": 163840}),
        ({"factor": 2.0, "attention_factor": 1.25, "original_max_position_embeddings": 100}, {}),
    ]
    for scaling, top in cases:
        params = {"rope_type": "yarn", "rope_theta": 50000.0, **scaling}
        hf_cfg = tf.Qwen3Config(**base, intermediate_size=16, rope_parameters=dict(params), **top)
        want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        d = {"architectures": ["Qwen3ForCausalLM"], **base, "intermediate_size": 16, "rope_parameters": params, **top}
        cfg = ModelConfig.from_hf_dict(d)
        torch.testing.assert_close(rope_inv_freq(cfg), want_freq, rtol=1e-6, atol=0)
        assert rope_attention_factor(cfg) == pytest.approx(want_factor, rel=1e-12), scaling
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, intermediate_size=16,
            rope_scaling={"rope_type": "yarn", "factor": 2.0},
        )  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu(tmp_path):
    hf = _make("qwen3")
    hf.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    cpu = load_model(str(tmp_path))
    gpu = load_model(str(tmp_path), device="cuda")
    ids = list(range(20))
    out = []
    for lm, dev in ((cpu, "cpu"), (gpu, "cuda")):
        caches = allocate_kv_cache(lm.config, 8, 4, device=dev)
        a, _ = run_logits(lm.model, caches, [(ids[:9], [5, 1, 3, 7, 0], 0)], 4)
        b, _ = run_logits(lm.model, caches, [(ids, [5, 1, 3, 7, 0], 9)], 4)
        out.append(torch.cat([a, b]).cpu())
    torch.testing.assert_close(out[0], out[1], atol=1e-3, rtol=1e-3)
