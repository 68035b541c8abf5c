"""LoRA adapters on the server, as `vllm serve`: `--lora-modules name=path` (or the JSON form
`{"name": ..., "path": ...}`), requests pick an adapter with `"model": name`, /v1/models lists each
adapter with the base model as `parent`, and POST /v1/load_lora_adapter / /v1/unload_lora_adapter
add and remove adapters at run time - only when runtime updating is allowed, as vLLM:
$VLLM_ALLOW_RUNTIME_LORA_UPDATING true (or 1) or `--allow-runtime-lora-updating`; otherwise those
routes do not exist (404). `--lora-allowed-dir DIR` ($PREFIXKV_LORA_ALLOWED_DIR) confines runtime
loads to folders that resolve (symlinks and .. followed) inside DIR. Every refused path gets one
and the same answer (400 "cannot load a LoRA adapter from that path"), so a client cannot probe
which paths exist; the reason is only in the server log.

Loading validates the folder on the engine thread (the engine's LoRA manager reads and checks it);
unloading forgets the name at once: new requests naming it get 404, requests already running
finish with the adapter they started with.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from ..lora.request import LoRARequest
from .errors import APIError
from .protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest

if TYPE_CHECKING:  # the engine (torch) is not imported where `serve` only checks its flags
    from .async_engine import AsyncEngine

log = logging.getLogger("prefixkv.server")

REFUSED_PATH = "cannot load a LoRA adapter from that path"


def runtime_lora_updating_from_env() -> bool:
    """vLLM's switch for the load / unload routes: $VLLM_ALLOW_RUNTIME_LORA_UPDATING "1" or "true"."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def lora_allowed_dir_from_env() -> str | None:
    return os.environ.get("PREFIXKV_LORA_ALLOWED_DIR") or None


def check_runtime_lora_path(path: str, allowed_dir: str | None) -> str | None:
    """Why a runtime load from `path` is refused (for the log only), or None when it may be read."""
    real = os.path.realpath(path)
    if allowed_dir is not None:
        root = os.path.realpath(allowed_dir)
        if os.path.commonpath([root, real]) != root:
            return f"{path!r} resolves to {real!r}, outside the allowed folder {root!r}"
    if not os.path.isdir(real):
        return f"{path!r} does not exist or is not a folder"
    cfg = os.path.join(real, "adapter_config.json")
    if not os.path.isfile(cfg):
        return f"no adapter_config.json in {path!r}"
    if not os.access(cfg, os.R_OK):
        return f"{cfg!r} is not readable"
    return None


def parse_lora_module(text: str) -> LoRARequest:
    """'name=path' or '{"name": ..., "path": ...}' (vLLM's --lora-modules forms)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not valid JSON: {text!r} ({e})") from e
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise ValueError(f"--lora-modules: the JSON form needs a name and a path: {text!r}")
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: unsupported keys {sorted(unknown)} in {text!r}")
        return LoRARequest(str(spec["name"]), 0, str(spec["path"]))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    return LoRARequest(name, 0, path)


class LoRARegistry:
    """The adapters the server serves, by name (the `model` of a request)."""

    def __init__(self, base_names: list[str]) -> None:
        self.base_names = base_names
        self._ids = itertools.count(1)
        self._by_name: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def names(self) -> list[str]:
        return list(self._by_name)

    def add(self, lora: LoRARequest) -> LoRARequest:
        with self._lock:
            if lora.lora_name in self._by_name:
                raise APIError(f"The lora adapter '{lora.lora_name}' has already been loaded.", 400, param="lora_name")
            if lora.lora_name in self.base_names:
                raise APIError(f"'{lora.lora_name}' is the base model's name", 400, param="lora_name")
            lora = LoRARequest(lora.lora_name, next(self._ids), lora.lora_path)
            self._by_name[lora.lora_name] = lora
            return lora

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            lora = self._by_name.pop(name, None)
        if lora is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError", "lora_name")
        return lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        parent = self.base_names[0]
        return [
            ModelCard(id=n, root=lora.lora_path, parent=parent, max_model_len=max_model_len)
            for n, lora in self._by_name.items()
        ]


def load_startup_adapters(engine: Any, registry: LoRARegistry, modules: list[LoRARequest]) -> None:
    """Validate and register the --lora-modules adapters before the server starts (ValueError)."""
    for lora in modules:
        engine.resolve_lora(lora, reload=True)
        try:
            registry.add(lora)
        except APIError as e:
            raise ValueError(str(e)) from e


def add_lora_routes(
    app: FastAPI, registry: LoRARegistry, async_engine: AsyncEngine, allowed_dir: str | None = None
) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        if registry.get(req.lora_name) is not None:
            raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded.", 400, param="lora_name")
        why = check_runtime_lora_path(req.lora_path, allowed_dir)
        if why is not None:
            log.warning("load_lora_adapter %r refused: %s", req.lora_name, why)
            raise APIError(REFUSED_PATH, 400, param="lora_path")
        lora = LoRARequest(req.lora_name, 0, req.lora_path)
        try:
            await async_engine.call(lambda engine: engine.resolve_lora(lora, reload=True))
        except ValueError as e:
            text = str(e)
            if "does not exist" in text or "no adapter_config.json" in text or "cannot read" in text:
                log.warning("load_lora_adapter %r refused: %s", req.lora_name, text)
                raise APIError(REFUSED_PATH, 400, param="lora_path") from e
            raise APIError(text, 400, param="lora_path") from e
        registry.add(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        lora = registry.remove(req.lora_name)
        await async_engine.call(lambda engine: engine.remove_lora(lora.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
