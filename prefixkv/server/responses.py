"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel.

A response is a chat completion underneath: the input items become chat messages, which go
through the chat route's admission (template, tools, structured outputs, limits, the engine's
checks: OpenAIServingChat.admit) and its engine path; only the shapes differ. With
`previous_response_id` the stored conversation comes first, so the rendered prompt of turn 2
starts with turn 1's prompt and the prefix cache serves it (`usage.input_tokens_details.cached_tokens`).
Streamed, the events are OpenAI's, numbered by `sequence_number` from 0."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ..outputs import Logprob, RequestOutput
from ..sampling_params import SamplingParams
from .chat import OpenAIServingChat
from .errors import APIError, as_api_error
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest
from .responses_protocol import (
    ResponsesRequest,
    assistant_message,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from .responses_store import ResponseStore, StoredResponse, max_stored_from_env
from .streaming import ChoiceDelta, StreamState, choice_deltas
from .tools import ToolPlan, ToolStream

# The chat admission names chat's fields; a Responses client sent these instead.
_PARAM_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "prompt": "input",
    "response_format": "text.format",
}


def _hex_id(prefix: str) -> str:
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


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    # -- admission ---------------------------------------------------------------------------
    def conversation_before(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        prev = self.store.get(req.previous_response_id)
        if prev is None or prev.cache_salt != req.cache_salt:  # another tenant's id is as unknown as a wrong one
            raise APIError(
                f"Previous response with id '{req.previous_response_id}' not found. Responses are kept in "
                f"memory only, the {self.store.max_entries} most recently used (PREFIXKV_RESPONSES_MAX_STORED), "
                "and never with store=false.",
                400,
                param="previous_response_id",
            )
        return prev.conversation

    def chat_request(self, req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        body: dict[str, Any] = {
            "messages": messages,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty,
            "cache_salt": req.cache_salt,
            "priority": req.priority,
            "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": chat_response_format(req.text),
            "logprobs": req.wants_logprobs,
            "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            msg = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
            raise APIError(msg, 400) from None

    async def create(self, req: ResponsesRequest, raw: Request):
        refused = req.refusals()
        if refused:
            name, why = refused[0]
            others = f" (also: {', '.join(n for n, _ in refused[1:])})" if len(refused) > 1 else ""
            raise APIError(f"unsupported field {name!r}: {why}{others}", 400, param=name)
        model = self.chat.check_model(req.model)
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise APIError(
                f"max_output_tokens must be an integer >= 1, got {req.max_output_tokens}",
                400,
                param="max_output_tokens",
            )
        if req.instructions is not None:
            self.chat.check_text(req.instructions, "instructions")
        conversation = [*self.conversation_before(req), *input_messages(req.input)]
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat_req = self.chat_request(req, system + conversation)
        try:
            ids, mm_items, params, plan = await self.chat.admit(chat_req)
        except APIError as e:
            e.param = _PARAM_NAMES.get(e.param or "", e.param)
            raise
        rid = _hex_id("resp")
        gens = self.chat.start(
            [ids],
            [None],
            params,
            req.request_id or rid,
            req.cache_salt,
            self.chat.lora_for(req.model),
            mm_items=[mm_items],
            priority=req.priority,
        )
        turn = _Turn(self, req, rid, model, params, ids, conversation)
        if req.stream:
            return StreamingResponse(turn.events(gens, plan), media_type="text/event-stream")
        out = (await self.chat.collect(raw, gens))[0]
        o = out.outputs[0]
        text, calls = plan.parse(o.text) if plan is not None else (o.text, [])
        items = [call_item(_hex_id("fc"), c.id, c.function.name, c.function.arguments) for c in calls]
        logprobs = turn.logprobs(o.logprobs, list(o.token_ids)) if o.logprobs is not None else []
        return JSONResponse(turn.finish(out, text, items, logprobs))

    # -- stored responses --------------------------------------------------------------------
    def stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param="response_id")
        return entry

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/responses")
        async def create_response(req: ResponsesRequest, raw: Request):
            return await self.create(req, raw)

        @app.get("/v1/responses/{response_id}")
        async def retrieve_response(response_id: str, stream: bool = False):
            if stream:
                raise APIError("streaming a stored response is not supported (no background mode)", 400, param="stream")
            return JSONResponse(self.stored(response_id).body)

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str):
            self.stored(response_id)
            self.store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

        @app.post("/v1/responses/{response_id}/cancel")
        async def cancel_response(response_id: str):
            self.stored(response_id)
            raise APIError(
                "Cannot cancel a synchronous response: only background responses can be cancelled, and "
                "background mode is not supported",
                400,
                param="response_id",
            )


class _Turn:
    """One response being made: its fixed fields, the finished body, and the stream's events."""

    def __init__(
        self,
        serving: OpenAIServingResponses,
        req: ResponsesRequest,
        rid: str,
        model: str,
        params: SamplingParams,
        prompt: list[int],
        conversation: list[dict[str, Any]],
    ) -> None:
        self.serving = serving
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
            "store": bool(req.store),
            "temperature": self.params.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": self.params.top_p,
            "truncation": "disabled",
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
        output = (
            [] if text is None and calls else [message_item(msg_id or _hex_id("msg"), text or "", status, logprobs)]
        )
        body = self.body(status, output + calls, usage_of(self.prompt, out), incomplete)
        if self.req.store:
            turn = assistant_message(text or "", calls)
            self.serving.store.put(self.rid, StoredResponse(body, [*self.conversation, turn], self.req.cache_salt))
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
            msg_id = _hex_id("msg")
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
            items = [call_item(_hex_id("fc"), c["id"], c["name"] or "", c["arguments"]) for c in calls.values()]
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
            self.serving.chat.count_error(err.status)
            yield event("error", code=err.type, message=err.message, param=err.param)


def add_responses_routes(app: FastAPI, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
    """The Responses routes, served by the chat route's admission and engine path."""
    OpenAIServingResponses(chat, store or ResponseStore(max_stored_from_env())).add_routes(app)
