"""Loading models: the embedded default GGUF, an HF folder, or a single .gguf file.

Only local files are read; nothing is downloaded. The formats and the conversions applied to
them: docs/design.md, "Model".
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import weight_cache
from .config import ModelConfig
from .configs.gemma4 import GGUF_PER_LAYER_ROWS, GGUF_ROPE_FREQS
from .default_model import default_model_path as default_model_path  # the model= None default
from .families import model_class
from .gguf_delta_net import DELTA_NET_ARCHITECTURES, delta_net_tensors_from_gguf
from .gguf_names import ROPE_FACTOR_TENSORS, gguf_to_hf_name, mamba2_from_gguf, reverse_llama_permute
from .llama import LlamaModel
from .qwen3_5 import fused_delta_net_tensors
from .tokenizer import Tokenizer
from .tokenizer_loader import load_tokenizer as load_tokenizer  # the tokenizer alone, without torch
from .tokenizer_loader import looks_like_hub_id as _looks_like_hub_id
from .tokenizer_loader import open_gguf as _open_gguf
from .tokenizer_loader import resolve_hub_id as resolve_hub_id

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    source: str = ""
    # a vision-language checkpoint's encoder and preprocessing (llava/loader.py: MultiModalModel)
    multimodal: Any = None


def _missing_model_message(model: str, path: str) -> str:
    """The error for a model argument that names nothing on disk, with what prefixkv does read."""
    msg = (
        f"Model path does not exist: {path!r}. prefixkv reads only local files: an HF model folder "
        "(config.json, *.safetensors, tokenizer.json) or a single .gguf file; it downloads nothing. "
        "Pass a local path, e.g. LLM(model='/path/to/SmolLM2-135M-Instruct') or "
        "`prefixkv serve ./model.gguf`, or model=None for the embedded SmolLM2-135M-Instruct."
    )
    if _looks_like_hub_id(model):
        msg += (
            f" {model!r} looks like a Hugging Face Hub id and is not in the local HF cache (nothing is "
            f"downloaded): download it first, e.g. `huggingface-cli download {model}` (into the HF cache, where "
            "prefixkv then finds it by this id) or with --local-dir and pass that folder."
        )
    return msg


def load_model(
    model: str | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Load `model`: None (embedded default), an HF folder, or a .gguf file."""
    path = default_model_path() if model is None else os.path.expanduser(str(model))
    if not os.path.exists(path):
        path = resolve_hub_id(str(model)) or path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:  # a GGUF repository's snapshot: its one file
            path = os.path.join(path, ggufs[0])
    if os.path.isdir(path):
        loaded = _load_hf_folder(path, dtype, device)
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise ValueError(f"{path!r} is neither an HF model folder nor a .gguf file")
        loaded = _load_gguf(path, dtype, device)
    else:
        raise FileNotFoundError(_missing_model_message(str(model), path))
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    loaded.model.eval()
    return loaded


# ---------------------------------------------------------------------- HF folder
def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, x) for x in files]
        for fpath in files:
            if not os.path.isfile(fpath):
                raise FileNotFoundError(f"Shard listed in {index!r} is missing: {fpath!r}")
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        bins = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
        if not bins:
            raise FileNotFoundError(f"No *.safetensors (or pytorch_model*.bin) weights in {folder!r}")
        for b in bins:
            yield from torch.load(b, map_location="cpu", weights_only=True).items()
        return
    for fpath in files:
        with safe_open(fpath, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _load_hf_folder(folder: str, dtype, device) -> LoadedModel:
    from .llava.config import is_multimodal_config, read_hf_config

    if os.path.isfile(os.path.join(folder, "config.json")) and is_multimodal_config(read_hf_config(folder)):
        from .llava.loader import load_llava

        lm, tok, mm = load_llava(folder, _iter_safetensors(folder), dtype, device)
        return LoadedModel(model=lm, tokenizer=tok, config=lm.config, source=folder, multimodal=mm)
    config = ModelConfig.from_hf_folder(folder)
    tokenizer = Tokenizer.from_hf_folder(folder, extra_eos_ids=config.eos_token_id)
    model = model_class(config)(config, dtype=dtype, device=device)
    model.load_hf_weights(_iter_safetensors(folder))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, source=folder)


# ---------------------------------------------------------------------- GGUF
def read_gguf_metadata(reader) -> dict[str, Any]:
    """The metadata of a `gguf.GGUFReader` (the engine reads files with the faster GGUFFile)."""
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = fld.contents()
        except Exception:  # pragma: no cover - unusual field types
            continue
    return meta


