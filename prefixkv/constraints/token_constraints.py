"""One sequence's logits constraints, built once when the request is added and applied to its
logits row at every sampling step (after the penalties, before temperature and top-k/p):

- `logit_bias` (OpenAI's: token id -> bias in [-100, 100], added to the logit),
- `allowed_token_ids` (only these may be sampled),
- `bad_words` (vLLM's: each word, with and without a leading space, is tokenized; its last token is
  banned whenever the sequence's output ends with the tokens before it),
- the grammar of structured outputs (grammar.py), whose matcher is this sequence's own,
- a thinking budget (vLLM's `thinking_token_budget`): once so many reasoning tokens were drawn,
  the end of reasoning is the only token allowed; its count is this sequence's own.

Everything a step needs is built here once (index tensors, the allowed mask), so a step allocates
only what masking a row needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .grammar import apply_bitmask, fill_next

if TYPE_CHECKING:
    from ..model import Tokenizer
    from .grammar import RequestGrammar
    from .validation import TokenConstraintFields


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """vLLM's rule: each word as given and with a leading space (where that is a different
    tokenization), without special tokens."""
    out: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `limit` tokens of reasoning, then `end` (the reasoning parser's) is forced unless one
    of `ends` came first; `start` tokens are not counted (prefixkv/reasoning.py's count)."""

    limit: int
    end: int
    ends: frozenset[int]
    start: int


class BudgetCount:
    """One sequence's walk of its thinking budget, incremental over its output (drawn tokens
    included: they only ever grow)."""

    __slots__ = ("budget", "seen", "count", "ended")

    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self.seen = 0
        self.count = 0
        self.ended = False

    def forced(self, output_ids: list[int]) -> int | None:
        """The token the next draw must be, or None."""
        b = self.budget
        while not self.ended and self.seen < len(output_ids):
            token = output_ids[self.seen]
            self.seen += 1
            if token in b.ends:
                self.ended = True
            elif token != b.start:
                self.count += 1
        return b.end if not self.ended and self.count >= b.limit else None


