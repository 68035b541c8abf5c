"""Server-sent events: one loop for every streamed response.

`merge` interleaves the outputs of a request's prompts as they come; `choice_deltas` turns
cumulative RequestOutputs into per-choice deltas (new text, new tokens); `sse_stream` frames
the chunks a route builds from them, ends with a usage chunk when asked, turns any failure into
an OpenAI error event, and always closes with `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ..outputs import CompletionOutput, Logprob, RequestOutput
from .errors import APIError, as_api_error, error_body


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def chunk_dict(model: BaseModel) -> dict:
    """A stream chunk as OpenAI sends it: no null usage, no null delta fields."""
    d = model.model_dump()
    if d.get("usage") is None:
        d.pop("usage", None)
    for c in d.get("choices", ()):
        delta = c.get("delta")
        if delta is not None:
            c["delta"] = {k: v for k, v in delta.items() if v is not None}
    return d


def raise_if_failed(out: RequestOutput) -> None:
    """A request the engine failed on its own (the rest of its batch went on): a 500 for it."""
    error = getattr(out, "error", None)
    if error:
        raise APIError(f"the request failed in the engine: {error}", 500, "InternalServerError")


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come; closing this closes (aborts) them all."""
    if len(gens) == 1:
        gen = gens[0]
        try:
            async for out in gen:
                yield 0, out
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))
            raise
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChoiceDelta:
    """What one choice gained since its last chunk."""

    prompt_index: int
    index: int  # the choice's index in the response: prompt_index * n + output index
    output: RequestOutput
    choice: CompletionOutput
    text: str  # new text
    text_start: int  # where `text` starts in the choice's whole text
    token_ids: list[int]  # new tokens that carry logprobs (when logprobs were asked)
    logprobs: list[dict[int, Logprob]] | None
    first: bool  # the choice's first chunk
    new_token_ids: list[int] = field(default_factory=list)  # every token since the last chunk


@dataclass
class StreamState:
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # by prompt index
    finals: dict[int, RequestOutput] = field(default_factory=dict)
    sent_text: dict[int, int] = field(default_factory=dict)  # by choice index; -1 once finished
    sent_tokens: dict[int, int] = field(default_factory=dict)
    sent_ids: dict[int, int] = field(default_factory=dict)  # tokens already in a chunk, by choice index


async def choice_deltas(
    gens: list[AsyncIterator[RequestOutput]], n: int, state: StreamState
) -> AsyncIterator[ChoiceDelta]:
    async for i, out in merge(gens):
        raise_if_failed(out)
        state.latest[i] = out
        if out.finished:
            state.finals[i] = out
        for o in out.outputs:
            idx = i * n + o.index
            start = state.sent_text.get(idx, 0)
            if start < 0:
                continue  # this choice already finished
            text = o.text[start:]
            if not text and o.finish_reason is None:
                continue
            first = idx not in state.sent_text
            tokens: list[int] = []
            logprobs = None
            if o.logprobs is not None:
                t0 = state.sent_tokens.get(idx, 0)
                t1 = len(o.token_ids) if o.finish_reason else min(len(o.token_ids), len(o.logprobs))
                tokens, logprobs = o.token_ids[t0:t1], o.logprobs[t0:t1]
                state.sent_tokens[idx] = t1
            state.sent_text[idx] = -1 if o.finish_reason else len(o.text)
            sent = state.sent_ids.get(idx, 0)
            state.sent_ids[idx] = len(o.token_ids)
            yield ChoiceDelta(i, idx, out, o, text, start, tokens, logprobs, first, list(o.token_ids[sent:]))


def sse_stream(
    gens: list[AsyncIterator[RequestOutput]],
    n: int,
    make_chunk: Callable[[ChoiceDelta, StreamState], dict],
    *,
    prelude: Iterable[dict] = (),
    usage_chunk: Callable[[StreamState], dict] | None = None,
    on_error: Callable[[int], Any] | None = None,
) -> StreamingResponse:
    """The streamed response of a request: `prelude` chunks (with the first delta), one chunk per
    choice delta, the usage chunk, then [DONE]. A failure mid-stream (engine error, shutdown, bad value found late)
    becomes an OpenAI error event, so the client always sees why the stream ended."""

    async def body() -> AsyncIterator[str]:
        state = StreamState()
        # The prelude (chat's assistant-role chunks) waits for the first computed output, as
        # vLLM's: sent at once, it would arrive before the prefill and a client's time to first
        # token would measure nothing.
        pending = list(prelude)
        try:
            async for delta in choice_deltas(gens, n, state):
                if pending:
                    for chunk in pending:
                        yield sse(chunk)
                    pending = []
                yield sse(make_chunk(delta, state))
            for chunk in pending:  # nothing was generated: the role still comes first
                yield sse(chunk)
            pending = []
            if usage_chunk is not None:
                yield sse(usage_chunk(state))
        except Exception as e:  # noqa: BLE001 - reported to the client in-band
            err = as_api_error(e)
            if on_error is not None:
                on_error(err.status)
            yield sse(error_body(err.message, err.status, err.type, err.param))
        yield sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")
