"""Loading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) and checking it
against the model. Everything prefixkv cannot apply exactly is refused with a ValueError naming it;
nothing is silently dropped.

PEFT conventions: `lora_A.weight` is [r, in], `lora_B.weight` is [out, r] (nn.Linear layout; PEFT
forces fan_in_fan_out off for nn.Linear targets, so the flag changes nothing for these models),
and the update is `x @ A.T @ B.T * scaling` with scaling = lora_alpha / r, or lora_alpha / sqrt(r)
with `use_rslora`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# PEFT target module -> (fused module of the model, index of its output slice)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_MLP_MODULES = ("gate_up_proj", "down_proj")
_MOE_REFUSAL = (
    "LoRA on mixture-of-experts MLPs (experts, router, shared expert) is not supported; "
    "on an MoE layer an adapter may target the attention projections only"
)
# config options that only matter for training or initialisation
_IGNORED_OPTIONS = "init_lora_weights, lora_dropout, task_type, inference_mode, ..."


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT target in this model."""
    h, q = config.hidden_size, config.num_attention_heads * int(config.head_dim or 0)
    kv, inter = config.num_key_value_heads * int(config.head_dim or 0), config.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


@dataclass
class LoRAAdapter:
    """A loaded adapter: per (layer, PEFT target) the pair (A [r, in], B [out, r] * scaling), in
    float32 on the CPU. `id` is the engine's (>= 1, never reused); `digest` names the weights."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    id: int = 0

    @property
    def targets(self) -> set[str]:
        return {t for _, t in self.weights}


def _bad(name: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {why}")


def _check_config(name: str, cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """The rank and scaling of a PEFT LoraConfig; every option that changes the output and is not
    implemented here is refused by name."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _bad(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise _bad(name, "DoRA adapters (use_dora=True) are not supported")
    if cfg.get("bias", "none") != "none":
        raise _bad(name, f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("lora_bias"):
        raise _bad(name, "lora_bias=True is not supported")
    for option in (
        "modules_to_save",
        "rank_pattern",
        "alpha_pattern",
        "layer_replication",
        "trainable_token_indices",
        "target_parameters",
        "alora_invocation_tokens",
        "use_qalora",
    ):
        if cfg.get(option):
            raise _bad(name, f"{option}={cfg[option]!r} is not supported")
    targets = cfg.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for t in names:
        if any(x in str(t) for x in ("embed_tokens", "lm_head", "embedding")):
            raise _bad(name, f"target module {t!r} is not supported (embedding and lm_head adapters are not)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _bad(name, f"rank r={r!r} must be a positive integer")
    if r > max_rank:
        raise _bad(name, f"rank {r} is above max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _bad(name, f"lora_alpha={alpha!r} must be a number")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def _read_tensors(name: str, path: str) -> tuple[dict[str, torch.Tensor], str]:
    for f in WEIGHT_FILES:
        p = os.path.join(path, f)
        if os.path.exists(p):
            if f.endswith(".safetensors"):
                from safetensors.torch import load_file

                try:
                    return load_file(p, device="cpu"), p
                except Exception as e:  # noqa: BLE001 (a corrupt file is the user's input)
                    raise _bad(name, f"cannot read {f}: {e}") from e
            try:
                return torch.load(p, map_location="cpu", weights_only=True), p
            except Exception as e:  # noqa: BLE001
                raise _bad(name, f"cannot read {f}: {e}") from e
    raise _bad(name, f"no {' or '.join(WEIGHT_FILES)} in {path!r}")


def load_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and validate the PEFT folder `path` for a model of `config`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
    if not isinstance(path, str) or not path:
        raise _bad(name, "lora_path is empty")
    if not os.path.isdir(path):
        raise _bad(name, f"path {path!r} does not exist or is not a folder")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(cfg_path):
        raise _bad(name, f"no {CONFIG_FILE} in {path!r}")
    with open(cfg_path, "rb") as fh:
        cfg_bytes = fh.read()
    try:
        cfg = json.loads(cfg_bytes)
    except json.JSONDecodeError as e:
        raise _bad(name, f"{CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise _bad(name, f"{CONFIG_FILE} is not a JSON object")
    rank, scaling = _check_config(name, cfg, max_rank)
    tensors, weight_path = _read_tensors(name, path)
    shapes = target_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if "lora_magnitude_vector" in key:
            raise _bad(name, f"tensor {key!r}: DoRA adapters are not supported")
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise _bad(name, f"tensor {key!r}: embedding and lm_head adapters are not supported")
        if any(part in key for part in (".experts.", "shared_expert", "block_sparse_moe")):
            raise _bad(name, f"tensor {key!r}: {_MOE_REFUSAL}")
        m = _NAME.match(key)
        if m is None:
            raise _bad(name, f"tensor {key!r} is not a LoRA weight of a supported linear layer")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS:
            raise _bad(name, f"tensor {key!r}: target module {target!r} is not supported ({', '.join(TARGETS)})")
        if layer >= config.num_hidden_layers:
            raise _bad(name, f"tensor {key!r}: the model has {config.num_hidden_layers} layers")
        if TARGETS[target][0] in _MLP_MODULES and config.is_moe_layer(layer):
            raise _bad(name, f"tensor {key!r}: layer {layer} is a mixture-of-experts layer; {_MOE_REFUSAL}")
        fan_in, fan_out = shapes[target]
        expected = (rank, fan_in) if ab == "A" else (fan_out, rank)
        if tuple(t.shape) != expected:
            raise _bad(
                name,
                f"tensor {key!r} has shape {tuple(t.shape)}, the model expects {expected} (rank {rank}; "
                f"hidden-size mismatch: is the adapter for another base model?)",
            )
        pairs.setdefault((layer, target), {})[ab] = t
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise _bad(name, f"layer {layer} {target}: lora_A and lora_B must both be present")
        weights[(layer, target)] = (ab["A"].float().contiguous(), (ab["B"].float() * scaling).contiguous())
    if not weights:
        raise _bad(name, f"{weight_path} holds no LoRA weights")
    digest = hashlib.sha256()
    digest.update(cfg_bytes)
    with open(weight_path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return LoRAAdapter(name, path, rank, scaling, digest.hexdigest(), weights)
