"""Engine configuration: `EngineConfig` is `EngineArgs` (prefixkv/engine_args.py), the one place
where every option, its vLLM name and its default are written."""

from __future__ import annotations

from .engine_args import DEFAULT_KV_CACHE_BYTES, EngineArgs

EngineConfig = EngineArgs

__all__ = ["DEFAULT_KV_CACHE_BYTES", "EngineArgs", "EngineConfig"]