def dequantize_gguf_tensor(t) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(list(t.shape)))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.asarray(t.data).astype(np.float32)
    elif t.tensor_type == GGMLQuantizationType.BF16:
        raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
        arr = raw.view(np.float32)
    else:
        arr = dequantize(t.data, t.tensor_type)
    return np.ascontiguousarray(arr.reshape(shape), dtype=np.float32)


# the architectures whose converter (LlamaModel's subclasses) permutes Q and K, weights and biases
_PERMUTED_QK = ("llama", "granite", "smollm3", "granitehybrid")


def gguf_config(reader: Any) -> ModelConfig:
    """The model config of an opened GGUF file (its metadata, its tensor names, and the values of
    LongRoPE's factor tensors; Gemma 4's rotary divisors and per-layer embedding rows)."""
    meta = dict(reader.metadata)
    g_arch = meta.get("general.architecture")
    for t in reader.tensors:
        if t.name in ROPE_FACTOR_TENSORS:
            meta[f"{g_arch}.{ROPE_FACTOR_TENSORS[t.name]}"] = dequantize_gguf_tensor(t).reshape(-1).tolist()
        elif g_arch == "gemma4" and t.name == "rope_freqs.weight":
            meta[f"{g_arch}.{GGUF_ROPE_FREQS}"] = dequantize_gguf_tensor(t).reshape(-1).tolist()
        elif g_arch == "gemma4" and t.name == "per_layer_token_embd.weight":
            meta[f"{g_arch}.{GGUF_PER_LAYER_ROWS}"] = int(t.shape[-1])  # (ggml's order: columns first)
    return ModelConfig.from_gguf_metadata(meta, {t.name for t in reader.tensors})


def _load_gguf(path: str, dtype, device) -> LoadedModel:
    reader = _open_gguf(path)
    meta = reader.metadata
    config = gguf_config(reader)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    g_arch = str(meta.get("general.architecture"))
    permute = g_arch in _PERMUTED_QK
    model = model_class(config)(config, dtype=dtype, device=device)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        if g_arch in DELTA_NET_ARCHITECTURES:
            arrays = ((t.name, dequantize_gguf_tensor(t)) for t in reader.tensors)
            named = delta_net_tensors_from_gguf(arrays, g_arch, config)
            yield from fused_delta_net_tensors(((n, torch.from_numpy(w)) for n, w in named), config)
            return
        for t in reader.tensors:
            hf = gguf_to_hf_name(t.name, g_arch)
            if hf is None:
                continue
            w = dequantize_gguf_tensor(t)
            if permute and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = reverse_llama_permute(w, config.num_attention_heads)
            elif permute and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = reverse_llama_permute(w, config.num_key_value_heads)
            elif g_arch in ("mamba2", "granitehybrid"):
                w = mamba2_from_gguf(t.name, w)
            elif g_arch == "lfm2" and t.name.endswith("shortconv.conv.weight"):  # squeezed to [channels, kernel]
                w = w.reshape(w.shape[0], 1, w.shape[-1])
            yield hf, torch.from_numpy(w)

    entry = _weight_cache_entry(path, dtype)
    if entry is None or not _cached_weights(model, entry):
        if entry is not None:
            logger.info("dequantizing %s (once: kept in %s)...", os.path.basename(path), entry.parent)
        if config.is_gemma:
            # llama.cpp stores Gemma's norm weights as 1 + w, which is what GemmaRMSNorm holds:
            # loaded as they are, past GemmaModel's adding of the 1 to transformers' w
            LlamaModel.load_hf_weights(model, weights())
        else:
            model.load_hf_weights(weights())
        if entry is not None:
            params = {name: p.data for name, p in model.named_parameters()}
            weight_cache.store(entry, params, source=os.path.realpath(path))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, source=path)


def _weight_cache_entry(path: str, dtype: torch.dtype) -> Path | None:
    """The weight cache's entry for `path` in `dtype`, None where the cache is off or the file's
    key cannot be read."""
    if not weight_cache.enabled():
        return None
    try:
        return weight_cache.entry_path(path, dtype)
    except OSError:
        return None


def _cached_weights(model: LlamaModel, entry: Path) -> bool:
    """Give `model` the weights kept in the cache's `entry` by an earlier load (weight_cache.py): on
    the CPU the mapped file's tensors themselves, elsewhere copies. False where it has no usable one."""
    params = dict(model.named_parameters())
    tensors = weight_cache.load(entry, params)
    if tensors is None:
        return False
    with torch.no_grad():
        for name, p in params.items():
            if p.device.type == "cpu":
                p.data = tensors[name]  # the mapping, not a copy (copy-on-write: the file stays as it is)
            else:
                p.data.copy_(tensors[name])
    return True
