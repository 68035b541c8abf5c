"""Logprobs in OpenAI's two response shapes: completions (tokens, token_logprobs, text_offset,
top_logprobs) and chat (content entries with bytes and top_logprobs)."""

from __future__ import annotations

from ..outputs import Logprob
from .protocol import ChatChoiceLogProbs, ChatLogProb, ChatLogProbsContent, CompletionLogProbs

# JSON has no -inf: OpenAI clamps chat logprobs to this floor.
_CHAT_LOGPROB_FLOOR = -9999.0


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank or 0)
    return ranked[:k]


def completion_logprobs(
    entries: list[dict[int, Logprob]], token_ids: list[int], k: int, offset: int
) -> CompletionLogProbs:
    """Logprobs of `token_ids` whose text starts at `offset` of the choice's text."""
    res = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        res.tokens.append(text)
        res.token_logprobs.append(lp.logprob if lp is not None else None)
        res.text_offset.append(offset)
        offset += len(text)
        top = {x.decoded_token or "": x.logprob for x in _top(entry, k)}
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
) -> CompletionLogProbs:
    """OpenAI's echo + logprobs: the prompt's tokens come first and offsets start at 0 (the first
    prompt token has no logprob and no top logprobs, both null as OpenAI's and vLLM's; its text
    still counts)."""
    entries_all: list[dict[int, Logprob]] = [{}]
    entries_all += [e or {} for e in prompt_logprobs[1:]]
    entries_all += entries
    lp = completion_logprobs(entries_all, prompt_ids + token_ids, k, 0)
    lp.tokens[0] = first_prompt_token_text
    lp.top_logprobs[0] = None
    lp.text_offset[1:] = [x + len(first_prompt_token_text) for x in lp.text_offset[1:]]
    return lp


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], k: int) -> ChatChoiceLogProbs:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        top = [
            ChatLogProb(
                token=x.decoded_token or "",
                logprob=max(x.logprob, _CHAT_LOGPROB_FLOOR),
                bytes=list((x.decoded_token or "").encode("utf-8", "surrogatepass")),
            )
            for x in _top(entry, k)
        ]
        content.append(
            ChatLogProbsContent(
                token=text,
                logprob=max(lp.logprob, _CHAT_LOGPROB_FLOOR) if lp is not None else _CHAT_LOGPROB_FLOOR,
                bytes=list(text.encode("utf-8", "surrogatepass")),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogProbs(content=content)
