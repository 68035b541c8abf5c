"""OpenAI-compatible HTTP serving (vLLM's conventions): `prefixkv serve`."""
from .app import create_app

__all__ = ["create_app"]
