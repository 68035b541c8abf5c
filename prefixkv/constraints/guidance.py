"""The llguidance backend of the grammar engine (grammar.py): each constraint as an llguidance
grammar over prefixkv's own tokenizer (its HF `tokenizers` JSON; llguidance never lets a grammar
emit a special token it does not name). JSON without free whitespace uses xgrammar's separators
(", " and ": "), so both backends accept the same compact form."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..model import Tokenizer

_KINDS = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice"}
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def strict_schema(schema: Any) -> Any:
    """`schema` with xgrammar's strict mode written out, so both backends accept one language: an
    object takes no properties beyond those listed and a tuple no items beyond its prefixItems,
    unless the schema says otherwise."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in (*_SUBSCHEMA_LISTS, "items", "additionalProperties", "not", "if", "then", "else"):
        if key in out:
            out[key] = strict_schema(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], threads: int) -> None:
        import llguidance
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._fill_par = llguidance.torch.fill_next_token_bitmask_par
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(stop_token_ids)
        )
        self._stop = frozenset(stop_token_ids)

    def compile(self, kind: str, text: str, any_ws: bool) -> str:
        m = self._llg.LLMatcher
        try:
            if kind in ("json", "json_object"):
                schema = json.dumps(strict_schema(json.loads(text))) if kind == "json" else '{"type": "object"}'
                options: dict[str, Any] = (
                    {"whitespace_flexible": True}
                    if any_ws
                    else {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                )
                grammar = m.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
            elif kind == "regex":
                grammar = m.grammar_from_regex(text)
            elif kind == "choice":
                grammar = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
            else:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = m.grammar_from_lark(gbnf_to_lark(text))
            error = m.validate_grammar(grammar, self._tokenizer)
        except Exception as e:  # noqa: BLE001 (the schema compiler and the GBNF converter raise their own types)
            error = str(e)
        if error:
            raise ValueError(f"invalid structured outputs {_KINDS.get(kind, 'grammar')}: {error.strip()}")
        return grammar

    def matcher(self, compiled: str) -> GuidanceMatcher:
        matcher = self._llg.LLMatcher(self._tokenizer, compiled)
        if matcher.is_error():
            raise ValueError(f"invalid structured outputs grammar: {matcher.get_error()}")
        return GuidanceMatcher(matcher, self._fill, self._stop)

    def fill_rows(self, matchers: list[GuidanceMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill row rows[i] of `bitmask` for matchers[i], in parallel on the executor's threads."""
        self._fill_par(self._executor, [(m._matcher, row) for m, row in zip(matchers, rows)], bitmask)


class GuidanceMatcher:
    """xgrammar's matcher interface over an llguidance one: terminated once a stop token is accepted."""

    def __init__(self, matcher: Any, fill: Any, stop: frozenset[int]) -> None:
        self._matcher = matcher
        self._fill = fill
        self._stop = stop
        self._terminated = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        self._fill(self._matcher, bitmask, index)

    def accept_token(self, token: int) -> bool:
        """False, the state unchanged, when the grammar does not take `token` (a failed consume
        would leave llguidance's matcher broken for good; the check costs ~0.4 us). A stop token
        is taken where the grammar may end and only marks the end: llguidance's own history
        counts it or not by the state it ends, which would make rollbacks miscount."""
        if token in self._stop:
            if not self._matcher.is_accepting():
                return False
            self._terminated = True
            return True
        if self._matcher.validate_tokens([token]) != 1:
            return False
        return bool(self._matcher.consume_token(token)) and not self._matcher.is_error()

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted (a stop token is only ever the last one)."""
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._matcher.rollback(num_tokens)
