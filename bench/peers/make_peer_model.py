"""Build the HF (safetensors, float32) folder vLLM needs from prefixkv's default GGUF.

Run with prefixkv's venv plus accelerate (transformers refuses GGUF loading without it; it is
not a prefixkv dependency, so it is put on PYTHONPATH from a side folder rather than installed):

    .venv/bin/pip install --no-deps --target peers/convert_deps accelerate psutil
    PYTHONPATH=peers/convert_deps .venv/bin/python bench/peers/make_peer_model.py

(from the repo root; --out defaults to peers/smollm2-135m-hf, or $PREFIXKV_PEERS/smollm2-135m-hf)

What it does:
1. transformers dequantizes SmolLM2-135M-Instruct.Q4_1.gguf to float32 (LlamaForCausalLM).
2. The model still carries the GGUF quantizer marker, which makes save_pretrained refuse
   ("quantized with gguf and is not serializable"); the weights are plain float32 tensors, so the
   marker is dropped and the folder is saved as safetensors.
3. transformers' GGUF tokenizer conversion drops SmolLM2's Digits(individual_digits) pre-tokenizer
   (it writes a bare ByteLevel). The vocabulary has no multi-digit tokens, so token ids came out
   identical on every scenario prompt anyway, but tokenizer.json is restored to the original
   Sequence[Digits, ByteLevel] so it matches SmolLM2 and llama.cpp's 'smollm' pre-tokenizer.
4. config.json keeps transformers 5's rope_parameters.rope_theta (100000); vLLM 0.32 reads
   rope_parameters, so no top-level rope_theta is needed (--add-rope-theta adds it anyway).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prefixkv.model.loader import default_model_path  # this script runs in prefixkv's venv

GGUF_DIR, GGUF_FILE = os.path.split(default_model_path())
PEERS_DIR = Path(os.environ.get("PREFIXKV_PEERS", Path(__file__).resolve().parents[2] / "peers"))


def build(out: str, add_rope_theta: bool = False, model: torch.nn.Module | None = None, tokenizer: Any = None) -> None:
    """Write the HF folder of the default GGUF to `out` (also used by tests/server/test_lm_eval.py).
    `model`, `tokenizer`: transformers' float32 dequantization of that GGUF and its tokenizer
    conversion, already loaded (the test suite's reference), saved instead of reading the GGUF
    again; they are left as they were given."""
    tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE, dtype=torch.float32)
    save_dequantized(model, out)
    tok.save_pretrained(out)

    path = os.path.join(out, "tokenizer.json")
    t = json.load(open(path))
    if t["pre_tokenizer"].get("type") == "ByteLevel":
        t["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        }
        json.dump(t, open(path, "w"), ensure_ascii=False, indent=2)
        print("tokenizer.json: restored Digits(individual_digits) pre-tokenizer")
    if add_rope_theta:
        cpath = os.path.join(out, "config.json")
        c = json.load(open(cpath))
        c.setdefault("rope_theta", c.get("rope_parameters", {}).get("rope_theta", 100000.0))
        json.dump(c, open(cpath, "w"), indent=2)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok("123")["input_ids"] == [33, 34, 35], tok("123")["input_ids"]  # digits one by one
    print("saved", out)


def save_dequantized(model: torch.nn.Module, out: str) -> None:
    """Save without the GGUF quantizer marker (save_pretrained refuses a model that carries it; the
    weights are plain float32 tensors), then put the marker back."""
    quantizer = getattr(model, "hf_quantizer", None)
    qconfig = getattr(model.config, "quantization_config", None)
    model.hf_quantizer = None
    if qconfig is not None:
        del model.config.quantization_config
    try:
        assert all(p.dtype == torch.float32 for p in model.parameters())
        model.save_pretrained(out)
    finally:
        model.hf_quantizer = quantizer
        if qconfig is not None:
            model.config.quantization_config = qconfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(PEERS_DIR / "smollm2-135m-hf"))
    ap.add_argument("--add-rope-theta", action="store_true")
    args = ap.parse_args()
    build(args.out, args.add_rope_theta)


if __name__ == "__main__":
    main()
