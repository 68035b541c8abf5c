"""Tool calling on /v1/chat/completions, as vLLM does it.

- `tools` go into the chat template (as Hugging Face's `apply_chat_template(..., tools=...)`).
- `tool_choice="auto"` (the default when tools are sent) needs `--enable-auto-tool-choice
  --tool-call-parser NAME`: the model writes freely and the parser finds the calls in its text
  (`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Qwen2.5/3,
  Hermes and SmolLM3 templates; `llama3_json`: `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, Llama 3.1+ templates; `mistral`: `[TOOL_CALLS] [{...}, ...]`;
  `qwen3_coder` / `qwen3_xml`: Qwen3-Coder's XML, `<function=NAME><parameter=KEY>VALUE</parameter>`,
  each value typed by the tool's schema as vLLM types it).
- `tool_choice="required"` and a named function are constrained by the grammar engine (no flags
  needed), so the call always parses: a named function's output is its arguments object (JSON
  schema: the function's `parameters`); `required` outputs a JSON array of
  `{"name": ..., "parameters": {...}}` objects, one of the tools each (vLLM's schema).
- `tool_choice="none"`: plain text, nothing parsed.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from .. import harmony
from ..constraints import StructuredOutputsParams
from .errors import APIError


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


# -- parsers of free text ("auto") ---------------------------------------------------------------
class ToolParser:
    """Finds tool calls in a model's text: (content before the calls or None, calls). Built per
    request with its tools (as chat's `tools`), for parsers that read their schemas."""

    marker = ""  # where the calls begin: a stream withholds text from here on
    other_markers: tuple[str, ...] = ()  # further texts that may begin a call
    keeps_special_tokens = False  # the marker is a special token: the text must keep them

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def first_marker(self, text: str) -> int:
        """Where the first of the markers is in `text` (-1: none is)."""
        found = [at for m in (self.marker, *self.other_markers) if (at := text.find(m)) >= 0]
        return min(found, default=-1)

    def visible_end(self, text: str) -> int:
        """How much of a running choice's text a stream may send as content: nothing from a
        marker on, nor a tail that may begin one."""
        end = len(text)
        for marker in (self.marker, *self.other_markers):
            at = text.find(marker)
            if at >= 0:
                end = min(end, at)
                continue
            for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a tail that may begin the marker waits
                if marker.startswith(text[-k:]):
                    end = min(end, len(text) - k)
                    break
        return end

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def parameters(self, name: str) -> Any:
        """The JSON schema of the request's tool `name`'s parameters (None: no such tool, or none)."""
        for tool in self.tools:
            fn = tool.get("function") or {}
            if fn.get("name") == name:
                return fn.get("parameters")
        return None


class HermesToolParser(ToolParser):
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[at:]):
            try:
                obj = json.loads(body)
            except ValueError:
                return text, []  # not a well-formed call: the text is the answer (as vLLM)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append(ToolCall(function=FunctionCall(name=obj["name"], arguments=_arguments(obj.get("arguments")))))
        content = text[:at].strip()
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    marker = "{"
    _TAG = "<|python_tag|>"

    def visible_end(self, text: str) -> int:
        """A call is the whole output, or none is: all of it waits while it may be one."""
        stripped = text.lstrip()
        maybe_call = not stripped or stripped.startswith(("{", self._TAG)) or self._TAG.startswith(stripped)
        return 0 if maybe_call else len(text)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG) :].lstrip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("parameters", obj.get("arguments"))
            calls.append(ToolCall(function=FunctionCall(name=obj["name"], arguments=_arguments(args))))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls


