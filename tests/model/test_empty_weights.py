"""Storage for a model built on the meta device: every tensor real, in the model's dtype, shared
ones still shared, and no sympy import on the way (Module.to_empty's path imported it: 0.6-0.9
CPU-s of every process that built a model, on an AMD Zen 3)."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from prefixkv.model.empty_weights import materialize


def test_every_meta_tensor_gets_storage_in_the_dtype_and_shared_ones_stay_shared():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.Embedding(5, 4))
        model[0].register_buffer("steps", torch.zeros(2, dtype=torch.int64))
        model[0].register_buffer("scale", torch.ones(3))
    model.add_module("tied", nn.Linear(4, 5, bias=False, device="meta"))
    model.tied.weight = model[1].weight
    materialize(model, "cpu", torch.bfloat16)
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        assert t.device.type == "cpu", name
    assert model[0].weight.dtype == model[0].bias.dtype == model[0].scale.dtype == torch.bfloat16
    assert model[0].steps.dtype == torch.int64  # not floating point: its own dtype
    assert model.tied.weight is model[1].weight
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.shape == (3, 4)


def test_building_a_model_imports_no_sympy():
    code = (
        "import sys, torch;"
        "from prefixkv.model.config import ModelConfig;"
        "from prefixkv.model.llama import LlamaModel;"
        "c = ModelConfig(architecture='LlamaForCausalLM', vocab_size=64, hidden_size=32,"
        " intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2);"
        "LlamaModel(c);"
        "print('sympy' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
