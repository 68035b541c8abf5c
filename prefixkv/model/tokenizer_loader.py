"""A model argument's tokenizer alone, and the local files a Hub id names, without torch: the
replicas' router (prefixkv/replicas/chooser.py) tokenizes and never loads weights, and its process
would otherwise pay torch's import (2-4 s of CPU) for nothing. loader.py re-exports these names."""

from __future__ import annotations

import os
import re

from .gguf_file import GGUFFile
from .tokenizer import Tokenizer


def looks_like_hub_id(model: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", model)) and not model.startswith((".", "/", "~"))


def resolve_hub_id(model: str) -> str | None:
    """A Hugging Face Hub id ("org/name") already in the local HF cache -> its snapshot folder
    (huggingface_hub, offline: nothing is downloaded). None when it is not there."""
    if not looks_like_hub_id(model):
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return snapshot_download(model, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError) or an invalid id: not found
        return None


def open_gguf(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as e:
        raise ValueError(f"Cannot read GGUF file {path!r}: {e}") from e


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer alone (`--tokenizer`): an HF folder (tokenizer.json) or a .gguf file's."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        path = resolve_hub_id(path) or path
    if os.path.isdir(path):
        return Tokenizer.from_hf_folder(path)
    if os.path.isfile(path):
        return Tokenizer.from_gguf_metadata(open_gguf(path).metadata)
    raise FileNotFoundError(
        f"tokenizer path does not exist: {path!r} (an HF folder or a .gguf file; nothing is downloaded)"
    )
