"""Tiny random checkpoints and random PEFT adapters written by transformers and peft themselves,
and the HF+PEFT greedy oracle."""

from __future__ import annotations

import random

import pytest
import torch

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _make, _write_tokenizer

MAX_NEW = 8

# name -> LoraConfig keywords: different ranks, target sets, scalings
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


def write_adapter(base_dir, out_dir, seed: int, **lora_kwargs) -> None:
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():  # larger than peft's init so every adapter changes greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft_model.save_pretrained(out_dir)


def peft_greedy(base_dir, adapter_dir, prompts, max_new=MAX_NEW):
    import transformers as tf
    from peft import PeftModel

    base = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.inference_mode():
        return [hf_greedy(model, p, max_new) for p in prompts]


class Fixture:
    def __init__(self, kind, root):
        self.kind = kind
        self.base = root / "base"
        self.base.mkdir()
        hf = _make(kind)
        hf.save_pretrained(self.base, safe_serialization=True)
        _write_tokenizer(self.base)
        self.adapters = {}
        for i, (name, kw) in enumerate(ADAPTERS.items()):
            path = root / name
            write_adapter(self.base, path, seed=100 + i, **kw)
            self.adapters[name] = str(path)
        rng = random.Random(kind)
        shared = [rng.randrange(256) for _ in range(20)]
        self.prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
        self.expected = {None: peft_greedy(self.base, None, self.prompts)}
        for name, path in self.adapters.items():
            self.expected[name] = peft_greedy(self.base, path, self.prompts)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lora_fixture(request, tmp_path_factory):
    return Fixture(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))
