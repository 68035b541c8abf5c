"""One response being made: the Responses API's output shapes (message and function-call
items, usage), the finished body (stored when asked), and the streamed events - OpenAI's,
numbered by `sequence_number` from 0."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

from ..outputs import Logprob, RequestOutput
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


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage_of(prompt: list[int], out: RequestOutput) -> dict[str, Any]:
    generated = len(out.outputs[0].token_ids)
    return {
        "input_tokens": len(prompt),
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
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
    ) -> None:
        self.store = store
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
            "reasoning": None,
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

    def logprobs(self, entries: list[dict[int, Logprob]], token_ids: list[int]) -> list[dict[str, Any]]:
        """The tokens' logprobs in OpenAI's shape (chat's: token, logprob, bytes, top_logprobs)."""
        if not self.req.wants_logprobs:
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
    ) -> dict[str, Any]:
        """The finished response's body (stored when asked): a message item unless the output is
        only calls, then the function calls."""
        incomplete = out.outputs[0].finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        output = [] if text is None and calls else [message_item(msg_id or hex_id("msg"), text or "", status, logprobs)]
        body = self.body(status, output + calls, usage_of(self.prompt, out), incomplete)
        if self.req.store is not False:  # null is the default: stored
            turn = assistant_message(text or "", calls)
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
        msg_id: str | None = None
        text = ""
        calls: dict[int, dict[str, Any]] = {}  # by the call's index: id, name, arguments so far
        logprobs: list[dict[str, Any]] = []
        state = StreamState()

        def open_message() -> list[str]:
            nonlocal msg_id
            msg_id = hex_id("msg")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": msg_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            return [
                event("response.output_item.added", output_index=0, item=item),
                event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0, part=part),
            ]

        try:
            # closed at once when the client goes away: that aborts the request and frees its blocks
            deltas = cast("AsyncGenerator[ChoiceDelta, None]", choice_deltas(gens, 1, state))
            async with contextlib.aclosing(deltas):
                async for d in deltas:
                    content: str | None = d.text
                    if tools is not None:
                        content, call_deltas, _ = tools.delta(0, d.choice.text, d.choice.finish_reason)
                        for c in call_deltas or ():
                            acc = calls.setdefault(c.index, {"id": c.id, "name": None, "arguments": ""})
                            if c.function is not None:
                                acc["name"] = c.function.name or acc["name"]
                                acc["arguments"] += c.function.arguments or ""
                    new_logprobs = self.logprobs(d.logprobs, d.token_ids) if d.logprobs is not None else []
                    logprobs += new_logprobs
                    # the end of text (EOS) has a logprob and no text: an empty delta carries it
                    if content or (new_logprobs and tools is None):
                        if msg_id is None:
                            for e in open_message():
                                yield e
                        text += content or ""
                        yield event(
                            "response.output_text.delta",
                            item_id=msg_id,
                            output_index=0,
                            content_index=0,
                            delta=content or "",
                            logprobs=new_logprobs,
                        )
            out = state.finals[0]
            if msg_id is None and not calls:
                for e in open_message():
                    yield e
            items = [call_item(hex_id("fc"), c["id"], c["name"] or "", c["arguments"]) for c in calls.values()]
            body = self.finish(out, text if msg_id is not None else None, items, logprobs, msg_id)
            index = 0
            if msg_id is not None:
                message = body["output"][0]
                part = message["content"][0]
                yield event(
                    "response.output_text.done",
                    item_id=msg_id,
                    output_index=0,
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                )
                yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
                yield event("response.output_item.done", output_index=0, item=message)
                index = 1
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
