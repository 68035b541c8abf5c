"""Gemma 4 (transformers' Gemma4ForCausalLM, and Gemma4ForConditionalGeneration served text-only)
against transformers on tiny random checkpoints of its shapes: the small ones' (per-layer inputs,
KV-shared layers reading earlier layers' K/V, their MLPs twice as wide), the large ones' (full
layers whose values are their keys, with fewer K/V heads), the mixture of experts' (routed experts
beside each dense MLP) and the multimodal release's layout. Logits over chunks and decodes, greedy
tokens through the engine with caching off and on, chunked and preempted, every block free; the
KV-shared layers over the sampled rows alone; the cache's per-layer tensors; a disk tier and the
stage-output cache; the settings that are not built, refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixkv import LLM, SamplingParams
from prefixkv.memory.block_tensors import KV_PREFIX, BlockTensors, kv_cache_specs
from prefixkv.memory.kv_groups import plan_kv_groups
from prefixkv.model import ModelConfig, load_model

from ..conftest import hf_greedy
from ..model.gguf_convert import write_gemma4_gguf
from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import assert_disk_tier_and_stage_outputs, assert_engine_matches_transformers, serve_and_compare
from .test_mistral3 import _logits

S, F = "sliding_attention", "full_attention"
TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=256, bos_token_id=256,
    eos_token_id=257, pad_token_id=0, sliding_window=8, layer_types=[S, S, F, S, S, F],
    final_logit_softcapping=30.0,
)  # fmt: skip
SMALL = dict(  # E2B / E4B: per-layer inputs, the last two layers reading layers 3 (sliding) and 2 (full)
    TEXT, vocab_size_per_layer_input=300, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
    use_double_wide_mlp=True,
)  # fmt: skip
LARGE = dict(TEXT, hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1)  # 31B
# 26B-A4B: 8 experts top 2 of width 24 beside every layer's dense MLP
MOE = dict(LARGE, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24)
KINDS = {"small": SMALL, "large": LARGE, "moe": MOE, "multimodal": SMALL}


def make_gemma4(kind: str = "small"):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "multimodal":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16)  # fmt: skip
        audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32)
        config = tf.Gemma4Config(text_config=KINDS[kind], vision_config=vision, audio_config=audio)
        model = tf.Gemma4ForConditionalGeneration(config).eval()
    else:
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**KINDS[kind])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name or kind != "multimodal":
                around_one = "norm" in name or "scale" in name  # norms, the router's scales
                p.copy_((1.0 if around_one else 0.0) + (0.1 if around_one else 0.08) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model


def assert_logits_match(hf, model: str, seed: int) -> None:
    """The engine's model at `model` (an HF folder or a GGUF file) gives transformers' logits over
    chunks split mid-block and decodes."""
    ids = torch.randint(0, 250, (45,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["small", "large", "moe", "multimodal"])
def test_logits_match_transformers(tmp_path, kind):
    hf = make_gemma4(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    config = ModelConfig.from_hf_folder(str(tmp_path))
    assert (config.head_dim, config.global_head_dim) == (16, 32)
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    small = kind in ("small", "multimodal")
    assert config.per_layer_input_size == (8 if small else 0) and config.num_kv_shared_layers == (2 if small else 0)
    assert config.global_num_key_value_heads == (2 if small else 1) and config.global_values_are_keys == (not small)
    assert [config.kv_source_layer(i) for i in range(6)] == ([0, 1, 2, 3, 3, 2] if small else list(range(6)))
    assert (config.num_experts, config.num_experts_per_tok) == ((8, 2) if kind == "moe" else (0, 0))
    assert_logits_match(hf, str(tmp_path), 2)


@pytest.mark.parametrize("kind", ["small", "large", "moe"])
def test_engine_matches_transformers(tmp_path, kind):
    assert_engine_matches_transformers(tmp_path, make_gemma4(kind), f"gemma4-{kind}", 8)


def test_kv_shared_layers_run_the_sampled_rows_alone(tmp_path):
    """The KV-shared layers write no K/V, so a prefill runs them for each sampled request's last
    row alone (AttentionMetadata.output_rows) - a prompt chunk that samples nothing for no row -
    with the tokens transformers gives; where every row is read (prompt logprobs) for every row."""
    hf = make_gemma4("small")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_blocks=32, block_size=8, max_num_batched_tokens=24)
    rows: dict[int, list[int]] = {3: [], 4: []}
    model = llm.llm_engine.runner.model
    for i in rows:
        model.layers[i].register_forward_pre_hook(lambda _, args, i=i: rows[i].append(args[0].shape[0]))
    prompts = [list(range(5, 25)), list(range(40, 53))]  # 20 + 13 tokens: a chunk of 24, then the rest
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [hf_greedy(hf, p, 3) for p in prompts]
    # the first step: 20 + 4 prompt rows, the first prompt's last sampled; then the second's 9 beside
    # a decode of the first, both sampled; then decodes
    assert rows[3] == [24, 10, 2, 1] and rows[4] == [1, 2, 2, 1]
    rows[3].clear(), rows[4].clear()
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
    llm.generate([list(range(60, 75))], scored, use_tqdm=False)
    assert rows[4] == rows[3] == [15]
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def test_cache_holds_each_layer_in_its_own_shape(tmp_path):
    """A KV-shared layer has no tensor of its own (its source's is handed to it); full layers hold
    their own heads and head size; no KV-cache groups (a group's tensors hold one shape)."""
    hf = make_gemma4("small")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = ModelConfig.from_hf_folder(str(tmp_path))
    specs = {s.name: s.shape_per_block for s in kv_cache_specs(config, 8, torch.float32)}
    sliding, full = (2, 8, 2, 16), (2, 8, 2, 32)
    assert specs == {f"{KV_PREFIX}{i}": full if i == 2 else sliding for i in range(4)}
    assert not config.uniform_kv_layers and plan_kv_groups(config) is None
    tensors = BlockTensors(kv_cache_specs(config, 8, torch.float32))
    tensors.allocate(4, "cpu")
    caches = tensors.layer_caches(config, 8)
    assert [c.data_ptr() for c in caches] == [tensors.tensors[f"{KV_PREFIX}{j}"].data_ptr() for j in (0, 1, 2, 3, 3, 2)]
    assert tensors.bytes_per_block == 4 * 8 * 2 * (3 * 16 + 32) * 2


def test_released_form_of_the_config_and_checkpoint(tmp_path):
    """The released config.json names the full layers' shape with global_head_dim and
    num_global_key_value_heads (not transformers 5's per_layer_config), and the checkpoints keep
    K/V projections and norms for the KV-shared layers, which are not used: the same logits."""
    hf = make_gemma4("small")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    saved_form = ModelConfig.from_hf_folder(str(tmp_path))
    path = tmp_path / "config.json"
    d = json.loads(path.read_text())
    del d["per_layer_config"]
    d.update(global_head_dim=32, num_global_key_value_heads=1)  # unused: attention_k_eq_v is false
    path.write_text(json.dumps(d))
    assert ModelConfig.from_hf_folder(str(tmp_path)) == saved_form
    # transformers pads the layer indices it keys per_layer_config by ("05" among ten or more layers)
    padded = dict(d, per_layer_config={"02": {"head_dim": 32}, "05": {"head_dim": 32}})
    path.write_text(json.dumps(padded))
    assert ModelConfig.from_hf_folder(str(tmp_path)) == saved_form
    path.write_text(json.dumps(dict(d, per_layer_config={"02": {"head_dim": 32}})))  # layer 5 left at 16
    with pytest.raises(ValueError, match="per_layer_config"):
        ModelConfig.from_hf_folder(str(tmp_path))
    path.write_text(json.dumps(d))
    weights = load_file(tmp_path / "model.safetensors")
    for layer, head in ((4, 16), (5, 32)):  # a sliding and a full layer
        for name, shape in (("k_proj", (2 * head, 64)), ("v_proj", (2 * head, 64)), ("k_norm", (head,))):
            weights[f"model.layers.{layer}.self_attn.{name}.weight"] = torch.randn(shape)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert_logits_match(hf, str(tmp_path), 3)


@pytest.mark.parametrize("kind", ["small", "large", "moe"])
def test_gguf_files_match_transformers(tmp_path, kind):
    """GGUF files written by llama.cpp's converter rules (gguf_convert.write_gemma4_gguf): the
    config read back as llama.cpp reads it, logits equal transformers', greedy tokens through the
    engine with caching off and on."""
    hf = make_gemma4(kind)
    path = tmp_path / f"gemma4-{kind}.gguf"
    write_gemma4_gguf(path, hf)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    _write_tokenizer(tmp_path / "hf")
    want = ModelConfig.from_hf_folder(str(tmp_path / "hf"))
    got = load_model(str(path)).config
    for field in ("layer_types", "global_head_dim", "global_num_key_value_heads", "global_values_are_keys",
                  "num_kv_shared_layers", "double_wide_shared_mlp", "per_layer_input_size", "rope_scaling",
                  "rope_local_theta", "num_experts", "final_logit_softcapping", "sliding_window"):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field
    assert_logits_match(hf, str(path), 4)
    prompts = [list(range(30, 60)), list(range(30, 60)) + [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [hf_greedy(hf, p, 5) for p in prompts]
    for caching in (False, True):
        kwargs = dict(dtype="float32", device="cpu", num_blocks=32, block_size=8, enable_prefix_caching=caching)
        serve_and_compare(path, prompts, params, expected, kwargs)


def test_disk_tier_and_stage_outputs(tmp_path):
    assert_disk_tier_and_stage_outputs(tmp_path, make_gemma4("small"), 8, 4)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(attention_bias=True), "attention_bias"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    ],
)
def test_unbuilt_settings_are_refused_by_name(tmp_path, change, name):
    (tmp_path / "config.json").write_text(
        json.dumps({**SMALL, **change, "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"})
    )
    with pytest.raises(ValueError, match=name):
        ModelConfig.from_hf_folder(str(tmp_path))


def test_lora_is_refused_by_name(tmp_path):
    hf = make_gemma4("small")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(tmp_path), dtype="float32", device="cpu", num_blocks=16, block_size=8, enable_lora=True)
