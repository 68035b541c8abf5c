"""Logprobs in OpenAI's two response shapes: completions (tokens, token_logprobs, text_offset,
top_logprobs) and chat (content entries with bytes and top_logprobs)."""

from __future__ import annotations

from ..outputs import Logprob
from .protocol import ChatChoiceLogProbs, ChatLogProb, ChatLogProbsContent, CompletionLogProbs

# JSON has no -inf: OpenAI clamps chat logprobs to this floor.
_CHAT_LOGPROB_FLOOR = -9999.0


def token_id_text(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form of a token: one that does not decode to text on
    its own (part of a character) is still named exactly."""
    return f"token_id:{token_id}"


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The entry's top `k` (token id, logprob), by rank."""
    ranked = sorted(
        ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda t: t[1].rank or 0
    )
    return ranked[:k]


def completion_logprobs(
    entries: list[dict[int, Logprob]], token_ids: list[int], k: int, offset: int, as_ids: bool = False
) -> CompletionLogProbs:
    """Logprobs of `token_ids` whose text starts at `offset` of the choice's text; `as_ids`: every
    token as `token_id:N` (vLLM's return_tokens_as_token_ids; the offsets count those strings, as
    vLLM's do)."""
    res = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        if as_ids:
            text = token_id_text(tid)
        else:
            text = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        res.tokens.append(text)
        res.token_logprobs.append(lp.logprob if lp is not None else None)
        res.text_offset.append(offset)
        offset += len(text)
        top = {(token_id_text(t) if as_ids else x.decoded_token or ""): x.logprob for t, x in _top(entry, k)}
        if lp is not None and k > 0:
            top.setdefault(text, lp.logprob)
        res.top_logprobs.append(top if k > 0 else None)
    return res


def echoed_completion_logprobs(
    prompt_logprobs: list[dict[int, Logprob] | None],
    first_prompt_token_text: str,
    prompt_ids: list[int],
    entries: list[dict[int, Logprob]],
    token_ids: list[int],
    k: int,
    as_ids: bool = False,
) -> CompletionLogProbs:
    """OpenAI's echo + logprobs: the prompt's tokens come first and offsets start at 0 (the first
    prompt token has no logprob and no top logprobs, both null as OpenAI's and vLLM's; its text
    still counts)."""
    entries_all: list[dict[int, Logprob]] = [{}]
    entries_all += [e or {} for e in prompt_logprobs[1:]]
    entries_all += entries
    lp = completion_logprobs(entries_all, prompt_ids + token_ids, k, 0, as_ids)
    lp.top_logprobs[0] = None
    if as_ids:  # the first token's `token_id:N` is already counted in the offsets
        return lp
    lp.tokens[0] = first_prompt_token_text
    lp.text_offset[1:] = [x + len(first_prompt_token_text) for x in lp.text_offset[1:]]
    return lp


def chat_logprobs(
    entries: list[dict[int, Logprob]], token_ids: list[int], k: int, as_ids: bool = False
) -> ChatChoiceLogProbs:
    """`as_ids`: every token as `token_id:N` (vLLM's return_tokens_as_token_ids). As in vLLM, a
    chosen token's bytes stay its text's and a top entry's are those of its `token_id:N`."""
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        top = []
        for t, x in _top(entry, k):
            name = token_id_text(t) if as_ids else x.decoded_token or ""
            top.append(
                ChatLogProb(
                    token=name,
                    logprob=max(x.logprob, _CHAT_LOGPROB_FLOOR),
                    bytes=list(name.encode("utf-8", "surrogatepass")),
                )
            )
        content.append(
            ChatLogProbsContent(
                token=token_id_text(tid) if as_ids else text,
                logprob=max(lp.logprob, _CHAT_LOGPROB_FLOOR) if lp is not None else _CHAT_LOGPROB_FLOOR,
                bytes=list(text.encode("utf-8", "surrogatepass")),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogProbs(content=content)
