"""The tier namespace covers everything that decides a block's KV bytes, not only the weights
(issue 36, item 1). The rotary cos/sin are non-persistent buffers, so the weights digest does not
see `rope_theta`; `rms_norm_eps` is in no tensor at all: two engines with the same weights and
another config sharing a disk folder must not load each other's blocks. Oracle: each engine's
output equals its own output computed without any cache (greedy float32)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from prefixkv.model import load_model
from prefixkv.model.config import ModelConfig
from prefixkv.tiers.namespace import config_digest, tokenizer_digest, weights_digest

from .conftest import all_free, engine, run, tier
from .test_engine_tiers import prompts


def _variant(base: str, dest, **changes) -> str:
    """A copy of the model folder (same weights files) with config.json fields changed."""
    shutil.copytree(base, dest)
    path = dest / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        cfg[key] = value
        if isinstance(cfg.get("rope_parameters"), dict) and key in cfg["rope_parameters"]:
            cfg["rope_parameters"][key] = value  # transformers >= 5 keeps rope_theta there
    path.write_text(json.dumps(cfg))
    return str(dest)


@pytest.mark.parametrize("changes", [{"rope_theta": 123.0}, {"rms_norm_eps": 0.25}], ids=["rope_theta", "rms_norm_eps"])
def test_same_weights_other_config_never_loads_the_others_blocks(tiny_model, tiny_loaded, tmp_path, changes):
    prompt = prompts(7, 1)[0]
    folder = tmp_path / "kv"
    first = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    first_out, _ = run(first, prompt)
    first.tiers.flush()
    assert tier(first, "disk").saves > 0

    other_dir = _variant(tiny_model, tmp_path / "variant", **changes)
    other_loaded = load_model(other_dir, dtype=torch.float32, device="cpu")
    key, value = next(iter(changes.items()))
    assert getattr(other_loaded.config, key) == value != getattr(tiny_loaded.config, key)

    expected = run(engine(other_dir, other_loaded, enable_prefix_caching=False), prompt)[0]
    # the premise: the weights digest alone cannot tell the two models apart
    assert weights_digest(other_loaded.model) == weights_digest(tiny_loaded.model)
    other = engine(other_dir, other_loaded, kv_tier=f"disk:{folder}")
    assert other.tiers.namespace != first.tiers.namespace
    assert run(other, prompt) == (expected, 0)  # nothing loaded from the first model's blocks
    assert tier(other, "disk").hits == 0
    assert all_free(other)

    # the same config again (a restart) still shares: the namespace is stable across engines
    again = engine(tiny_model, tiny_loaded, kv_tier=f"disk:{folder}")
    assert again.tiers.namespace == first.tiers.namespace
    assert run(again, prompt) == (first_out, (len(prompt) - 1) // 4 * 4)


def test_config_digest_covers_every_field_and_ignores_dict_order(tiny_loaded):
    cfg = tiny_loaded.config
    base = config_digest(cfg)
    assert config_digest(dataclasses.replace(cfg)) == base  # deterministic
    changed = {
        "rope_theta": cfg.rope_theta * 2,
        "rms_norm_eps": cfg.rms_norm_eps * 2,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window": 7,
        "max_position_embeddings": cfg.max_position_embeddings + 1,
        "qk_norm": not cfg.qk_norm,
    }
    digests = {name: config_digest(dataclasses.replace(cfg, **{name: v})) for name, v in changed.items()}
    assert base not in digests.values() and len(set(digests.values())) == len(changed)
    a = dataclasses.replace(cfg, rope_scaling={"rope_type": "linear", "factor": 2.0})
    b = dataclasses.replace(cfg, rope_scaling={"factor": 2.0, "rope_type": "linear"})
    assert config_digest(a) == config_digest(b)
    # a field added to the dataclass later is covered without touching namespace.py
    assert {f.name for f in dataclasses.fields(ModelConfig)} >= set(changed)


def test_tokenizer_and_vision_weights_are_in_the_identity(tiny_loaded, tmp_path):
    tok = tiny_loaded.tokenizer
    base = tokenizer_digest(tok)
    other = load_model(_variant_tokenizer(tiny_loaded, tmp_path), dtype=torch.float32, device="cpu").tokenizer
    assert tokenizer_digest(other) != base
    # a second module (a vision tower) is part of the weights digest
    extra = torch.nn.Linear(2, 2)
    assert weights_digest(tiny_loaded.model, extra) != weights_digest(tiny_loaded.model)
    assert weights_digest(tiny_loaded.model, None) == weights_digest(tiny_loaded.model)


def _variant_tokenizer(loaded, tmp_path) -> str:
    dest = tmp_path / "tok-variant"
    shutil.copytree(loaded.source, dest)
    data = json.loads((dest / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same text gets other ids
    (dest / "tokenizer.json").write_text(json.dumps(data))
    return str(dest)


def test_weights_digest_sees_the_weights_of_packed_layers(tiny_model):
    """On a CPU the engine lays the matmul weights out outside the modules' parameters
    (pack_for_cpu): the digest must still see every one of them, and not change by packing."""
    model = load_model(tiny_model, dtype=torch.float32, device="cpu").model
    before = weights_digest(model)
    packed = model.pack_for_cpu()
    assert weights_digest(model) == before
    other = load_model(tiny_model, dtype=torch.float32, device="cpu").model
    linear = next(m for m in other.layers[-1].modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad():
        linear.weight[0, 0] += 1.0  # one weight of one matmul: not in the embeddings or norms
    assert weights_digest(other) != before
    other.pack_for_cpu()
    assert weights_digest(other) != before
    if packed:  # the packed model's state dict has lost the matmul weights: the old digest was blind
        assert not any(n.endswith(("proj.weight", "lm_head.weight")) for n in model.state_dict())
