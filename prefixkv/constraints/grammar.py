"""The grammar engine of structured outputs, with two backends: xgrammar (the `xgrammar` extra:
faster masks, docs/structured_outputs.md, bench/structured.py; it pulls in triton, ~1 GB on a CPU
install) and llguidance (guidance.py, always installed). `backend` "auto" takes xgrammar when it is
installed, else llguidance (logged); "xgrammar" without it installed is refused naming the extra.

`GrammarEngine` is built once per engine, lazily on the first structured request: xgrammar's
tokenizer info from prefixkv's own tokenizer (the token strings of the HF `tokenizers` backend,
byte-level or SentencePiece as its decoder says; special tokens blanked so that no grammar can
emit them - only the stop tokens end a grammar). Grammars are compiled off the step loop (when a
request is added, or ahead of it by the server in a worker thread) and cached by their spec.
`RequestGrammar` is one sequence's matcher: it fills the allowed-token mask for the next token
(after tokens drawn but not booked yet, under async scheduling), applies it to a logits row, and is
advanced on each booked token.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
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
            self._guidance = GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
            return
        import xgrammar as xgr

        self._xgr = xgr
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

    def matcher(self, compiled: Any) -> RequestGrammar:
        if self._guidance is not None:
            return RequestGrammar(self._guidance.matcher(compiled), self.vocab_size)
        return RequestGrammar(self._xgr.GrammarMatcher(compiled), self.vocab_size)


class RequestGrammar:
    """One sequence's grammar state: the tokens booked so far (`accept`). Preemption needs nothing
    here: prefixkv preempts by recompute and keeps the sampled tokens, so the matcher's state stays
    the tokens accepted.

    A step scheduled ahead (async scheduling) samples before the previous step's token is booked:
    `fill` takes that token as pending, accepts it for the mask and rolls it back after."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)  # reused every step
        self.num_accepted = 0

    def fill(self, bitmask: torch.Tensor, pending: Sequence[int] = ()) -> bool:
        """Fill `bitmask` (int32 [1, words]) with the tokens allowed after the booked ones and
        `pending`. False, `bitmask` untouched, when `pending` ends the grammar or breaks it: the
        sequence ends at those tokens, and what is drawn after them is dropped unread."""
        if not pending:
            self._matcher.fill_next_token_bitmask(bitmask)
            return True
        taken = 0
        try:
            for token in pending:
                if not self._matcher.accept_token(token):
                    return False
                taken += 1
                if self._matcher.is_terminated():
                    return False
            self._matcher.fill_next_token_bitmask(bitmask)
            return True
        finally:
            if taken:
                self._matcher.rollback(taken)

    def apply(self, logits: torch.Tensor, pending: Sequence[int] = ()) -> None:
        """Set to -inf, in place, the logits of one row [vocab] that the grammar does not allow
        after the booked tokens and `pending` (nothing when `pending` ends the sequence: `fill`)."""
        if self.fill(self._bitmask, pending):
            apply_bitmask(logits, self._bitmask[0], self._vocab_size)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise ValueError(f"token {token} does not continue the structured output's grammar")
        self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
