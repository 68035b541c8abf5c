"""The multi-LoRA benchmark's adapters and traffic, in plain Python + torch + safetensors so that
prefixkv's bench/lora.py and the vLLM peer (bench/peers/vllm_lora.py, in vLLM's own venv) write
the same PEFT folders and send the same prompts (same seeds, same bytes)."""

from __future__ import annotations

import json
import os
import random

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target, from an HF config.json's fields."""
    h, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or h // heads
    q, kv = heads * head_dim, hf_config.get("num_key_value_heads", heads) * head_dim
    inter = hf_config["intermediate_size"]
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def write_random_adapter(path: str, hf_config: dict, rank: int, seed: int) -> None:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) with random rank-`rank`
    weights on every linear layer of every decoder layer."""
    g = torch.Generator().manual_seed(seed)
    shapes = target_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for t in TARGETS:
            fan_in, fan_out = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)


def workload(n_requests: int, n_groups: int, seed: int) -> list[tuple[int, str]]:
    """(group, prompt): requests round-robin over the groups (adapters); group g's requests share
    a ~200-token system prompt of their own."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud maple orbit lantern copper meadow signal harbor".split()
    systems = [
        f"System {g}: you are assistant number {g}. " + " ".join(rng.choice(words) for _ in range(150))
        for g in range(n_groups)
    ]
    out = []
    for i in range(n_requests):
        g = i % n_groups
        q = " ".join(rng.choice(words) for _ in range(12))
        out.append((g, f"{systems[g]}\nQuestion {i}: {q}\nAnswer:"))
    return out
