"""One response being made: the Responses API's output shapes (reasoning, message and
function-call items, usage), the finished body (stored when asked), and the streamed events -
OpenAI's, numbered by `sequence_number` from 0. With --reasoning-parser a reasoning item comes
first (vLLM's: `reasoning_text` content), split as chat splits it."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

from ..outputs import Logprob, RequestOutput
from ..reasoning import ReasoningParser, ReasoningSplit
from ..sampling_params import SamplingParams
from .errors import as_api_error
from .logprobs import chat_logprobs
from .responses_protocol import ResponsesRequest, assistant_message
from .responses_store import ResponseStore, StoredResponse
from .streaming import ChoiceDelta, StreamState, choice_deltas
from .tools import ToolPlan, ToolStream


def hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [part],
        "encrypted_content": None,
        "status": status,
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage_of(prompt: list[int], out: RequestOutput, reasoning_tokens: int = 0) -> dict[str, Any]:
    generated = len(out.outputs[0].token_ids)
    return {
        "input_tokens": len(prompt),
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": len(prompt) + generated,
    }


class ResponseTurn:
    """One response being made: its fixed fields, the finished body, and the stream's events."""

    def __init__(
        self,
        store: ResponseStore,
        count_error: Callable[[int], Any],
        req: ResponsesRequest,
        rid: str,
        model: str,
        params: SamplingParams,
        prompt: list[int],
        conversation: list[dict[str, Any]],
        reasoning: tuple[ReasoningParser, bool] | None = None,
    ) -> None:
        """`reasoning`: the server's reasoning parser, and whether this reply starts in reasoning."""
        self.store = store
        self.reasoning = reasoning
        self.count_error = count_error
        self.req = req
        self.rid = rid
        self.model = model
        self.params = params
        self.prompt = prompt
        self.conversation = conversation
        self.created = int(time.time())

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": req.reasoning.get("effort"), "summary": None} if req.reasoning else None,
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "store": req.store is not False,
            "temperature": self.params.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": self.params.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
        }

    def split(self) -> ReasoningSplit:
        """The reply's reasoning and answer as it grows (all answer without a parser)."""
        if self.reasoning is None:
            return ReasoningSplit(None, False)
        parser, thinks = self.reasoning
        return parser.split(thinks)

    @property
    def shows_reasoning(self) -> bool:
        """Whether the reasoning, and the logprobs that would spell it, are returned."""
        return self.req.include_reasoning or self.reasoning is None

    def logprobs(self, entries: list[dict[int, Logprob]], token_ids: list[int]) -> list[dict[str, Any]]:
        """The tokens' logprobs in OpenAI's shape (chat's: token, logprob, bytes, top_logprobs)."""
        if not self.req.wants_logprobs or not self.shows_reasoning:
            return []
        content = chat_logprobs(entries, token_ids, self.req.top_logprobs or 0).content or []
        return [c.model_dump() for c in content]

    def finish(
        self,
        out: RequestOutput,
        text: str | None,
        calls: list[dict[str, Any]],
        logprobs: list[dict[str, Any]],
        msg_id: str | None = None,
        reasoning: str = "",
        reasoning_id: str | None = None,
    ) -> dict[str, Any]:
        """The finished response's body (stored when asked): the reasoning item when there is
        reasoning to show, then a message item unless the output is only calls, then the calls."""
        incomplete = out.outputs[0].finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        shown = reasoning if reasoning and self.shows_reasoning else None
        output = [reasoning_item(reasoning_id or hex_id("rs"), shown, "completed")] if shown else []
        if not (text is None and calls):
            output.append(message_item(msg_id or hex_id("msg"), text or "", status, logprobs))
        counted = 0
        if self.reasoning is not None:
            parser, thinks = self.reasoning
            counted = parser.reasoning_tokens(out.outputs[0].token_ids, thinks)
        body = self.body(status, output + calls, usage_of(self.prompt, out, counted), incomplete)
        if self.req.store is not False:  # null is the default: stored
            turn = assistant_message(text or "", calls, shown)
            self.store.put(self.rid, StoredResponse(body, [*self.conversation, turn], self.req.cache_salt))
        return body

    async def events(self, gens: list[AsyncIterator[RequestOutput]], plan: ToolPlan | None) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        started = self.body("in_progress", [], None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        tools = ToolStream(plan) if plan is not None else None
        split = self.split()
        thought, sent = "", 0  # the reasoning so far; the answer's characters sent
        rs_id: str | None = None  # the reasoning item, once one is open
        rs_open = False
        msg_id: str | None = None
        at = 0  # the message's output index: 1 after a reasoning item
        text = ""
        calls: dict[int, dict[str, Any]] = {}  # by the call's index: id, name, arguments so far
        logprobs: list[dict[str, Any]] = []
        state = StreamState()

        def open_reasoning() -> list[str]:
            nonlocal rs_id, rs_open
            rs_id, rs_open = hex_id("rs"), True
            item = {**reasoning_item(rs_id, "", "in_progress"), "content": []}
            part = {"type": "reasoning_text", "text": ""}
            return [
                event("response.output_item.added", output_index=0, item=item),
                event("response.content_part.added", item_id=rs_id, output_index=0, content_index=0, part=part),
            ]

        def close_reasoning() -> list[str]:
            nonlocal rs_open, at
            rs_open, at = False, 1
            item = reasoning_item(rs_id or "", thought, "completed")
            part = item["content"][0]
            return [
                event("response.reasoning_text.done", item_id=rs_id, output_index=0, content_index=0, text=thought),
                event("response.content_part.done", item_id=rs_id, output_index=0, content_index=0, part=part),
                event("response.output_item.done", output_index=0, item=item),
            ]

        def open_message() -> list[str]:
            nonlocal msg_id
            msg_id = hex_id("msg")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": msg_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            return [
                event("response.output_item.added", output_index=at, item=item),
                event("response.content_part.added", item_id=msg_id, output_index=at, content_index=0, part=part),
            ]

        try:
            # closed at once when the client goes away: that aborts the request and frees its blocks
            deltas = cast("AsyncGenerator[ChoiceDelta, None]", choice_deltas(gens, 1, state))
            async with contextlib.aclosing(deltas):
                async for d in deltas:
                    finished = d.choice.finish_reason is not None
                    reasoning, answer = split.update(d.choice.text, d.choice.token_ids, finished)
                    new_thought = reasoning[len(thought) :] if self.shows_reasoning else ""
                    thought = reasoning
                    content: str | None = answer[sent:]
                    sent = len(answer)
                    if new_thought:
                        if rs_id is None:
                            for e in open_reasoning():
                                yield e
                        yield event(
                            "response.reasoning_text.delta",
                            item_id=rs_id,
                            output_index=0,
                            content_index=0,
                            delta=new_thought,
                        )
                    if tools is not None:
                        content, call_deltas, _ = tools.delta(0, answer, d.choice.finish_reason)
                        for c in call_deltas or ():
                            acc = calls.setdefault(c.index, {"id": c.id, "name": None, "arguments": ""})
                            if c.function is not None:
                                acc["name"] = c.function.name or acc["name"]
                                acc["arguments"] += c.function.arguments or ""
                    new_logprobs = self.logprobs(d.logprobs, d.token_ids) if d.logprobs is not None else []
                    logprobs += new_logprobs
                    # the end of text (EOS) has a logprob and no text: an empty delta carries it
                    if content or (new_logprobs and tools is None) or calls:
                        if rs_open:  # the answer begins: the reasoning item is done
                            for e in close_reasoning():
                                yield e
                    if content or (new_logprobs and tools is None):
                        if msg_id is None:
                            for e in open_message():
                                yield e
                        text += content or ""
                        yield event(
                            "response.output_text.delta",
                            item_id=msg_id,
                            output_index=at,
                            content_index=0,
                            delta=content or "",
                            logprobs=new_logprobs,
                        )
            out = state.finals[0]
            if rs_open:
                for e in close_reasoning():
                    yield e
            if msg_id is None and not calls:
                for e in open_message():
                    yield e
            items = [call_item(hex_id("fc"), c["id"], c["name"] or "", c["arguments"]) for c in calls.values()]
            shown = thought if self.shows_reasoning else ""
            body = self.finish(out, text if msg_id is not None else None, items, logprobs, msg_id, shown, rs_id)
            index = at
            if msg_id is not None:
                message = body["output"][at]
                part = message["content"][0]
                yield event(
                    "response.output_text.done",
                    item_id=msg_id,
                    output_index=at,
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                )
                yield event("response.content_part.done", item_id=msg_id, output_index=at, content_index=0, part=part)
                yield event("response.output_item.done", output_index=at, item=message)
                index = at + 1
            for i, item in enumerate(items, start=index):
                yield event(
                    "response.output_item.added",
                    output_index=i,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=i,
                    delta=item["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    name=item["name"],
                    arguments=item["arguments"],
                )
                yield event("response.output_item.done", output_index=i, item=item)
            done = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield event(done, response=body)
        except Exception as e:  # noqa: BLE001 - reported to the client in-band, as OpenAI's error event
            err = as_api_error(e)
            self.count_error(err.status)
            yield event("error", code=err.type, message=err.message, param=err.param)
