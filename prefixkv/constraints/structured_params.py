"""`StructuredOutputsParams` with vLLM's class and field names: exactly one constraint (`json`,
`regex`, `choice`, `grammar`, `json_object`) and the options prefixkv implements. Checked here for
shape only; whether a schema, regex or grammar compiles is the grammar engine's to say (the engine
compiles it when the request is added: a ValueError naming the problem)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Bounds on what one request makes the grammar engine compile (compiles run one at a time, so one
# huge constraint stalls every constrained request behind it): a 20,000-option choice compiled in
# ~4 s; 1,024 options take ~0.03 s and 4,096 ~0.5 s on a 2-vCPU AMD Zen 4.
MAX_CHOICES = 1024
MAX_CONSTRAINT_CHARS = 65536  # a choice list's total, a regex, a grammar, a JSON schema's text


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF, as llama.cpp / xgrammar)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    disable_additional_properties: bool = False  # refused unless False
    whitespace_pattern: str | None = None  # refused unless None
    structural_tag: str | None = None  # refused unless None
    disable_fallback: bool = False  # older vLLM: one backend here, nothing to fall back to

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """ValueError naming the problem (the dataclass is mutable: the engine calls it again)."""
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}"
            )
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None:
                raise ValueError(f"StructuredOutputsParams {name} is not supported by prefixkv")
        if self.disable_additional_properties:
            raise ValueError("StructuredOutputsParams disable_additional_properties is not supported by prefixkv")
        for name in ("disable_any_whitespace", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputsParams {name} must be true or false")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured outputs json: the schema is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"structured outputs json: a JSON schema must be an object, got {type(schema).__name__}"
                )
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured outputs regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured outputs grammar must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured outputs choice must be a non-empty list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"structured outputs choice has {len(self.choice)} options; at most {MAX_CHOICES} are accepted"
                )
        size = self._text_size()
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"structured outputs constraint is {size} characters long; at most {MAX_CONSTRAINT_CHARS} are accepted"
            )
        if self.json_object not in (None, True, False):
            raise ValueError("structured outputs json_object must be true or false")

    def _text_size(self) -> int:
        if self.choice is not None:
            return sum(len(c) for c in self.choice)
        for name in ("regex", "grammar"):
            if isinstance(getattr(self, name), str):
                return len(getattr(self, name))
        if self.json is not None:
            return len(self.json if isinstance(self.json, str) else _json.dumps(self.json))
        return 0

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, canonical text, free whitespace). A schema's
        keys keep their order: the grammar emits an object's properties in the order declared
        (as vLLM does), so two orders are two grammars."""
        if self.json is not None:
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return ("json", _json.dumps(schema), not self.disable_any_whitespace)
        if self.regex is not None:
            return ("regex", self.regex, False)
        if self.choice is not None:
            return ("choice", _json.dumps(list(self.choice)), False)
        if self.grammar is not None:
            return ("grammar", self.grammar, False)
        return ("json_object", "", not self.disable_any_whitespace)
