"""OpenAI-compatible HTTP serving (vLLM's conventions): `prefixkv serve`.

`create_app` is imported lazily so that the CLI can read the server's flags without FastAPI."""

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
