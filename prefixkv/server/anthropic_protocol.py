"""POST /v1/messages' request body (Anthropic's Messages API, as vLLM serves it), its translation
into a chat request, and the reply's shapes.

A message is a chat completion underneath (server/anthropic.py): `system` and the messages'
content blocks become chat messages - `text`, `image` (base64 or a data URL), `thinking` (the
assistant message's `reasoning`), `tool_use` (its tool calls), `tool_result` (a tool message) -
and `tools` / `tool_choice` / `thinking` / `output_config.format` the chat fields that do the
same. What it does not implement is refused by name (400); `metadata`, `service_tier` and blocks'
`cache_control` (prefix caching here is automatic and exact) are accepted and logged once."""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

# Anthropic fields prefixkv does not implement, with why (400 naming the field).
REFUSED = {
    "container": "code execution containers run on Anthropic's servers",
    "mcp_servers": "MCP servers are not supported: tools run on the client",
    "context_management": "context management (clearing tool results) is not supported",
    "inference_geo": "one machine here: no region to choose",
}
# accepted, logged once: nothing a local engine produces depends on them
NO_EFFECT = {
    "metadata": "Anthropic's request tags: nothing is stored here",
    "service_tier": "one processing tier here",
    "cache_control": "prefix caching is automatic and exact here: no breakpoints are needed",
    "thinking.adaptive": "a model thinks as deep as it does without it: nothing here sets its depth",
}
# the tool types of Anthropic's own (server or client) tools: nothing here runs them
_TOOL_TYPES = ("custom", None)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicMessagesRequest(BaseModel):
    """Undeclared fields are kept in `model_extra` so that they are refused by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[AnthropicMessage]
    max_tokens: int = Field(strict=True, ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # vLLM's extras
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def refusals(self) -> list[tuple[str, str]]:
        """(field, why) for every field sent that is not implemented; null counts as not sent."""
        return [
            (name, REFUSED.get(name, "unrecognized request argument"))
            for name, value in (self.model_extra or {}).items()
            if value is not None
        ]


class AnthropicCountTokensRequest(AnthropicMessagesRequest):
    """What `count_tokens` takes (Anthropic's: the prompt's parts); a generation field sent to it
    changes no count, so it is refused by name rather than ignored."""

    max_tokens: int = Field(default=1, strict=True, ge=1)  # not sent: the count needs none

    _NOT_COUNTED: ClassVar[tuple[str, ...]] = (
        "max_tokens",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "service_tier",
    )

    def refusals(self) -> list[tuple[str, str]]:
        why = "count_tokens counts the prompt: a generation field changes no count"
        sent = [(name, why) for name in self._NOT_COUNTED if name in self.model_fields_set]
        return super().refusals() + sent


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(f"{where} must be a string", 400, param="messages")
    return value


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a data URL (base64, or a data URL given as a url source); a
    remote URL is refused: nothing here fetches from the network."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise APIError(f"{where}.source must be an object", 400, param="messages")
    if source.get("type") == "base64":
        media = _text(source.get("media_type"), f"{where}.source.media_type")
        return f"data:{media};base64,{_text(source.get('data'), f'{where}.source.data')}"
    if source.get("type") == "url":
        url = _text(source.get("url"), f"{where}.source.url")
        if url.startswith("data:"):
            return url
        raise APIError(f"{where}: image URLs are not fetched here (send the image as base64)", 400, param="messages")
    raise APIError(f"{where}.source.type {source.get('type')!r} is not supported (base64)", 400, param="messages")


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of blocks", 400, param="messages")
    parts = []
    for j, item in enumerate(content):
        if not isinstance(item, dict) or item.get("type") != "text":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise APIError(f"{where}.content[{j}]: {kind!r} is not supported in a tool result (text)", 400)
        parts.append(_text(item.get("text"), f"{where}.content[{j}].text"))
    return "\n".join(parts)


def chat_messages(req: AnthropicMessagesRequest, no_effect: set[str]) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat messages (vLLM's translation). Names of
    accepted no-effect fields met inside blocks are added to `no_effect`."""
    out: list[dict[str, Any]] = []
    if req.system:
        if isinstance(req.system, str):
            system = req.system
        else:
            texts = []
            for i, block in enumerate(req.system):
                if not isinstance(block, dict) or block.get("type") != "text":
                    raise APIError(f"system[{i}] must be a text block", 400, param="system")
                if block.get("cache_control") is not None:
                    no_effect.add("cache_control")
                texts.append(_text(block.get("text"), f"system[{i}].text"))
            system = "".join(texts)
        if system:
            out.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(msg.content):
            at = f"{where}.content[{j}]"
            if not isinstance(block, dict):
                raise APIError(f"{at} must be a content block", 400, param="messages")
            if block.get("cache_control") is not None:
                no_effect.add("cache_control")
            kind = block.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": _text(block.get("text"), f"{at}.text")})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
            elif kind == "thinking" and msg.role == "assistant":
                reasoning.append(_text(block.get("thinking"), f"{at}.thinking"))
            elif kind == "redacted_thinking" and msg.role == "assistant":
                continue  # opaque: Anthropic's encrypted reasoning, nothing to render
            elif kind == "tool_use" and msg.role == "assistant":
                arguments = block.get("input") if block.get("input") is not None else {}
                if not isinstance(arguments, dict):
                    raise APIError(f"{at}.input must be an object", 400, param="messages")
                name = _text(block.get("name"), f"{at}.name")
                call_id = _text(block.get("id"), f"{at}.id")
                calls.append(
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
                )
            elif kind == "tool_result" and msg.role == "user":
                call_id = _text(block.get("tool_use_id"), f"{at}.tool_use_id")
                results.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, at)})
            else:
                raise APIError(f"{at}: content block type {kind!r} is not supported in a {msg.role} message", 400)
        out.extend(results)  # a user turn's tool results come first, as the calls they answer
        if parts or calls or reasoning or not results:
            message: dict[str, Any] = {"role": msg.role}
            if len(parts) == 1 and parts[0]["type"] == "text":
                message["content"] = parts[0]["text"]
            else:
                message["content"] = parts if parts else ""
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning"] = "".join(reasoning)
            out.append(message)
    return out


