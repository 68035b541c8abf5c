"""gpt-oss as tiny random checkpoints (transformers' GptOssForCausalLM, its eager attention with
sinks): loaded from transformers' layout and from OpenAI's MXFP4 experts, the paged forward's
logits over chunks and decodes equal transformers'; MXFP4 dequantized exactly as transformers
dequantizes it; the config's defaults and refusals."""

from __future__ import annotations

import json

import pytest
import torch

from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import ModelConfig, load_model
from prefixkv.model.gpt_oss import dequantize_mxfp4

from .model_helpers import run_logits
from .test_model_hf_folder import VOCAB, _write_tokenizer

BS, POOL = 8, 32


def make_gpt_oss(swiglu_limit: float = 0.6, seed: int = 0):
    """A 4-layer gpt-oss, sliding (window 7) and full layers interleaved, YaRN past a 16-token
    original context, 4 experts (2 a token) whose clamp binds on many values; every parameter
    random, sinks and biases included."""
    import transformers as tf

    cfg = tf.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # a head size the native prefill kernel takes (full layers' sinks run on it)
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=7,
        max_position_embeddings=64,
        swiglu_limit=swiglu_limit,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
        },
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
    )
    torch.manual_seed(seed)
    m = tf.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "sinks" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return m


def paged_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` through the paged path: two chunks (the second after the
    first's cached blocks, past the window), then three decode steps."""
    caches = allocate_kv_cache(model.config, POOL, BS)
    blocks = torch.randperm(POOL, generator=torch.Generator().manual_seed(1))[:6].tolist()
    l1, _ = run_logits(model, caches, [(ids[:19], blocks, 0)], BS)
    l2, _ = run_logits(model, caches, [(ids[:42], blocks, 19)], BS)
    dec = [run_logits(model, caches, [(ids[:n], blocks, n - 1)], BS)[0] for n in (43, 44, 45)]
    return torch.cat([l1, l2, *dec])


def test_gpt_oss_matches_transformers(tmp_path):
    hf = make_gpt_oss()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    lm = load_model(str(tmp_path))
    cfg = lm.config
    assert cfg.attention_sinks and cfg.attention_output_bias and cfg.num_experts == 4
    assert cfg.layer_windows == [7, None, 7, None] and cfg.rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(paged_logits(lm.model, ids), want, atol=1e-4, rtol=1e-4)


def test_the_oracle_sees_sinks_and_the_clamp(tmp_path):
    """The comparison can fail: other sinks, or another clamp, give other logits."""
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    hf = make_gpt_oss()
    with torch.no_grad():
        base = hf(torch.tensor([ids])).logits[0]
        loose = make_gpt_oss(swiglu_limit=50.0)(torch.tensor([ids])).logits[0]
        hf.model.layers[0].self_attn.sinks.add_(1.0)
        sunk = hf(torch.tensor([ids])).logits[0]
    assert (base - loose).abs().max() > 1e-2
    assert (base - sunk).abs().max() > 1e-2


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., G, 16] and scales [..., G] for a matrix [..., G * 32], the scales
    near 2 ** -3 (every code used, the sign bit included)."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 126, (*lead, cols // 32), generator=generator, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(4)
    blocks, scales = random_mxfp4((3, 10, 64), g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 10]: transposed
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 10, 64)
    assert torch.equal(got, want.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), got.bfloat16())  # exact in bfloat16
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks.int(), scales)


def test_mxfp4_checkpoint_matches_transformers(tmp_path):
    """OpenAI's release layout: each layer's experts as MXFP4 blocks and scales, the config's
    quantization_config naming mxfp4; transformers' model holds the same weights dequantized."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = make_gpt_oss()
    cfg = hf.config
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name, p in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            rows, cols = (2 * I, H) if name.endswith("gate_up_proj") else (H, I)
            blocks, scales = random_mxfp4((E, rows, cols), g)
            with torch.no_grad():
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = p.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    d = cfg.to_dict()
    d["architectures"] = ["GptOssForCausalLM"]
    d["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    _write_tokenizer(tmp_path)
    lm = load_model(str(tmp_path))
    ids = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(paged_logits(lm.model, ids), want, atol=1e-4, rtol=1e-4)


def test_config_defaults_and_refusals():
    base = {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
    }
    cfg = ModelConfig.from_hf_dict(base)  # GptOssConfig's defaults
    assert cfg.layer_windows == [128, None, 128] and cfg.head_dim == 64 and cfg.num_experts == 128
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling["factor"] == 32.0 and not cfg.rope_scaling["truncate"]
    assert cfg.num_experts_per_tok == 4 and cfg.swiglu_limit == 7.0 and cfg.rms_norm_eps == 1e-5
    for quant in ("awq", "fp8"):
        with pytest.raises(ValueError, match=f"quant_method '{quant}' is not supported for GptOssForCausalLM"):
            ModelConfig.from_hf_dict({**base, "quantization_config": {"quant_method": quant}})
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is not supported for LlamaForCausalLM"):
        ModelConfig.from_hf_dict(
            {**base, "architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
        )
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})