class MistralToolParser(ToolParser):
    """Mistral's templates: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`. `[TOOL_CALLS]`
    is a special token: the request keeps special tokens in its text (as vLLM's parser does)."""

    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        try:
            items, _ = json.JSONDecoder().raw_decode(text[at + len(self.marker) :].lstrip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        if not all(isinstance(it, dict) and isinstance(it.get("name"), str) for it in items):
            return text, []
        calls = [
            ToolCall(function=FunctionCall(name=it["name"], arguments=_arguments(it.get("arguments")))) for it in items
        ]
        return text[:at].strip() or None, calls


class Qwen3XmlToolParser(ToolParser):
    """Qwen3-Coder's (and later Qwen 3 templates') XML calls, as vLLM's `qwen3_coder` /
    `qwen3_xml` parser reads them: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
    ...</function></tool_call>` (a `<function=` without `<tool_call>` too). A value loses one
    wrapping newline each side and becomes the type its tool's schema says (`coerce`); a
    parameter not closed is dropped."""

    marker = "<tool_call>"
    other_markers: tuple[str, ...] = ("<function=",)
    _PARAM_START = re.compile(r"<\s*parameter\s*=\s*")
    _PARAM_END = re.compile(r"<\s*/\s*parameter\s*>|<\s*parameter\s*=")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.first_marker(text)
        if at < 0:
            return text, []
        calls = []
        for name, body in self._functions(text[at:]):
            properties = self._properties(name.strip())
            args: dict[str, Any] = {}
            for key, value in self._params(body):
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                schema = properties.get(key) if isinstance(properties, dict) else None
                args[key] = coerce(value, schema) if isinstance(schema, dict) else value
            calls.append(
                ToolCall(function=FunctionCall(name=name.strip(), arguments=json.dumps(args, ensure_ascii=False)))
            )
        if not calls:
            return text, []
        return text[:at].strip() or None, calls

    @staticmethod
    def _functions(text: str) -> list[tuple[str, str]]:
        """(name, body) of each `<function=NAME>BODY</function>` (a body not closed runs to the
        end): vLLM's pattern, found in one pass (a regex would rescan the text from every
        `<function=` that has no `>` after it: quadratic on a long output)."""
        out, pos = [], 0
        while (start := text.find("<function=", pos)) >= 0:
            close = text.find(">", start)
            if close < 0:
                break  # no later start has one either
            end = text.find("</function>", close)
            out.append((text[start + len("<function=") : close], text[close + 1 : end if end >= 0 else len(text)]))
            if end < 0:
                break
            pos = end + len("</function>")
        return out

    def _params(self, body: str) -> list[tuple[str, str]]:
        """(key, value) of each `<parameter=KEY>VALUE` closed by `</parameter>` or followed by the
        next `<parameter=` (vLLM's pattern; spaces allowed in the tags), in one pass."""
        out, pos = [], 0
        while (start := self._PARAM_START.search(body, pos)) is not None:
            close = body.find(">", start.end())
            if close < 0:
                break
            end = self._PARAM_END.search(body, close + 1)
            if end is None:
                break  # not closed: dropped, and no later parameter is closed either
            out.append((body[start.end() : close], body[close + 1 : end.start()]))
            pos = end.end() if end.group().lstrip("<").lstrip().startswith("/") else end.start()
        return out

    def _properties(self, name: str) -> Any:
        return (self.parameters(name) or {}).get("properties") or {}


class Glm45ToolParser(Qwen3XmlToolParser):
    """GLM-4.5 to 4.7's calls, as vLLM's `glm45` / `glm47` parser reads them: `<tool_call>NAME
    <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`. Values are kept verbatim,
    then typed by the tool's schema; an argument not closed is dropped. A call of a tool the
    request did not declare is no call (vLLM's check of names): the text stays content."""

    other_markers: tuple[str, ...] = ()
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    _VALUE_START = re.compile(r"\s*<arg_value>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        declared = {(t.get("function") or {}).get("name") for t in self.tools}
        calls = []
        for body in self._CALL.findall(text[at:]):
            name = body.split("<arg_key>", 1)[0].strip()
            if name not in declared:
                continue
            properties = self._properties(name)
            args: dict[str, Any] = {}
            for key, value in self._args(body):
                schema = properties.get(key.strip()) if isinstance(properties, dict) else None
                args[key.strip()] = coerce(value, schema) if isinstance(schema, dict) else value
            calls.append(ToolCall(function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))))
        if not calls:
            return text, []
        return text[:at].strip() or None, calls

    def _args(self, body: str) -> list[tuple[str, str]]:
        """(key, value) of each `<arg_key>KEY</arg_key>` + whitespace + `<arg_value>VALUE</arg_value>`
        (vLLM's pattern: a key runs to the first `</arg_key>` that a value follows), in one pass:
        where a start finds no complete pair after it, no later start does."""
        out, pos = [], 0
        while (start := body.find("<arg_key>", pos)) >= 0:
            end = body.find("</arg_key>", start + len("<arg_key>"))
            while end >= 0 and not self._VALUE_START.match(body, end + len("</arg_key>")):
                end = body.find("</arg_key>", end + 1)
            if end < 0:
                break
            value_start = self._VALUE_START.match(body, end + len("</arg_key>"))
            assert value_start is not None
            value_end = body.find("</arg_value>", value_start.end())
            if value_end < 0:
                break
            out.append((body[start + len("<arg_key>") : end], body[value_start.end() : value_end]))
            pos = value_end + len("</arg_value>")
        return out


