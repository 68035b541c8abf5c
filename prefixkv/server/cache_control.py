"""Pinned prefixes on the server: POST /v1/cache/pin and /v1/cache/unpin (behind --api-key, as
every route but the open ones).

A body names the prefix as `prompt` (text or token ids) or `messages` (rendered by the model's chat
template without a generation prompt, as a chat request's system prompt is), with an optional
`cache_salt` - a tenant pins and unpins only its own prefixes, since its salt is part of every
block's identity - and an optional `model`: an adapter's name pins that adapter's blocks. Pinning
computes the prefix once (a one-token generation through the engine thread, like any request) and
pins its whole blocks; past --max-pinned-fraction the pin is refused (400, naming the option).
"""

from __future__ import annotations

import itertools
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine
from .errors import APIError

_pin_ids = itertools.count()


class PrefixBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    cache_salt: str | None = None
    chat_template: str | None = None


def _prefix_ids(engine: Any, body: PrefixBody) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give the prefix as exactly one of prompt (text or token ids) or messages", 400)
    if body.messages is not None and not body.messages:
        raise APIError("messages is empty", 400, param="messages")
    prefix = body.messages if body.messages is not None else body.prompt
    ids = engine.pins.token_ids(prefix, body.chat_template) if prefix else []
    if not ids:
        raise APIError("the prefix is empty", 400, param="prompt")
    engine.input_processor.validate_prompt(ids)
    return ids


def add_cache_control_routes(app: FastAPI, async_engine: AsyncEngine, adapter: Any) -> None:
    """`adapter(model name or None) -> LoRARequest | None`: the server's model-name resolution
    (404 for a model it does not serve)."""

    async def resolve(body: PrefixBody) -> tuple[list[int], LoRARequest | None]:
        lora = adapter(body.model)
        try:
            ids = await async_engine.call(lambda engine: _prefix_ids(engine, body))
        except ValueError as e:
            raise APIError(str(e), 400, param="prompt") from e
        return ids, lora

    @app.post("/v1/cache/pin")
    async def pin(body: PrefixBody):
        ids, lora = await resolve(body)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        last = None
        try:
            async for out in async_engine.generate(
                ids, params, f"pin-{next(_pin_ids)}", cache_salt=body.cache_salt, lora_request=lora
            ):
                last = out
        except ValueError as e:
            raise APIError(str(e), 400, param="prompt") from e
        if last is None or last.error is not None:
            raise APIError(f"the prefix could not be computed: {last.error if last else 'no output'}", 500)
        try:
            tokens = await async_engine.call(lambda engine: engine.pins.pin(ids, body.cache_salt, lora))
        except ValueError as e:  # PinError: past the bound, or evicted before it could be pinned
            raise APIError(str(e), 400, param="max_pinned_fraction" if "max-pinned" in str(e) else None) from e
        return {"object": "cache.pin", "pinned_tokens": tokens, "prompt_tokens": len(ids)}

    @app.post("/v1/cache/unpin")
    async def unpin(body: PrefixBody):
        ids, lora = await resolve(body)
        tokens = await async_engine.call(lambda engine: engine.pins.unpin(ids, body.cache_salt, lora))
        if not tokens:
            raise APIError("no pin of this prefix for this tenant and model", 404)
        return {"object": "cache.unpin", "unpinned_tokens": tokens}