def chat_tools(tools: list[dict[str, Any]] | None, no_effect: set[str]) -> list[dict[str, Any]] | None:
    """Custom tools as chat's function tools; a tool's `cache_control` goes to `no_effect`, a key
    of its own that nothing here reads is refused by name."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        for key, value in tool.items():
            if key == "cache_control" and value is not None:
                no_effect.add("cache_control")
            elif key not in ("type", "name", "description", "input_schema", "strict", "cache_control"):
                raise APIError(f"tools[{i}].{key} is not supported", 400, param="tools")
        if tool.get("type") not in _TOOL_TYPES:
            raise APIError(
                f"tools[{i}]: tool type {tool.get('type')!r} is not supported (Anthropic's own tools run on its "
                "servers or on the client's terms: declare a custom tool with an input_schema)",
                400,
                param="tools",
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise APIError(f"tools[{i}].input_schema must be a JSON schema object", 400, param="tools")
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": schema,
            "strict": tool.get("strict"),  # as chat's
        }
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": _text(choice.get("name"), "tool_choice.name")}}, parallel
    raise APIError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", 400, param="tool_choice")


def chat_request_body(req: AnthropicMessagesRequest, no_effect: set[str]) -> dict[str, Any]:
    """The chat request's fields (vLLM's translation): thinking enabled sets a thinking budget,
    disabled turns the template's thinking off; output_config.format is a JSON schema."""
    choice, parallel = chat_tool_choice(req.tool_choice)
    tools = chat_tools(req.tools, no_effect)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req, no_effect),
        "max_completion_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": tools,
        "tool_choice": choice if choice is not None else ("auto" if tools else None),
        "parallel_tool_calls": parallel,
        "cache_salt": req.cache_salt,
        "chat_template_kwargs": req.chat_template_kwargs,
    }
    thinking = req.thinking or {}
    kind = thinking.get("type")
    for key, value in thinking.items():
        if key not in ("type", "budget_tokens") and value is not None:
            raise APIError(f"thinking.{key} is not supported (type, budget_tokens)", 400, param="thinking")
    if kind == "adaptive":  # the model's own depth: what it does here anyway
        no_effect.add("thinking.adaptive")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise APIError("thinking.budget_tokens must be a positive integer", 400, param="thinking")
        body["thinking_token_budget"] = budget
    elif kind == "disabled":
        body["reasoning_effort"] = "none"
    elif kind not in (None, "adaptive"):
        raise APIError(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", 400, param="thinking")
    config = req.output_config or {}
    for key in config:
        if key not in ("format", "effort"):
            raise APIError(f"output_config.{key} is not supported (format, effort)", 400, param="output_config")
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError('output_config.format must be {"type": "json_schema", "schema": {...}}', 400)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        body["reasoning_effort"] = config["effort"]
    return {k: v for k, v in body.items() if v is not None}


def stop_reason(finish: str | None, stop: int | str | None, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a chat choice's end (vLLM's mapping): max_tokens
    when cut short, tool_use when tools were called, stop_sequence for a stop string, else end_turn."""
    if finish == "length":
        return "max_tokens", None
    if called or finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: its input_tokens leave out what was read from the cache."""
    return {
        "input_tokens": max(0, prompt_tokens - cached),
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def signature() -> str:
    """A thinking block's signature. Anthropic's sign their reasoning; nothing checks these here."""
    return uuid.uuid4().hex