class MiniMaxM2ToolParser(Glm45ToolParser):
    """MiniMax-M2's calls, as vLLM's `minimax_m2` parser reads them: `<minimax:tool_call><invoke
    name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke></minimax:tool_call>` (names
    quoted either way or not at all; an `<invoke` without the wrapper too). Values verbatim, then
    typed by the tool's schema; a parameter not closed is dropped; an undeclared tool's call is no
    call."""

    marker = "<minimax:tool_call>"
    other_markers: tuple[str, ...] = ("<invoke name=",)
    _NAME = r"(?:\"([^\"]*)\"|'([^']*)'|([^>\s]+))"
    _INVOKE = re.compile(r"<invoke name=" + _NAME + r"\s*>(.*?)(?:</invoke>|$)", re.DOTALL)
    _PARAM_NAMED = re.compile(
        r"<\s*parameter\s+name\s*=\s*" + _NAME + r"\s*>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s+name\s*=))",
        re.DOTALL,
    )

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self.first_marker(text)
        if at < 0:
            return text, []
        declared = {(t.get("function") or {}).get("name") for t in self.tools}
        calls = []
        for dq, sq, bare, body in self._INVOKE.findall(text[at:]):
            name = (dq or sq or bare).strip()
            if name not in declared:
                continue
            properties = self._properties(name)
            args: dict[str, Any] = {}
            for pdq, psq, pbare, value in self._PARAM_NAMED.findall(body):
                key = (pdq or psq or pbare).strip()
                if not key:
                    continue
                schema = properties.get(key) if isinstance(properties, dict) else None
                args[key] = coerce(value, schema) if isinstance(schema, dict) else value
            calls.append(ToolCall(function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))))
        if not calls:
            return text, []
        return text[:at].strip() or None, calls