class RequestConstraints:
    def __init__(
        self,
        vocab_size: int,
        logit_bias: Mapping[int, float] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: list[list[int]] | None = None,
        grammar: RequestGrammar | None = None,
        budget: ThinkingBudget | None = None,
    ) -> None:
        self.bias_ids = self.bias_values = None
        if logit_bias:
            self.bias_ids = torch.tensor(list(logit_bias), dtype=torch.long)
            self.bias_values = torch.tensor(list(logit_bias.values()), dtype=torch.float32)
        self.blocked: torch.Tensor | None = None  # True where allowed_token_ids forbids the token
        if allowed_token_ids:
            self.blocked = torch.ones(vocab_size, dtype=torch.bool)
            self.blocked[torch.tensor(allowed_token_ids, dtype=torch.long)] = False
        bad_words = bad_words or []
        self.banned_always = torch.tensor(sorted({w[0] for w in bad_words if len(w) == 1}), dtype=torch.long)
        self.bad_sequences = [w for w in bad_words if len(w) > 1]
        self.grammar = grammar
        self.budget = BudgetCount(budget) if budget is not None else None
        self._allowed_words: torch.Tensor | None = None  # `blocked` packed as a bitmask, when first asked

    @classmethod
    def build(
        cls,
        params: TokenConstraintFields,
        tokenizer: Tokenizer,
        vocab_size: int,
        grammar: RequestGrammar | None = None,
        budget: ThinkingBudget | None = None,
    ) -> RequestConstraints | None:
        """None when the request constrains nothing (the sampler's fast path stays open)."""
        if not (params.logit_bias or params.allowed_token_ids or params.bad_words or grammar or budget):
            return None
        words = bad_words_token_ids(list(params.bad_words), tokenizer) if params.bad_words else None
        return cls(vocab_size, params.logit_bias, params.allowed_token_ids, words, grammar, budget)

    def shares_with(self, grammar: RequestGrammar | None) -> RequestConstraints:
        """The same token constraints with another grammar matcher and a budget count of its own
        (sibling sequences of n > 1)."""
        twin = object.__new__(RequestConstraints)
        twin.__dict__.update(self.__dict__)
        twin.grammar = grammar
        twin.budget = BudgetCount(self.budget.budget) if self.budget is not None else None
        return twin

    def pending(self, output_ids: list[int]) -> list[int]:
        """The tokens of `output_ids` drawn but not booked yet (a step scheduled ahead samples
        before the previous step's token is booked): those the grammar has not accepted."""
        if self.grammar is None:
            return []
        return output_ids[self.grammar.num_accepted :]

    def apply(self, logits: torch.Tensor, output_ids: list[int], grammar_mask: torch.Tensor | None = None) -> None:
        """Constrain one row [vocab] in place (the sampler fails the row when nothing is left);
        `grammar_mask`: the grammar's allowed tokens for it (int32 [words]: `grammar_masks`; None:
        no grammar, or one that the pending tokens end)."""
        if self.bias_ids is not None:
            logits.index_add_(0, self.bias_ids, self.bias_values)  # type: ignore[arg-type]
        if self.blocked is not None:
            logits.masked_fill_(self.blocked, float("-inf"))
        if self.banned_always.numel():
            logits[self.banned_always] = float("-inf")
        for token in self._banned_after(output_ids):
            logits[token] = float("-inf")
        if grammar_mask is not None:
            apply_bitmask(logits, grammar_mask, logits.shape[0])
        forced = self.budget.forced(output_ids) if self.budget is not None else None
        if forced is not None:  # the budget is spent: the end of reasoning, whatever else allows
            keep = logits[forced].clone()
            logits.fill_(float("-inf"))
            logits[forced] = keep if torch.isfinite(keep) else 0.0

    def narrow(self, words: torch.Tensor, output_ids: list[int]) -> None:
        """Clear, in `words` (int32 [words], bit i of the little-endian words = token i), the bits
        of every token `apply` sets to -inf but the grammar's: what a GPU step copies over, the
        grammar's mask filled into it first (logit_bias, which only adds, is `bias_ids`)."""
        if self.blocked is not None:
            if self._allowed_words is None:
                self._allowed_words = pack_bits(self.blocked.logical_not(), words.shape[-1])
            words.bitwise_and_(self._allowed_words)
        banned = self._banned_after(output_ids)
        if self.banned_always.numel() or banned:
            clear_bits(words, [*self.banned_always.tolist(), *banned])
        forced = self.budget.forced(output_ids) if self.budget is not None else None
        if forced is not None:  # the budget is spent: only the end of reasoning
            words.zero_()
            words.numpy().view(np.uint32)[forced >> 5] = np.uint32(1) << np.uint32(forced & 31)

    def _banned_after(self, output_ids: list[int]) -> list[int]:
        """The last tokens of the bad words whose other tokens end `output_ids`."""
        out = []
        for seq in self.bad_sequences:
            prefix = seq[:-1]
            if len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix) :] == prefix:
                out.append(seq[-1])
        return out


def pack_bits(allowed: torch.Tensor, num_words: int) -> torch.Tensor:
    """A bool vector [vocab] as int32 words [num_words], bit i of the little-endian words = token i."""
    bits = np.zeros(num_words * 32, dtype=np.bool_)
    bits[: allowed.shape[0]] = allowed.numpy()
    return torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


def clear_bits(words: torch.Tensor, tokens: list[int]) -> None:
    """Clear, in place, the bits of `tokens` in int32 words [num_words]."""
    ids = np.asarray(tokens, dtype=np.int64)
    np.bitwise_and.at(words.numpy().view(np.uint32), ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


def grammar_rows(
    constraints: Sequence[RequestConstraints | None], output_ids: Sequence[list[int]]
) -> tuple[list[int], list[RequestGrammar], list[list[int]]]:
    """The positions in `constraints` that have a grammar, their grammars, and each one's tokens
    pending (`output_ids` a list a position)."""
    rows: list[int] = []
    grammars: list[RequestGrammar] = []
    pending: list[list[int]] = []
    for r, c in enumerate(constraints):
        if c is not None and c.grammar is not None:
            rows.append(r)
            grammars.append(c.grammar)
            pending.append(c.pending(output_ids[r]))
    return rows, grammars, pending


def grammar_masks(constraints: list[RequestConstraints | None], output_ids: list[list[int]]) -> dict[int, torch.Tensor]:
    """A step's grammar masks (int32 [words]) by row, all filled in one batch call
    (grammar.fill_next); a row whose pending tokens end its grammar has none."""
    rows, grammars, pending = grammar_rows(constraints, output_ids)
    if not rows:
        return {}
    masks = torch.empty((len(rows), grammars[0].num_words), dtype=torch.int32)
    filled = fill_next(grammars, pending, masks, range(len(rows)))
    return {r: masks[i] for i, r in enumerate(rows) if filled[i]}
