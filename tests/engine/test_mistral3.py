"""Ministral 3 (Mistral's decoder with YaRN and Llama 4's query temperature, which is 1 below its
length and is not built: the context stays below it) and Mistral 3's vision-language checkpoints
served text-only (a Mistral or Ministral 3 language model under a Pixtral encoder), against
transformers on tiny random checkpoints: logits over chunks and decodes, greedy tokens through
the engine with caching off and on."""

from __future__ import annotations

import logging

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import ModelConfig, load_model

from ..model.model_helpers import run_logits
from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import hf_generate, serve_and_compare

ORIGINAL = 64  # YaRN's original context, the query temperature's length
TEXT = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4 * ORIGINAL,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=257,
)
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def _randomised(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name or "projector" in name:
                continue
            p.copy_((1.0 if "norm" in name else 0.0) + (0.1 if "norm" in name else 0.08) * torch.randn_like(p))
    return model.eval()


def make(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    text = tf.Ministral3Config(**TEXT, rope_parameters=dict(ROPE))
    if kind == "ministral3":
        return _randomised(tf.Ministral3ForCausalLM(text))
    if kind == "vl-mistral":
        text = tf.MistralConfig(**TEXT)
    vision = tf.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = tf.Mistral3Config(vision_config=vision, text_config=text, image_token_index=250)
    return _randomised(tf.Mistral3ForConditionalGeneration(config))


def _logits(folder: str, ids: list[int]) -> torch.Tensor:
    lm = load_model(folder)
    caches = allocate_kv_cache(lm.config, 32, 8)
    blocks = list(range(1, 7))
    l1, _ = run_logits(lm.model, caches, [(ids[:19], blocks, 0)], 8)
    l2, _ = run_logits(lm.model, caches, [(ids[:42], blocks, 19)], 8)
    dec = [run_logits(lm.model, caches, [(ids[:n], blocks, n - 1)], 8)[0] for n in (43, 44, 45)]
    return torch.cat([l1, l2, *dec])


@pytest.mark.parametrize("kind", ["ministral3", "vl-ministral3", "vl-mistral"])
def test_logits_match_transformers(tmp_path, kind, caplog):
    hf = make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    config = ModelConfig.from_hf_folder(str(tmp_path))
    yarn = kind != "vl-mistral"
    assert config.exact_context == (ORIGINAL if yarn else None)
    assert (config.rope_scaling or {}).get("rope_type") == ("yarn" if yarn else None)
    ids = torch.randint(0, 250, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    with caplog.at_level(logging.INFO, logger="prefixkv.model.vision_language_text"):
        got = _logits(str(tmp_path), ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    said = [r.getMessage() for r in caplog.records if r.name == "prefixkv.model.vision_language_text"]
    assert len(said) == (1 if kind.startswith("vl") else 0) and all("text-only" in m for m in said)


def test_engine_below_the_temperature_length(tmp_path, caplog):
    """Greedy tokens equal transformers' with caching off and on; the context defaults to the
    temperature's length (logged) and a longer one is refused by name."""
    hf = make("ministral3")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    prompts = [[5 + i for i in range(30)] + [100 + j] for j in range(3)]
    with torch.no_grad():
        expected = [hf_generate(hf, p, 6) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = {"dtype": "float32", "device": "cpu", "num_blocks": 32, "block_size": 8}
    with caplog.at_level(logging.INFO):
        for caching in (False, True):
            llm = serve_and_compare(tmp_path, prompts, params, expected, {**kwargs, "enable_prefix_caching": caching})
            assert llm.llm_engine.max_model_len == ORIGINAL
    assert "attention temperature's length" in caplog.text
    with pytest.raises(ValueError, match=r"attention temperature's length \(64 tokens\).*max_model_len <= 64"):
        LLM(str(tmp_path), max_model_len=2 * ORIGINAL, **kwargs)