class PythonicToolParser(ToolParser):
    """Llama 3.2 / 4's pythonic calls, as vLLM's `pythonic` parser reads them: the whole output is
    a Python list of calls with keyword arguments, `[get_weather(city="Paris", days=3), ...]`,
    or none is. Arguments are Python or JSON literals (None / null, True / true, tuples and sets
    as lists, negative numbers). Read with Python's own parser (linear in the text, where vLLM's
    pre-filter regex needs a timeout against backtracking)."""

    marker = "["
    starts: tuple[str, ...] = ("[",)  # what an output that holds calls starts with

    def visible_end(self, text: str) -> int:
        """The whole output is a call list, or none is: all of it waits while it may be one."""
        maybe_call = text.startswith(self.starts) or any(s.startswith(text) for s in self.starts)
        return 0 if maybe_call else len(text)

    _NAME = re.compile(r"[a-zA-Z]+\w*")
    _LITERALS = {"null": None, "true": True, "false": False}

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if not text.startswith("["):
            return text, []
        try:
            body = ast.parse(text).body
            listed = getattr(body[0], "value", None) if body else None
            if not isinstance(listed, ast.List) or not listed.elts:
                return text, []
            calls = []
            for call in listed.elts:
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                    return text, []
                name = call.func.id
                if not self._NAME.fullmatch(name):
                    return text, []
                args = {}
                for keyword in call.keywords:
                    if keyword.arg is None or not self._NAME.fullmatch(keyword.arg):
                        return text, []
                    args[keyword.arg] = self._value(keyword.value)
                calls.append(ToolCall(function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        return None, calls

    def _value(self, node: ast.expr) -> Any:
        """A literal argument's value (ValueError for anything else: the output is then text)."""
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
            return node.value
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            return {k.value: self._value(v) for k, v in zip(node.keys, node.values)}  # type: ignore[union-attr]
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return [self._value(v) for v in node.elts]
        if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
            return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
        if isinstance(node, ast.Name) and node.id in self._LITERALS:
            return self._LITERALS[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = self._value(node.operand)
            if isinstance(operand, (int, float)) and not isinstance(operand, bool):
                return -operand if isinstance(node.op, ast.USub) else operand
        raise ValueError("a tool call's arguments must be literals")


class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4's: the pythonic list, which the model may wrap in `<|python_start|>` ...
    `<|python_end|>` (special tokens: the request keeps them in its text), taken off first, as
    vLLM's `llama4_pythonic` does."""

    keeps_special_tokens = True
    starts = ("[", "<|python_start|>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if text.startswith("<|python_start|>"):
            text = text[len("<|python_start|>") :].replace("<|python_end|>", "")
        return super().extract(text)


_TYPE_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "object"


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: its `type`, its `enum` values' types, its alternatives'
    (anyOf / oneOf / allOf); {"string"} when it says none (vLLM's rule)."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(t for t in kind if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        types.update(_json_type(v) for v in enum)
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                types |= schema_types(choice)
    return types or {"string"}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def coerce(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as the type its schema says, tried in vLLM's order (null, integer,
    number, boolean, object, array, string); else JSON if it parses, else the text."""
    types = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in schema_types(schema)}
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in types:
            continue
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "string":
            return value
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        if kind == "boolean":
            if value.lower().strip() in ("true", "1"):
                return True
            if value.lower().strip() in ("false", "0"):
                return False
        if kind in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


class OpenAIToolParser(ToolParser):
    """gpt-oss (vLLM's `openai`): harmony's tool calls, messages on the commentary channel to
    `functions.NAME`, which the `openai_gptoss` reasoning parser's split keeps in the content as
    their harmony text (the server refuses this parser without it). Arguments as vLLM returns
    them: JSON re-serialised, other content types as written."""

    marker = harmony.TOOL_CALL_START
    keeps_special_tokens = True

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        rest, messages = harmony.split_tool_calls(text)
        calls = [ToolCall(function=FunctionCall(name=m.function, arguments=m.arguments())) for m in messages]
        return rest or None, calls


class Gemma4ToolParser(ToolParser):
    """Gemma 4's calls, as vLLM's `gemma4` parser reads them: `<|tool_call>call:NAME{KEY:VALUE,...}
    <tool_call|>`, a string between `<|"|>` delimiters, a number or boolean bare, objects `{...}`
    and arrays `[...]` nested (a bare `:NAME{...}` too). Values are typed by the tool's schema,
    nested ones by their `properties` and `items`; without a schema a bare value stays text (as
    vLLM's). A call not closed runs to the end of the text; one without a name is no call; the text
    around the calls is the content."""

    marker = "<|tool_call>"
    keeps_special_tokens = True
    END = "<tool_call|>"
    QUOTE = '<|"|>'

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        calls, outside, pos = [], [], 0
        while (start := text.find(self.marker, pos)) >= 0:
            outside.append(text[pos:start])
            body_at = start + len(self.marker)
            end = text.find(self.END, body_at)
            call = self._call(text[body_at : end if end >= 0 else len(text)])
            if call is not None:
                calls.append(call)
            pos = len(text) if end < 0 else end + len(self.END)
        if not calls:
            return text, []
        outside.append(text[pos:])
        return "".join(outside).strip() or None, calls

    def _call(self, body: str) -> ToolCall | None:
        body = body.strip()
        body = body[len("call:") :] if body.startswith("call:") else body[1:] if body.startswith(":") else body
        opens = [i for i in (body.find("{"), body.find("(")) if i >= 0]
        name = body[: min(opens)].strip() if opens else body.strip()
        if not name:
            return None
        args: dict[str, Any] = {}
        if opens:
            inner = body[min(opens) + 1 :].rstrip()
            inner = inner[:-1] if inner.endswith(("}", ")")) else inner
            try:
                args = self._object(inner)
            except RecursionError:  # nested past Python's stack: no call, the text stays content
                return None
        schema = self.parameters(name)
        typed = self._typed(args, schema) if isinstance(schema, dict) else args
        return ToolCall(function=FunctionCall(name=name, arguments=json.dumps(typed, ensure_ascii=False)))

    def _typed(self, value: Any, schema: dict[str, Any]) -> Any:
        if isinstance(value, str):
            return coerce(value, schema)
        if isinstance(value, dict):
            properties = schema.get("properties")
            if not isinstance(properties, dict):
                return value
            return {
                k: self._typed(v, properties[k]) if isinstance(properties.get(k), dict) else v for k, v in value.items()
            }
        items = schema.get("items")
        return [self._typed(v, items) for v in value] if isinstance(items, dict) else value

    def _object(self, text: str) -> dict[str, Any]:
        """`KEY:VALUE,...` as a dict (keys may be quoted too)."""
        out: dict[str, Any] = {}
        i, n = 0, len(text)
        while i < n:
            while i < n and text[i] in " ,\n\t":
                i += 1
            colon = text.find(":", i)
            if i >= n or colon < 0:
                break
            key = text[i:colon].strip()
            if key.startswith(self.QUOTE) and key.endswith(self.QUOTE) and len(key) >= 2 * len(self.QUOTE):
                key = key[len(self.QUOTE) : -len(self.QUOTE)]
            i = colon + 1
            while i < n and text[i] in " \n\t":
                i += 1
            value, i = self._value(text, i, ",}]")
            if value is not None:
                out[key] = value
        return out

    def _array(self, text: str) -> list[Any]:
        out: list[Any] = []
        i, n = 0, len(text)
        while i < n:
            while i < n and text[i] in " ,\n\t":
                i += 1
            if i >= n:
                break
            value, i = self._value(text, i, ",]")
            if value is None:
                break
            out.append(value)
        return out

    def _value(self, text: str, i: int, stops: str) -> tuple[Any, int]:
        """The value at `i` and where it ends: a delimited string, a nested object or array (to its
        matching bracket, delimited strings skipped), or bare text up to one of `stops`; None
        where there is none."""
        n = len(text)
        if i >= n:
            return "", n
        if text.startswith(self.QUOTE, i):
            close = text.find(self.QUOTE, i + len(self.QUOTE))
            if close < 0:
                return text[i + len(self.QUOTE) :], n
            return text[i + len(self.QUOTE) : close], close + len(self.QUOTE)
        if text[i] in "{[":
            opener, closer = text[i], "}" if text[i] == "{" else "]"
            depth, j = 1, i + 1
            while j < n and depth:
                if text.startswith(self.QUOTE, j):
                    close = text.find(self.QUOTE, j + len(self.QUOTE))
                    j = n if close < 0 else close + len(self.QUOTE)
                    continue
                depth += (text[j] == opener) - (text[j] == closer)
                j += 1
            inner = text[i + 1 : j - 1 if depth == 0 else j]
            return (self._object(inner) if opener == "{" else self._array(inner)), j
        j = i
        while j < n and text[j] not in stops:
            j += 1
        if j == i:
            return None, j + 1  # no value here: step past the stray character
        return text[i:j].strip(), j


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3XmlToolParser,
    "qwen3_xml": Qwen3XmlToolParser,  # vLLM's second name of the same parser
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,  # vLLM's second name of the same parser
    "minimax_m2": MiniMaxM2ToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": Llama4PythonicToolParser,
    "openai": OpenAIToolParser,
    "gemma4": Gemma4ToolParser,
}


# -- a request's tool plan ----------------------------------------------------------------------
@dataclass
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: list[dict[str, Any]]  # for the chat template, as HF takes them
    parser: ToolParser | None = None  # auto
    named: str | None = None  # named
    structured_outputs: StructuredOutputsParams | None = None  # required / named: the call's grammar

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished choice."""
        if self.mode == "named":
            return None, [ToolCall(function=FunctionCall(name=self.named or "", arguments=text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short (max_tokens): not a call
            return None, [
                ToolCall(function=FunctionCall(name=it["name"], arguments=_arguments(it.get("parameters"))))
                for it in items
            ]
        if self.mode == "auto" and self.parser is not None:
            return self.parser.extract(text)
        return text, []

    def visible_end(self, text: str) -> int:
        """How much of a running choice's text a stream may send as content: none of a
        constrained call, nothing from an auto call's marker on (or from a tail that may begin one)."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode != "auto" or self.parser is None:
            return len(text)
        return self.parser.visible_end(text)


def _required_schema(tools: list[ChatTool]) -> dict[str, Any]:
    """vLLM's: a non-empty array of {"name": one tool's name, "parameters": its arguments}."""

    def one(t: ChatTool) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
        }

    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [one(t) for t in tools]}}


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: str | NamedToolChoice | None,
    parser_name: str | None,
    parallel_tool_calls: bool | None = None,
) -> ToolPlan | None:
    """The request's tool plan (None without tools); APIError 400 as vLLM answers."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("When using `tool_choice`, `tools` must be set.", 400, param="tool_choice")
        return None
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", as_dicts)
    if choice == "auto":
        if parser_name is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                400,
                param="tool_choice",
            )
        return ToolPlan("auto", as_dicts, parser=TOOL_PARSERS[parser_name](as_dicts))
    if choice == "required":
        schema = _required_schema(tools)
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", as_dicts, structured_outputs=StructuredOutputsParams(json=schema))
    if isinstance(choice, NamedToolChoice):
        match = [t for t in tools if t.function.name == choice.function.name]
        if not match:
            raise APIError(f"Tool '{choice.function.name}' has not been passed in `tools`.", 400, param="tool_choice")
        params = match[0].function.parameters or {"type": "object", "properties": {}}
        return ToolPlan(
            "named", as_dicts, named=choice.function.name, structured_outputs=StructuredOutputsParams(json=params)
        )
    raise APIError(
        f"tool_choice must be none, auto, required or a named function, got {choice!r}", 400, param="tool_choice"
    )


class ToolStream:
    """Per-choice state of a streamed chat answer with tools. A named call's arguments stream as
    they are generated (the first delta carries the id and name, as vLLM's). Otherwise: content
    deltas up to where a call may begin, then the parsed calls in one delta when the choice
    finishes (each call complete: OpenAI clients accumulate deltas, so that is a valid stream)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent: dict[int, int] = {}  # choice index -> content characters sent
        self.ids: dict[int, str] = {}  # choice index -> its named call's id

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        """(new content or None, tool call deltas or None, finish reason) for a choice whose whole
        text so far is `text`."""
        sent = self.sent.get(index, 0)
        if self.plan.mode == "named":  # the output is the call's arguments: streamed as they come
            self.sent[index] = len(text)
            new = text[sent:]
            if not new and finish_reason is None:
                return None, None, None
            if index not in self.ids:
                self.ids[index] = f"chatcmpl-tool-{uuid.uuid4().hex}"
                fn = DeltaFunctionCall(name=self.plan.named, arguments=new)
                return None, [DeltaToolCall(index=0, id=self.ids[index], type="function", function=fn)], finish_reason
            return None, [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new))], finish_reason
        if finish_reason is None:
            end = max(self.plan.visible_end(text), sent)
            self.sent[index] = end
            return (text[sent:end] or None), None, None
        content, calls = self.plan.parse(text)
        if not calls:  # the parser's content: the text, or what it keeps of it (llama4's tags off)
            return ((content or "")[sent:] or None), None, finish_reason
        rest = (content or "")[sent:] if content else ""
        deltas = [
            DeltaToolCall(
                index=i,
                id=c.id,
                type="function",
                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments),
            )
            for i, c in enumerate(calls)
        ]
        return (rest or None), deltas, finish_for(self.plan, finish_reason, bool(calls))


def finish_for(plan: ToolPlan, finish_reason: str | None, called: bool) -> str | None:
    """vLLM's: "tool_calls" when auto found calls or a required call finished; a named call keeps
    its own reason ("stop")."""
    if called and (plan.mode == "auto" or (plan.mode == "required" and finish_reason == "stop")):
        return "tool_calls"
    return finish_reason
