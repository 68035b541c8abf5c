"""Mamba2 (recurrent state per block) through the model and the whole engine, against transformers'
Mamba2ForCausalLM on a tiny random checkpoint: greedy tokens equal with caching off and on (a shared
prefix's state restored from the hit's last block), under chunked prefill split mid-block and under
preemption, every block free afterwards."""

from __future__ import annotations

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import AttentionMetadata, load_model

from ..model.test_model_hf_folder import _write_tokenizer
from .engine_oracle import (
    KV_SHAPED_FEATURES,
    assert_prompt_logprobs_over_stage_outputs,
    assert_recurrent_engine_matches_transformers,
    assert_refused,
)

MAX_NEW = 8


def make_mamba2(seed: int = 0, tie: bool = False):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(seed)
    config = Mamba2Config(
        vocab_size=258,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=32,
        expand=2,
        state_size=16,
        n_groups=1,
        chunk_size=16,
        conv_kernel=4,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
        tie_word_embeddings=tie,
        architectures=["Mamba2ForCausalLM"],
    )
    model = Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # an input-dependent state that matters: larger mixing weights than the init's
        for layer in model.backbone.layers:
            layer.mixer.in_proj.weight.normal_(0, 0.2)
            layer.mixer.out_proj.weight.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mamba2")
    hf = make_mamba2()
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return hf, str(folder)


@pytest.mark.parametrize("tie", [False, True])
def test_mamba2_model_matches_transformers(tmp_path, tie):
    """One prefill split into two chunks (the second starting mid-block), then a decode step."""
    hf = make_mamba2(tie=tie)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    assert (loaded.model.lm_head is None) == tie
    model, bs = loaded.model, 8
    states = allocate_kv_cache(loaded.config, 8, bs)
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    table = torch.tensor([[3, 5, 1, 6]])
    got = []
    for a, b in ((0, 11), (11, 20), (20, 21)):
        meta = AttentionMetadata(torch.zeros(b - a, dtype=torch.long), [0, b - a], [b], table)
        got.append(model.compute_logits(model(ids[a:b], torch.arange(a, b), states, meta)))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=1e-4)


def test_mamba2_engine_matches_transformers(checkpoint):
    hf, folder = checkpoint
    assert_recurrent_engine_matches_transformers(folder, hf, MAX_NEW)


@pytest.mark.parametrize("kwargs, name", KV_SHAPED_FEATURES)
def test_mamba2_refuses_kv_shaped_features(checkpoint, kwargs, name):
    assert_refused(checkpoint[1], kwargs, name)


def test_mamba2_prompt_logprobs_with_stage_output_cache(checkpoint):
    """Prompt logprobs over a cached prefix (its hidden states from the stage-output cache) equal
    the uncached ones."""
    hf, folder = checkpoint
    assert_prompt_logprobs_over_stage_outputs(folder, hf)


def test_mamba2_config_from_model_type_and_refusals():
    from prefixkv.model import ModelConfig

    base = dict(model_type="mamba2", hidden_size=64, num_heads=4, head_dim=32, expand=2, n_groups=1, state_size=16)
    cfg = ModelConfig.from_hf_dict({**base, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert cfg.architecture == "Mamba2ForCausalLM" and cfg.is_recurrent
    assert cfg.intermediate_size == 128 and cfg.ssm_time_step_limit == (0.0, float("inf"))
    with pytest.raises(ValueError, match="num_heads x head_dim"):
        ModelConfig.from_hf_dict({**base, "head_dim": 16})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})


def test_mamba2_events_name_its_blocks_state(checkpoint):
    """A recurrent model's blocks hold its state after each block: its BlockStored events say
    vLLM's "mamba" kind, not full attention."""
    from prefixkv.cache import BlockStored

    _, folder = checkpoint
    llm = LLM(folder, dtype="float32", device="cpu", num_blocks=16, block_size=8, enable_kv_cache_events=True)
    llm.generate([list(range(20))], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    stored = [e for e in llm.llm_engine.take_kv_events() if isinstance(e, BlockStored)]
    assert stored and {(e.group_idx, e.kv_cache_spec_kind) for e in stored} == {(0, "mamba")}
