"""--enable-log-requests: one log line per request as it is handed to the engine - its id, the
prompt (text and token ids, each cut to --max-log-len) and the sampling parameters - as vLLM's
RequestLogger. Off by default: prompts are user data."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

logger = logging.getLogger("prefixkv.server.requests")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: Any,
        lora_name: str | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """`decode`: renders the logged token ids when the request came without its text (chat)."""
        if not logger.isEnabledFor(logging.INFO):
            return
        n = self.max_log_len
        if prompt is None and decode is not None:
            prompt = decode(prompt_token_ids[:n] if n is not None else prompt_token_ids)
        text = prompt[:n] if prompt is not None and n is not None else prompt
        ids = prompt_token_ids[:n] if n is not None else prompt_token_ids
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d tokens), lora_request: %s",
            request_id,
            text,
            _params_text(params),
            ids,
            len(prompt_token_ids),
            lora_name,
        )


def _params_text(params: Any) -> str:
    """The parameters that differ from their defaults: a short line, not the whole dataclass."""
    try:
        changed = [
            f"{f.name}={getattr(params, f.name)!r}"
            for f in fields(params)
            if getattr(params, f.name) != f.default and f.name != "structured_outputs"
        ]
    except TypeError:  # not a dataclass
        return repr(params)
    if getattr(params, "structured_outputs", None) is not None:
        changed.append("structured_outputs=...")
    return f"{type(params).__name__}({', '.join(changed)})"
