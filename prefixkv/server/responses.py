"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel.

A response is a chat completion underneath: the input items become chat messages, which go
through the chat route's admission (template, tools, structured outputs, limits, the engine's
checks: OpenAIServingChat.admit) and its engine path; only the shapes differ (responses_turn.py).
With `previous_response_id` the stored conversation comes first, so the rendered prompt of turn 2
starts with turn 1's prompt and the prefix cache serves it (`usage.input_tokens_details.cached_tokens`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ..sampling_params import SamplingParams
from .chat import OpenAIServingChat
from .errors import APIError, validation_message
from .protocol import ChatCompletionRequest
from .responses_protocol import (
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from .responses_store import ResponseStore, StoredResponse, max_stored_bytes_from_env, max_stored_from_env
from .responses_turn import ResponseTurn, call_item, hex_id
from .tools import ToolPlan
from .unicode_check import refuse_unencodable

# The chat admission names chat's fields; a Responses client sent these instead.
_PARAM_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "prompt": "input",
    "response_format": "text.format",
}


Admitted = tuple[list[int], tuple, SamplingParams, ToolPlan | None]  # OpenAIServingChat.admit's


def _too_long(e: APIError) -> bool:
    """The chat admission's context-length refusal (check_length's message): what truncation fixes."""
    return "maximum context length" in e.message


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore, id_prefix: str = "resp") -> None:
        """`id_prefix` starts every response id ("resp", OpenAI's; an engine replica's names the
        replica, so that a router sends a chained turn to the replica that stores its response)."""
        self.chat = chat
        self.store = store
        self.id_prefix = id_prefix

    # -- admission ---------------------------------------------------------------------------
    def conversation_before(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        prev = self.store.get(req.previous_response_id)
        if prev is None or prev.cache_salt != req.cache_salt:  # another tenant's id is as unknown as a wrong one
            raise APIError(
                f"Previous response with id '{req.previous_response_id}' not found. Responses are kept in "
                f"memory only, the {self.store.max_entries} most recently used (PREFIXKV_RESPONSES_MAX_STORED) "
                f"within {self.store.max_bytes} characters (PREFIXKV_RESPONSES_MAX_STORED_BYTES), and never "
                "with store=false.",
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
            "reasoning_effort": (req.reasoning or {}).get("effort"),
            "include_reasoning": req.include_reasoning,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise APIError(validation_message(e), 400) from None

    async def admit(self, req: ResponsesRequest, messages: list[dict[str, Any]]) -> Admitted:
        try:
            return await self.chat.admit(self.chat_request(req, messages))
        except APIError as e:
            e.param = _PARAM_NAMES.get(e.param or "", e.param)
            raise

    async def admit_truncated(
        self, req: ResponsesRequest, system: list[dict[str, Any]], conversation: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], Admitted]:
        """truncation "auto", for a conversation too long as a whole: the longest tail of it that
        fits, found by bisection (each try renders and tokenizes, so a long chain costs a few tries,
        not one per message). A tail starts at a message that is not a tool result (its call is
        gone); the last message always stays."""
        n = len(conversation)
        starts = [i for i in range(1, n) if conversation[i]["role"] != "tool" or i == n - 1]
        lo, hi = -1, len(starts) - 1  # lo: known too long (-1: the whole); hi: fits, `admitted` is its
        admitted = await self.admit(req, system + conversation[starts[hi] :])  # too long even alone: the 400
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                admitted = await self.admit(req, system + conversation[starts[mid] :])
                hi = mid
            except APIError as e:
                if not _too_long(e):
                    raise
                lo = mid
        return conversation[starts[hi] :], admitted

    async def create(self, req: ResponsesRequest, raw: Request):
        refuse_unencodable(req)
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
        try:
            ids, mm_items, params, plan = await self.admit(req, system + conversation)
        except APIError as e:
            if req.truncation != "auto" or not _too_long(e) or len(conversation) < 2:
                raise
            conversation, (ids, mm_items, params, plan) = await self.admit_truncated(req, system, conversation)
        rid = hex_id(self.id_prefix)
        parser = self.chat.inputs.reasoning
        thinks = self.chat.thinks(self.chat_request(req, system + conversation), ids)
        gens = self.chat.start(
            [ids],
            [None],
            params,
            req.request_id or rid,
            req.cache_salt,
            self.chat.lora_for(req.model),
            stream=bool(req.stream),
            mm_items=[mm_items],
            priority=req.priority,
            thinks=thinks,
        )
        reasoning = (parser, thinks) if parser is not None and thinks is not None else None
        turn = ResponseTurn(self.store, self.chat.count_error, req, rid, model, params, ids, conversation, reasoning)
        if req.stream:
            return StreamingResponse(turn.events(gens, plan), media_type="text/event-stream")
        out = (await self.chat.collect(raw, gens))[0]
        o = out.outputs[0]
        thought, answer = turn.split().update(o.text, o.token_ids, finished=True)
        text, calls = plan.parse(answer) if plan is not None else (answer, [])
        items = [call_item(hex_id("fc"), c.id, c.function.name, c.function.arguments) for c in calls]
        logprobs = turn.logprobs(o.logprobs, list(o.token_ids)) if o.logprobs is not None else []
        return JSONResponse(turn.finish(out, text, items, logprobs, reasoning=thought))

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


def add_responses_routes(
    app: FastAPI, chat: OpenAIServingChat, store: ResponseStore | None = None, id_prefix: str = "resp"
) -> None:
    """The Responses routes, served by the chat route's admission and engine path."""
    if store is None:
        store = ResponseStore(max_stored_from_env(), max_stored_bytes_from_env())
    OpenAIServingResponses(chat, store, id_prefix).add_routes(app)
