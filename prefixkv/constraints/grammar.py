"""The grammar engine of structured outputs, with two backends: xgrammar (the `xgrammar` extra:
faster masks, docs/structured_outputs.md, bench/structured.py; it pulls in triton, ~1 GB on a CPU
install) and llguidance (guidance.py, always installed). `backend` "auto" takes xgrammar when it is
installed, else llguidance (logged); "xgrammar" without it installed is refused naming the extra.

`GrammarEngine` is built once per engine, lazily on the first structured request: xgrammar's
tokenizer info from prefixkv's own tokenizer (the token strings of the HF `tokenizers` backend,
byte-level or SentencePiece as its decoder says; special tokens blanked so that no grammar can
emit them - only the stop tokens end a grammar). Grammars are compiled off the step loop (when a
request is added, or ahead of it by the server in a worker thread) and cached by their spec.
`RequestGrammar` is one sequence's matcher, advanced on each booked token; `fill_next` fills a
step's allowed-token masks, all its grammars in one batch call (after tokens drawn but not booked
yet, under async scheduling). A `GrammarGate` lets the output run free until a token opens the
grammar (a thinking model's answer is constrained, its reasoning is not).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .guidance import GuidanceBackend

if TYPE_CHECKING:
    from ..model import Tokenizer
    from .structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
_XGR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] [^\s]+:\d+: ")  # "[17:51:09] /project/cpp/x.cc:83: "


def _clean(e: Exception) -> str:
    return _XGR_LOG_PREFIX.sub("", str(e).strip())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Set to -inf, in place, the logits of one row [vocab] whose bit in `bitmask` (int32, bit i of
    the little-endian words = token i, as xgrammar and llguidance fill it) is 0. Unpacking with
    numpy is cheaper on a CPU than xgrammar's kernel (bench/structured.py)."""
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little", count=vocab_size)
    logits[:vocab_size].masked_fill_(torch.from_numpy(allowed.view(np.bool_)).logical_not_(), float("-inf"))


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ... with the strings escaped for xgrammar's EBNF (JSON escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def choose_backend(backend: str) -> str:
    """The backend `backend` names: "auto" is xgrammar when installed, else guidance (llguidance)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown structured outputs backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    have_xgrammar = importlib.util.find_spec("xgrammar") is not None
    if backend == "xgrammar" and not have_xgrammar:
        raise ImportError(
            "structured_outputs_backend='xgrammar' needs the xgrammar package: pip install 'prefixkv[xgrammar]' "
            "(or use the 'guidance' backend, installed with prefixkv)"
        )
    if backend == "auto":
        return "xgrammar" if have_xgrammar else "guidance"
    return backend


class GrammarEngine:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], backend: str = "auto") -> None:
        self.backend = choose_backend(backend)
        logger.info("structured outputs: the %s grammar backend (asked: %s)", self.backend, backend)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._compile_lock = threading.Lock()  # one compilation at a time (server worker threads)
        self._guidance: GuidanceBackend | None = None
        if self.backend == "guidance":
            self._guidance = GuidanceBackend(tokenizer, vocab_size, stop_token_ids, fill_threads())
            return
        import xgrammar as xgr

        self._xgr = xgr
        self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads())
        backend_tok = tokenizer.backend
        encoded = [""] * vocab_size  # rows the tokenizer lacks (padded embeddings) stay special
        for piece, i in backend_tok.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = piece
        for i, added in backend_tok.get_added_tokens_decoder().items():
            if added.special and i < vocab_size and i not in stop_token_ids:
                encoded[i] = ""  # xgrammar treats empty tokens as special: never allowed by a grammar
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend_tok.to_str())
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded,
            meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=sorted(stop_token_ids),
            add_prefix_space=bool(meta["add_prefix_space"]),
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec` (cached). ValueError naming the problem when the schema,
        regex or grammar is invalid or unsupported."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, text, any_ws = key
        with self._compile_lock:
            return self._compile(key, kind, text, any_ws)

    def _compile(self, key: tuple[Any, ...], kind: str, text: str, any_ws: bool) -> Any:
        with self._lock:  # compiled by another thread meanwhile
            hit = self._cache.get(key)
            if hit is not None:
                return hit
        compiled: Any
        if self._guidance is not None:
            compiled = self._guidance.compile(kind, text, any_ws)
            self._keep(key, compiled)
            return compiled
        c = self._compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(text, any_whitespace=any_ws)
            elif kind == "json_object":
                compiled = (
                    c.compile_builtin_json_grammar()
                    if any_ws
                    else c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
                )
            elif kind == "regex":
                compiled = c.compile_regex(text)
            elif kind == "choice":
                compiled = c.compile_grammar(choice_ebnf(json.loads(text)))
            else:
                compiled = c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice"}
            raise ValueError(f"invalid structured outputs {what.get(kind, 'grammar')}: {_clean(e)}") from None
        self._keep(key, compiled)
        return compiled

    def _keep(self, key: tuple[Any, ...], compiled: Any) -> None:
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)

    def matcher(self, compiled: Any, gate: GrammarGate | None = None) -> RequestGrammar:
        if self._guidance is not None:
            return RequestGrammar(self._guidance.matcher(compiled), self.vocab_size, self._guidance.fill_rows, gate)
        return RequestGrammar(self._xgr.GrammarMatcher(compiled), self.vocab_size, self._fill_rows, gate)

    def _fill_rows(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def fill_threads() -> int:
    """Threads that fill a step's grammar masks: half the host's cores, as xgrammar's and vLLM's
    default (on a 2-vCPU AMD Zen 4 one thread filled 256 JSON masks in 0.46 ms, two in 0.60)."""
    return max(1, (os.cpu_count() or 2) // 2)


def fill_next(
    grammars: Sequence[RequestGrammar], pending: Sequence[Sequence[int]], bitmask: torch.Tensor, rows: Sequence[int]
) -> list[bool]:
    """Fill row `rows[i]` of `bitmask` (int32 [R, words]) with the tokens grammars[i] allows after
    its booked tokens and `pending[i]` (tokens drawn, not booked yet: accepted for the mask, then
    rolled back), one call to the backend's batch fill for them all (a row each took 1.1-2.5x as
    long at batch 32-256 on a 2-vCPU AMD Zen 4: bench/structured.py). False where pending[i]
    ends the grammar or breaks it, its row untouched: the sequence ends at those tokens, and what
    is drawn after them is dropped unread."""
    ok = [True] * len(grammars)
    taken = [0] * len(grammars)
    closed: set[int] = set()  # gated grammars still closed after their pending tokens
    first: list[int] = []  # gated grammars whose next token is the reply's first (GrammarGate.first_unless)
    try:
        for i, (grammar, tokens) in enumerate(zip(grammars, pending)):
            m = grammar._matcher
            if grammar.gate is not None and not grammar.opened:
                at_start = grammar.num_accepted == 0
                at = grammar.gate.opening(tokens, grammar.closed_tail, at_start)
                if at is None and at_start and not tokens and grammar.gate.first_unless:
                    first.append(i)  # the grammar's first tokens, and the openers added below
                    continue
                if at is None:
                    closed.add(i)
                    continue
                tokens = tokens[at:]
            for token in tokens:
                if not m.accept_token(token):
                    ok[i] = False
                    break
                taken[i] += 1
                if m.is_terminated():
                    ok[i] = False
                    break
        # one engine's grammars share one filler (bound methods of one object compare equal)
        by_filler: dict[Callable[[list[Any], torch.Tensor, list[int]], None], list[int]] = {}
        for i in closed:  # free until the gate opens, but for openers the grammar would refuse
            bitmask[rows[i]].copy_(grammars[i].closed_mask())
        for i, grammar in enumerate(grammars):
            if ok[i] and i not in closed:
                by_filler.setdefault(grammar._fill_rows, []).append(i)
        for members in by_filler.values():
            if len(members) == 1:
                grammars[members[0]]._matcher.fill_next_token_bitmask(bitmask, rows[members[0]])
            else:
                fill_rows = grammars[members[0]]._fill_rows
                fill_rows([grammars[i]._matcher for i in members], bitmask, [rows[i] for i in members])
        for i in first:
            gate = grammars[i].gate
            assert gate is not None
            bits = bitmask[rows[i]].numpy().view(np.uint32)
            for t in gate.first_unless:
                bits[t >> 5] |= np.uint32(1) << np.uint32(t & 31)
    finally:
        for grammar, n in zip(grammars, taken):
            if n:
                grammar._matcher.rollback(n)
    return ok


@dataclass(frozen=True)
class GrammarGate:
    """Where a sequence's grammar begins: the output is free until one of `after` (a token the
    grammar never sees: a thinking model's end of reasoning), one of `at` (the grammar's first
    token: an answer that begins without that end, as a Qwen 3 tool call may), or the tokens of
    `after_run` in a row (a header that begins the answer: gpt-oss's `<|channel|>final<|message|>`).
    vLLM's reasoning gate of structured outputs."""

    after: frozenset[int]
    at: frozenset[int] = frozenset()
    after_run: tuple[int, ...] = ()
    # the grammar opens at the reply's first token unless it is one of these (a model that opens
    # its reasoning itself, Gemma 4's `<|channel>`): that first token is the grammar's or one of them
    first_unless: frozenset[int] = frozenset()

    def opening(self, tokens: Sequence[int], before: Sequence[int] = (), at_start: bool = False) -> int | None:
        """Where the grammar's tokens begin in `tokens` (drawn while closed, after the closed
        tokens `before`: their tail, which a run may begin in; `at_start`: the first of them is the
        reply's first); None: still closed."""
        if at_start and self.first_unless and tokens and tokens[0] not in self.first_unless:
            return 0
        run = self.after_run
        for j, token in enumerate(tokens):
            if token in self.after:
                return j + 1
            if token in self.at:
                return j
            if run and token == run[-1] and self.ends_run(before, tokens[: j + 1]):
                return j + 1
        return None

    def ends_run(self, before: Sequence[int], tokens: Sequence[int]) -> bool:
        """Whether `before` then `tokens` end with `after_run`."""
        n = len(self.after_run)
        tail = list(before[-n:]) + list(tokens[-n:])
        return n > 0 and tuple(tail[-n:]) == self.after_run


class RequestGrammar:
    """One sequence's grammar state: the tokens booked so far (`accept`). Preemption needs nothing
    here: prefixkv preempts by recompute and keeps the sampled tokens, so the matcher's state stays
    the tokens accepted.

    A step scheduled ahead (async scheduling) samples before the previous step's token is booked:
    its mask takes that token as pending, accepted for the mask and rolled back after (`fill_next`).

    With a `gate`, the tokens before it opens are booked without reaching the matcher; meanwhile
    a step's mask allows every token but an opener the grammar could not begin with."""

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        fill_rows: Callable[[list[Any], torch.Tensor, list[int]], None],
        gate: GrammarGate | None = None,
    ) -> None:
        self._matcher = matcher
        self._fill_rows = fill_rows  # the engine's batch fill: (matchers, bitmask, rows)
        self.num_words = (vocab_size + 31) // 32
        self.num_accepted = 0  # tokens booked, those before the gate opened included
        self.gate = gate
        self.opened = gate is None
        self.closed_tail: list[int] = []  # the last tokens booked while closed (a gate's `after_run`)
        self._closed_mask: torch.Tensor | None = None

    def fill(self, bitmask: torch.Tensor, pending: Sequence[int] = ()) -> bool:
        """`fill_next` of this grammar alone, into row 0 of `bitmask`."""
        return fill_next([self], [pending], bitmask, [0])[0]

    def accept(self, token: int) -> None:
        self.num_accepted += 1
        if not self.opened:
            gate = self.gate
            assert gate is not None
            # the reply's first token is the grammar's unless it opens reasoning (first_unless)
            if not (self.num_accepted == 1 and gate.first_unless and token not in gate.first_unless):
                if token in gate.after:
                    self.opened = True
                    return
                run = gate.after_run
                if run:
                    if gate.ends_run(self.closed_tail, [token]):
                        self.opened = True
                        return
                    self.closed_tail = [*self.closed_tail, token][1 - len(run) :] if len(run) > 1 else []
                if token not in gate.at:
                    return
            self.opened = True
        if not self._matcher.accept_token(token):
            self.num_accepted -= 1
            raise ValueError(f"token {token} does not continue the structured output's grammar")

    @property
    def is_terminated(self) -> bool:
        return self.opened and bool(self._matcher.is_terminated())

    def closed_mask(self) -> torch.Tensor:
        """The mask while the gate is closed (int32 [words]): every token, but the `at` openers
        the grammar refuses as its first token (asked of the matcher itself, which has seen
        nothing yet, and rolled back: llguidance's mask may show an added token its matcher then
        refuses). Built once."""
        if self._closed_mask is None:
            assert self.gate is not None
            mask = torch.full((self.num_words,), -1, dtype=torch.int32)
            bits = mask.numpy().view(np.uint32)
            for t in self.gate.at:
                if self._matcher.accept_token(t):
                    self._matcher.rollback(1)
                else:
                    bits[t >> 5] &= ~(np.uint32(1) << np.uint32(t & 31))
            self._closed_mask = mask
        return self._closed_mask
