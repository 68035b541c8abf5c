"""Request traces for replay: the Mooncake format (block-level hash ids) and a simple JSONL of
prompts or token ids.

Mooncake (kvcache-ai/Mooncake, FAST'25 traces): one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids`, the chained hashes of the prompt's 512-token
blocks (the last one may be partial). The trace carries no text, so each id is expanded into a
deterministic run of token ids: id `h` stands for the tokens `h * 512 + j`, j = 0..511, and a
prompt is the concatenation of its ids' runs cut to `input_length`. Distinct ids give distinct
tokens, equal ids equal tokens, so the real manager's exact keys see exactly the sharing that the
trace records, at any block size (a block size that divides 512 maps blocks onto sub-runs of one
id; other sizes straddle ids, which is still exact but no longer aligned with the trace).

Simple JSONL: one object per line with either `prompt_token_ids` (or `token_ids`, a list of ints)
or `prompt` (text, tokenized as its UTF-8 bytes - enough to replay sharing, no model needed);
optional `timestamp` (ms, default: the line number x 1000) and `output_length` (default 128).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_OUTPUT_LENGTH = 128


@dataclass
class TraceRequest:
    """One request of a trace: arrival time, prompt and output length. Either `hash_ids`
    (Mooncake) or `token_ids` is set; `prompt_token_ids()` gives the tokens either way."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None = None
    token_ids: tuple[int, ...] | None = None

    def prompt_token_ids(self) -> list[int]:
        if self.token_ids is not None:
            return list(self.token_ids)
        if self.hash_ids is None:
            raise ValueError("a trace request needs hash_ids or token_ids")
        return expand_hash_ids(self.hash_ids, self.input_length)


def expand_hash_ids(
    hash_ids: Iterable[int], input_length: int, tokens_per_id: int = MOONCAKE_BLOCK_TOKENS
) -> list[int]:
    """The deterministic token run of a Mooncake prompt: id h -> h*tokens_per_id + j, cut to
    input_length (the last id may be partial)."""
    out: list[int] = []
    for h in hash_ids:
        base = h * tokens_per_id
        out.extend(range(base, base + tokens_per_id))
    if len(out) < input_length:
        raise ValueError(f"{len(out) // tokens_per_id} hash ids cannot cover {input_length} tokens")
    del out[input_length:]
    return out


def _lines(path: str | Path, limit: int | None) -> Iterator[tuple[int, dict]]:
    with open(path) as f:
        n = 0
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if limit is not None and n >= limit:
                return
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            n += 1


def parse_mooncake(obj: dict, where: str = "") -> TraceRequest:
    try:
        hash_ids = tuple(int(h) for h in obj["hash_ids"])
        input_length = int(obj["input_length"])
        req = TraceRequest(float(obj["timestamp"]), input_length, int(obj["output_length"]), hash_ids=hash_ids)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a Mooncake record ({e!r})") from None
    if input_length < 1 or req.output_length < 0:
        raise ValueError(f"{where}: input_length must be >= 1 and output_length >= 0")
    need = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) < need:
        raise ValueError(
            f"{where}: {len(hash_ids)} hash ids for {input_length} tokens "
            f"(need {need} of {MOONCAKE_BLOCK_TOKENS} tokens each)"
        )
    return req


def parse_simple(obj: dict, index: int, where: str = "") -> TraceRequest:
    if "prompt_token_ids" in obj or "token_ids" in obj:
        tokens = tuple(int(t) for t in obj.get("prompt_token_ids", obj.get("token_ids")) or ())
    elif "prompt" in obj:
        tokens = tuple(str(obj["prompt"]).encode("utf-8"))
    else:
        raise ValueError(f"{where}: needs prompt_token_ids, token_ids or prompt")
    if not tokens:
        raise ValueError(f"{where}: empty prompt")
    ts = float(obj.get("timestamp", index * 1000.0))
    return TraceRequest(ts, len(tokens), int(obj.get("output_length", DEFAULT_OUTPUT_LENGTH)), token_ids=tokens)


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    return _sorted([parse_mooncake(obj, f"{path}:{n}") for n, obj in _lines(path, limit)])


def load_jsonl(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    return _sorted([parse_simple(obj, i, f"{path}:{n}") for i, (n, obj) in enumerate(_lines(path, limit))])


def load_trace(path: str | Path, limit: int | None = None, fmt: str = "auto") -> list[TraceRequest]:
    """Load either format; `auto` looks at the first record (hash_ids -> Mooncake)."""
    if fmt == "auto":
        first = next(_lines(path, 1), None)
        if first is None:
            raise ValueError(f"{path}: empty trace")
        fmt = "mooncake" if "hash_ids" in first[1] else "jsonl"
    if fmt == "mooncake":
        return load_mooncake(path, limit)
    if fmt == "jsonl":
        return load_jsonl(path, limit)
    raise ValueError(f"unknown trace format {fmt!r}; choose auto, mooncake or jsonl")


def _sorted(reqs: list[TraceRequest]) -> list[TraceRequest]:
    # stable: requests with equal timestamps keep their file order (FCFS)
    return sorted(reqs, key=lambda r: r.timestamp_ms)
