"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM serves it,
for clients that speak it (the anthropic SDK; Claude Code with ANTHROPIC_BASE_URL).

A message is a chat completion underneath: the request becomes a chat request
(anthropic_protocol.py) that goes through the chat route's admission and engine path - template,
tools, structured outputs, reasoning parser, limits, prefix cache - and its reply (or its stream of
chunks) is re-shaped: reasoning -> a `thinking` block, content -> a `text` block, tool calls ->
`tool_use` blocks; a stream as Anthropic's events (message_start, content_block_start / _delta /
_stop, message_delta, message_stop). Errors have Anthropic's shape. The API key may come as
`x-api-key` (the SDK's header) as well as `Authorization: Bearer`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from .anthropic_protocol import (
    NO_EFFECT,
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    chat_request_body,
    message_id,
    signature,
    stop_reason,
    usage,
)
from .chat import OpenAIServingChat
from .errors import APIError, as_api_error, validation_message
from .protocol import ChatCompletionRequest, ChatCompletionResponse
from .serving import log_no_effect_field_once
from .tools import plan_tools

logger = logging.getLogger("prefixkv.server")
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def parse(self, raw: Request, kind: type[AnthropicMessagesRequest]) -> AnthropicMessagesRequest:
        try:
            body = await raw.json()
        except ValueError as e:
            raise APIError(f"Malformed JSON in the request body: {e}", 400) from None
        try:
            return kind.model_validate(body)
        except ValidationError as e:
            raise APIError(validation_message(e), 400) from None

    def chat_request(self, req: AnthropicMessagesRequest, stream: bool = False) -> ChatCompletionRequest:
        refused = req.refusals()
        if refused:
            name, why = refused[0]
            raise APIError(f"unsupported field {name!r}: {why}", 400, param=name)
        no_effect = {name for name in ("metadata", "service_tier") if getattr(req, name) is not None}
        body = chat_request_body(req, no_effect)
        for name in sorted(no_effect):
            log_no_effect_field_once(name, NO_EFFECT[name])
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise APIError(validation_message(e), 400) from None

    async def create(self, raw: Request) -> JSONResponse | StreamingResponse:
        req = await self.parse(raw, AnthropicMessagesRequest)
        reply = await self.chat.create(self.chat_request(req, req.stream), raw)
        if isinstance(reply, StreamingResponse):
            return StreamingResponse(self.events(reply.body_iterator), media_type="text/event-stream")
        return JSONResponse(self.message(reply))

    async def count_tokens(self, raw: Request) -> JSONResponse:
        """The prompt's tokens as the reply would render it, tools included (none is called)."""
        req = await self.parse(raw, AnthropicCountTokensRequest)
        chat_req = self.chat_request(req)
        ids, _ = await self.chat.prompt(chat_req, plan_tools(chat_req.tools, "none", None))
        return JSONResponse({"input_tokens": len(ids)})

    @staticmethod
    def message(reply: ChatCompletionResponse) -> dict[str, Any]:
        choice = reply.choices[0]
        msg = choice.message
        content: list[dict[str, Any]] = []
        if msg.reasoning:
            content.append({"type": "thinking", "thinking": msg.reasoning, "signature": signature()})
        if msg.content:
            content.append({"type": "text", "text": msg.content})
        for call in msg.tool_calls or ():
            content.append(
                {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.function.name,
                    "input": _input(call.function.arguments),
                }
            )
        if not content:  # Anthropic's shape of an empty reply: one empty text block
            content.append({"type": "text", "text": ""})
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(msg.tool_calls))
        details = reply.usage.prompt_tokens_details
        return {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(
                reply.usage.prompt_tokens, details.cached_tokens if details else 0, reply.usage.completion_tokens
            ),
        }

    async def events(self, chunks: AsyncIterable[Any]) -> AsyncIterator[str]:
        """The chat stream's chunks as Anthropic's events: one content block at a time, in the
        order the reply makes them (thinking, text, then each tool call)."""
        block: str | None = None  # the open block's type
        index = -1
        finish: str | None = None
        stop: int | str | None = None
        called = False
        last_usage: dict[str, Any] = {}
        started = False

        def open_block(kind: str, start: dict[str, Any]) -> list[str]:
            nonlocal block, index
            out = close_block()
            block, index = kind, index + 1
            out.append(event("content_block_start", {"index": index, "content_block": start}))
            return out

        def close_block() -> list[str]:
            nonlocal block
            if block is None:
                return []
            out = []
            if block == "thinking":
                delta = {"type": "signature_delta", "signature": signature()}
                out.append(event("content_block_delta", {"index": index, "delta": delta}))
            out.append(event("content_block_stop", {"index": index}))
            block = None
            return out

        async for raw_chunk in chunks:
            text = raw_chunk.decode() if isinstance(raw_chunk, bytes) else raw_chunk
            for line in text.splitlines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    for e in close_block():
                        yield e
                    reason, sequence = stop_reason(finish, stop, called)
                    counts = usage(
                        last_usage.get("prompt_tokens", 0),
                        (last_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                        last_usage.get("completion_tokens", 0),
                    )
                    yield event(
                        "message_delta",
                        {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": counts},
                    )
                    yield event("message_stop", {})
                    continue
                chunk = json.loads(data)
                if "error" in chunk:  # the chat stream's in-band failure
                    err = chunk["error"]
                    yield event("error", {"error": anthropic_error(err.get("code") or 500, err["message"])["error"]})
                    return
                last_usage = chunk.get("usage") or last_usage
                if not started:
                    started = True
                    counts = usage(last_usage.get("prompt_tokens", 0), 0, 0)
                    message = {
                        "id": message_id(),
                        "type": "message",
                        "role": "assistant",
                        "model": chunk.get("model"),
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": counts,
                    }
                    yield event("message_start", {"message": message})
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning"):
                        if block != "thinking":
                            for e in open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                                yield e
                        piece = {"type": "thinking_delta", "thinking": delta["reasoning"]}
                        yield event("content_block_delta", {"index": index, "delta": piece})
                    if delta.get("content"):
                        if block != "text":
                            for e in open_block("text", {"type": "text", "text": ""}):
                                yield e
                        piece = {"type": "text_delta", "text": delta["content"]}
                        yield event("content_block_delta", {"index": index, "delta": piece})
                    for call in delta.get("tool_calls") or ():
                        fn = call.get("function") or {}
                        if call.get("id"):  # a new call
                            called = True
                            start = {"type": "tool_use", "id": call["id"], "name": fn.get("name") or "", "input": {}}
                            for e in open_block("tool_use", start):
                                yield e
                        if fn.get("arguments"):
                            piece = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                            yield event("content_block_delta", {"index": index, "delta": piece})
                    finish = choice.get("finish_reason") or finish
                    stop = choice.get("stop_reason") if choice.get("finish_reason") else stop


def _input(arguments: str) -> Any:
    """A tool call's arguments as the object Anthropic's `input` is (the text where it is none)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}


def add_anthropic_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    serving = AnthropicServingMessages(chat)

    async def answer(call) -> JSONResponse | StreamingResponse:
        try:
            return await call
        except Exception as e:  # noqa: BLE001 - Anthropic's error shape for this API's clients
            err = as_api_error(e)
            if err.status >= 500:
                logger.error("unhandled error in the Messages API", exc_info=e)
            chat.count_error(err.status)
            return JSONResponse(anthropic_error(err.status, err.message), status_code=err.status)

    @app.post("/v1/messages")
    async def create_message(raw: Request):
        return await answer(serving.create(raw))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw: Request):
        return await answer(serving.count_tokens(raw))
