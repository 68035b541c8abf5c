"""Bad adapters and bad requests: a clear ValueError naming the unsupported part, nothing queued,
every block free."""

from __future__ import annotations

import json
import shutil

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.lora import LoRARequest

PARAMS = SamplingParams(temperature=0, max_tokens=2)
ARGS = dict(dtype="float32", device="cpu", num_blocks=32, block_size=8, max_model_len=64)


@pytest.fixture(scope="module")
def llm(lora_fixture):
    return LLM(str(lora_fixture.base), **ARGS, enable_lora=True, max_loras=2, max_lora_rank=4)


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def _refused(llm, lora, match):
    prompts = ["hello"] * (len(lora) if isinstance(lora, list) else 1)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=lora)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_bad_adapters_are_refused_by_name(llm, lora_fixture, tmp_path):
    qv = lora_fixture.adapters["qv"]  # rank 4
    cases = [
        (LoRARequest("a", 1, str(tmp_path / "missing")), "does not exist"),
        (LoRARequest("a", 1, ""), "lora_path is empty"),
        (LoRARequest("big", 1, lora_fixture.adapters["all"]), "rank 8 is above max_lora_rank=4"),
        (LoRARequest("d", 1, _edit_config(qv, tmp_path / "dora", use_dora=True)), "DoRA"),
        (LoRARequest("b", 1, _edit_config(qv, tmp_path / "bias", bias="all")), "bias='all'"),
        (LoRARequest("e", 1, _edit_config(qv, tmp_path / "emb", target_modules=["embed_tokens"])), "embed_tokens"),
        (LoRARequest("h", 1, _edit_config(qv, tmp_path / "head", target_modules=["lm_head", "q_proj"])), "lm_head"),
        (LoRARequest("s", 1, _edit_config(qv, tmp_path / "save", modules_to_save=["lm_head"])), "modules_to_save"),
        (LoRARequest("r", 1, _edit_config(qv, tmp_path / "rank", r=2)), "shape"),  # weights of rank 4
    ]
    nocfg = tmp_path / "nocfg"
    shutil.copytree(qv, nocfg)
    (nocfg / "adapter_config.json").unlink()
    cases.append((LoRARequest("n", 1, str(nocfg)), "adapter_config.json"))
    for lora, match in cases:
        _refused(llm, lora, match)
    # a mixed list fails as a whole before anything runs
    _refused(llm, [None, LoRARequest("a", 1, str(tmp_path / "missing"))], "does not exist")


def test_hidden_size_mismatch(llm, lora_fixture, tmp_path):
    from ..model.test_model_hf_folder import _make
    from .conftest import write_adapter

    other = tmp_path / "wide"
    _make("llama", hidden_size=32, intermediate_size=48).save_pretrained(other, safe_serialization=True)
    write_adapter(other, tmp_path / "wide-adapter", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    _refused(llm, LoRARequest("w", 1, str(tmp_path / "wide-adapter")), "hidden-size mismatch")


def test_lora_without_enable_lora(lora_fixture):
    plain = LLM(str(lora_fixture.base), **ARGS)
    _refused(plain, LoRARequest("qv", 1, lora_fixture.adapters["qv"]), "enable_lora")


def test_engine_args_bounds(lora_fixture):
    for kwargs in (dict(max_loras=0), dict(max_lora_rank=0)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            LLM(str(lora_fixture.base), **ARGS, enable_lora=True, **kwargs)
