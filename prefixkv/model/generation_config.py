"""Sampling defaults from a model's generation_config.json, as vLLM's `--generation-config`.

`auto` (vLLM's default) reads the model folder's file; `vllm` ignores it; any other value is a
folder to read it from. As vLLM (which keeps transformers' `GenerationConfig.to_diff_dict()`),
values equal to transformers' own defaults are not defaults of ours: temperature 1.0, top_p 1.0,
top_k 50 and repetition_penalty 1.0 change nothing."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger("prefixkv")

# generation_config.json key -> SamplingParams field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def sampling_defaults(model: str | None, setting: str = "auto") -> dict[str, Any]:
    """SamplingParams keywords the model's creator recommends ({} when none)."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if model is None or not os.path.isdir(os.path.expanduser(model)):
            return {}  # the embedded GGUF and .gguf files carry no generation_config.json
        folder = os.path.expanduser(model)
    else:
        folder = os.path.expanduser(setting)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"generation_config {setting!r} is not a folder (nor 'auto' or 'vllm')")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if setting != "auto":
            raise FileNotFoundError(f"no generation_config.json in --generation-config folder {folder!r}")
        return {}
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    out: dict[str, Any] = {}
    for key, name in _KEYS.items():
        value = raw.get(key)
        if value is None or (key in _HF_DEFAULTS and value == _HF_DEFAULTS[key]):
            continue
        out[name] = value
    if out:
        logger.info(
            "default sampling parameters from the model's generation_config.json: %s "
            "(--generation-config vllm ignores them)",
            out,
        )
    return out
