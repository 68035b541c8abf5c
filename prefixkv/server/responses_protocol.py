"""POST /v1/responses' request body (OpenAI's Responses API, with vLLM's sampling extras), and
the translation of its input items into chat messages.

What is implemented: text (and image) input as a string or a list of items, `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, `previous_response_id`, `store`,
`text.format` (structured outputs), function `tools` / `tool_choice` / `parallel_tool_calls`,
`include: ["message.output_text.logprobs"]` with `top_logprobs`, `truncation`, `reasoning.effort`
(to the chat template, as vLLM) and `include_reasoning`; `reasoning` input items (vLLM's rule:
the reasoning of the assistant message they precede or follow).
Fields that change nothing a local engine produces (`metadata`, `user`, `safety_identifier`,
`prompt_cache_key`, `service_tier`) are accepted and echoed. Everything else is refused by name."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

# Known Responses fields that prefixkv does not implement, with why (400 naming the field).
REFUSED = {
    "background": "background responses are not supported: wait for the response, or stream it",
    "max_tool_calls": "max_tool_calls is not supported (tools run on the client: at most one turn of calls)",
    "conversation": "conversation objects are not supported: chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "context_management": "context management (compaction) is not supported",
    "prompt_cache_retention": "the prefix cache keeps what fits its memory: a retention is not configurable",
    "prompt_cache_options": "the prefix cache needs no options: shared prefixes are reused automatically",
    "moderation": "moderation is not supported",
    "stop": "the Responses API has no stop sequences: use /v1/chat/completions",
}

LOGPROBS = "message.output_text.logprobs"  # the one `include` entry implemented

# OpenAI's built-in tools run on OpenAI's servers: nothing here can run them.
BUILTIN_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "custom",
)


class ResponsesRequest(BaseModel):
    """Undeclared fields are kept in `model_extra` so that they are refused by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, strict=True)  # true is not 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = True  # null counts as not sent: stored
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # {"effort": ...}: handed to the chat template as `reasoning_effort` (vLLM's); no summaries are made
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, false leaves the reasoning item out
    # accepted, echoed: nothing a local engine produces depends on them
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # vLLM's extras
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def refusals(self) -> list[tuple[str, str]]:
        """(field, why) for every field sent that is not implemented; null counts as not sent."""
        out = [
            (name, REFUSED.get(name, "unrecognized request argument"))
            for name, value in (self.model_extra or {}).items()
            if value is not None and value != [] and name != "background"
        ]
        for entry in self.include or ():
            if entry != LOGPROBS:
                out.append(("include", f"{entry!r} is not supported (only {LOGPROBS!r})"))
        if self.top_logprobs and not self.wants_logprobs:
            out.append(("top_logprobs", f"top_logprobs needs include [{LOGPROBS!r}]"))
        if self.background:
            out.append(("background", REFUSED["background"]))
        if self.stream_options and self.stream_options.get("include_obfuscation"):
            out.append(("stream_options", "include_obfuscation is not supported"))
        for key, value in (self.text or {}).items():
            if key != "format" and value is not None:
                out.append((f"text.{key}", "only text.format is supported"))
        for key, value in (self.reasoning or {}).items():
            if key != "effort" and value is not None:
                out.append((f"reasoning.{key}", "no reasoning summaries are made: only reasoning.effort is supported"))
        return out


def _text_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """An item's content as chat content: a string, or chat parts (text, image_url)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of parts", 400, param="input")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise APIError(f"{at}: input_image needs an image_url (file_id is not supported)", 400, param="input")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(f"{at}: content part type {kind!r} is not supported", 400, param="input")
    return parts


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages: messages (system, developer -> system, user,
    assistant), function calls (an assistant message's tool_calls) and their outputs (tool
    messages). Other item types are refused by name."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError("input must not be empty", 400, param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object, got {type(item).__name__}", 400, param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}", 400, param="input"
                )
            content = _text_of(item.get("content"), where)
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and last["role"] == "assistant" and last["content"] is None:
                last["content"] = content  # the answer after its reasoning item: one message
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "reasoning":  # vLLM's: the reasoning of the assistant message beside it
            reasoning = _reasoning_text(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("reasoning") is None:
                last["reasoning"] = reasoning
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise APIError(
                    f"{where}: a function_call needs call_id, name and arguments strings", 400, param="input"
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn: one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(f"{where}: a function_call_output needs a call_id string", 400, param="input")
            if not isinstance(output, (str, list)):
                raise APIError(f"{where}.output must be a string or a list of parts", 400, param="input")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise APIError(f"{where}: input item type {kind!r} is not supported", 400, param="input")
    for m in messages:
        if m["content"] is None:  # a reasoning item with no answer after it
            m["content"] = ""
    return messages


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content's first part, else its summary's (as vLLM)."""
    if item.get("encrypted_content"):
        raise APIError(f"{where}: encrypted reasoning content is not supported", 400, param="input")
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            text = parts[0].get("text") if isinstance(parts, list) and isinstance(parts[0], dict) else None
            if not isinstance(text, str):
                raise APIError(f"{where}.{key}[0].text must be a string", 400, param="input")
            return text
    return ""


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat's `{"type": "function", "function": {...}}`."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            why = "built-in tools run on OpenAI's servers" if kind in BUILTIN_TOOLS else "only function tools"
            raise APIError(f"tools[{i}]: tool type {kind!r} is not supported ({why})", 400, param="tools")
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' `{"type": "function", "name": ...}` -> chat's named choice; modes pass as they are."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(f"tool_choice {choice!r} is not supported (a function, or a mode)", 400, param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format`: text, json_object, or json_schema (flat in
    Responses: name, schema, strict beside the type)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(
            f"text.format {fmt!r} is not supported (text, json_object, json_schema)", 400, param="text.format"
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: v for k, v in fmt.items() if k in ("name", "description", "schema", "strict")}
    return {"type": "json_schema", "json_schema": schema}


def assistant_message(text: str, calls: list[dict[str, Any]], reasoning: str | None = None) -> dict[str, Any]:
    """A finished response's output as the assistant message its next turn renders."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
    return message
