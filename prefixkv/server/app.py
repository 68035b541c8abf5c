"""The OpenAI-compatible HTTP server (FastAPI), shaped like `vllm serve`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /ping, GET /version, GET /metrics, POST /reset_prefix_cache.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from http import HTTPStatus
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.llm_engine import LLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, EngineDeadError
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (ChatChoiceLogProbs, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionResponseChoice, ChatCompletionStreamChoice,
                       ChatCompletionStreamResponse, ChatLogProb, ChatLogProbsContent,
                       ChatResponseMessage, CompletionLogProbs, CompletionRequest,
                       CompletionResponse, CompletionResponseChoice, DeltaMessage, ErrorInfo,
                       ErrorResponse, ModelCard, ModelList, PromptTokensDetails, UsageInfo,
                       random_id)

logger = logging.getLogger("prefixkv.server")

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_ or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                              409: "ConflictError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
        self.param = param


def error_response(message: str, status: int, type_: str | None = None, param: str | None = None) -> JSONResponse:
    err = APIError(message, status, type_, param)
    body = ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, param=err.param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _chunk_dict(model) -> dict:
    d = model.model_dump()
    if d.get("usage") is None:
        d.pop("usage", None)
    for c in d.get("choices", ()):
        delta = c.get("delta")
        if delta is not None:
            c["delta"] = {k: v for k, v in delta.items() if v is not None}
    return d


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come; closing this closes (aborts) them all."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))
            raise
        finally:
            await gen.aclose()

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


def _top(entry: dict, k: int) -> list:
    ranked = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
    return ranked[:k]


def completion_logprobs(entries: list[dict], token_ids: list[int], k: int, offset: int) -> CompletionLogProbs:
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


def chat_logprobs(entries: list[dict], token_ids: list[int], k: int) -> ChatChoiceLogProbs:
    content = []
    for tid, entry in zip(token_ids, entries):
        lp = entry.get(tid)
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else ""
        content.append(ChatLogProbsContent(
            token=text, logprob=max(lp.logprob, -9999.0) if lp is not None else -9999.0,
            bytes=list(text.encode("utf-8")),
            top_logprobs=[ChatLogProb(token=x.decoded_token or "", logprob=max(x.logprob, -9999.0),
                                      bytes=list((x.decoded_token or "").encode("utf-8")))
                          for x in _top(entry, k)]))
    return ChatChoiceLogProbs(content=content)


class OpenAIServing:
    def __init__(self, engine: LLMEngine, async_engine: AsyncEngine, metrics: ServerMetrics,
                 served_model_names: list[str], model_root: str | None) -> None:
        self.engine = engine
        self.async_engine = async_engine
        self.metrics = metrics
        self.names = served_model_names
        self.model_root = model_root
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len

    # -- helpers ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.names:
            raise APIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        return self.names[0]

    def check_length(self, ids: list[int], max_tokens: int | None, what: str) -> int:
        """Validate a tokenized prompt; return the effective max_tokens."""
        try:
            self.engine.validate_prompt(ids)
        except ValueError as e:
            if len(ids) >= self.max_model_len:
                raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. "
                               f"However, your request has {len(ids)} input tokens ({len(ids)} in the "
                               f"{what}), which leaves no room for the completion. Please reduce the "
                               f"length of the {what}.", 400, param="prompt") from e
            raise APIError(str(e), 400, param="prompt") from e
        if max_tokens is None:
            return self.max_model_len - len(ids)
        if isinstance(max_tokens, int) and max_tokens >= 1 and len(ids) + max_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, "
                           f"{max_tokens} in the completion). Please reduce the length of the {what} "
                           "or completion.", 400, param="max_tokens")
        return max_tokens

    def choice_logprobs(self, out: RequestOutput, prompt_ids: list[int], echo: str, entries: list[dict],
                        token_ids: list[int], k: int, offset: int) -> CompletionLogProbs:
        """Logprobs of generated tokens whose text starts at `offset` of the choice's text; when
        `echo` (the echoed prompt text) goes out with them, the prompt's tokens come first and
        offsets start at 0 (OpenAI's echo + logprobs; the first prompt token has no logprob, its
        text still counts)."""
        if not echo or out.prompt_logprobs is None:
            return completion_logprobs(entries, token_ids, k, offset)
        lp = completion_logprobs([{}] + out.prompt_logprobs[1:] + entries, prompt_ids + token_ids, k, 0)
        lp.tokens[0] = self.tokenizer.decode(prompt_ids[:1])
        lp.text_offset[1:] = [x + len(lp.tokens[0]) for x in lp.text_offset[1:]]
        return lp

    @staticmethod
    def check_prompt_logprobs(req) -> None:
        if req.prompt_logprobs is None:
            return
        if not 0 <= req.prompt_logprobs <= 20:
            raise APIError(f"prompt_logprobs must be in [0, 20], got {req.prompt_logprobs}", 400,
                           param="prompt_logprobs")
        if req.stream and isinstance(req, ChatCompletionRequest):
            raise APIError("prompt_logprobs is not supported with streaming chat", 400, param="prompt_logprobs")

    def params(self, req, max_tokens: int | None) -> SamplingParams:
        try:
            return req.to_sampling_params(max_tokens)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), 400) from e

    def usage(self, prompts: list[list[int]], finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(o.token_ids) for out in finals.values() for o in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals.values())
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def start(self, prompts: list[list[int]], texts: list[str | None], params: SamplingParams,
              request_id: str, cache_salt: str | None) -> list[AsyncIterator[RequestOutput]]:
        if len(prompts) == 1:
            ids = [request_id]
        else:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        return [self.async_engine.generate(p, params, rid, prompt=t, cache_salt=cache_salt)
                for p, t, rid in zip(prompts, texts, ids)]

    async def collect(self, raw: Request, gens) -> dict[int, RequestOutput]:
        """Run to completion; a client that goes away aborts the requests."""
        finals: dict[int, RequestOutput] = {}

        async def run() -> None:
            async for i, out in merge(gens):
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    task.result()
                    return finals
                if await raw.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise APIError("client disconnected", 499)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    # -- /v1/completions -------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise APIError("prompt must not be empty", 400, param="prompt")
        ids, texts = [], []
        for it in items:
            if isinstance(it, str):
                ids.append(self.tokenizer.encode(it, add_special_tokens=req.add_special_tokens))
                texts.append(it)
            else:
                ids.append(list(it))
                texts.append(None)
        return ids, texts

    async def create_completion(self, req: CompletionRequest, raw: Request):
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError("suffix is not supported", 400, param="suffix")
        if req.logprobs is not None and req.logprobs > 20:
            raise APIError(f"logprobs must be at most 20, got {req.logprobs}", 400, param="logprobs")
        self.check_prompt_logprobs(req)
        prompts, texts = self.completion_prompts(req)
        max_tokens = req.max_tokens
        for ids in prompts:
            max_tokens = self.check_length(ids, req.max_tokens, "prompt")
        if len(prompts) > 1 and req.max_tokens is None:
            max_tokens = self.max_model_len - max(len(p) for p in prompts)
        params = self.params(req, max_tokens)
        rid = req.request_id or random_id("cmpl")
        created = int(time.time())
        n = params.n
        k = req.logprobs or 0
        echo = [(t if t is not None else self.tokenizer.decode(ids)) if req.echo else ""
                for ids, t in zip(prompts, texts)]
        gens = self.start(prompts, texts, params, rid, req.cache_salt)
        if req.stream:
            return self._stream_completion(req, gens, prompts, echo, rid, created, model, n, k)
        finals = await self.collect(raw, gens)
        choices = []
        for i in range(len(prompts)):
            out = finals[i]
            for o in out.outputs:
                lp = None
                if req.logprobs is not None and o.logprobs is not None:
                    lp = self.choice_logprobs(out, prompts[i], echo[i], o.logprobs, o.token_ids, k, 0)
                choices.append(CompletionResponseChoice(
                    index=i * n + o.index, text=echo[i] + o.text, logprobs=lp, finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    prompt_logprobs=out.prompt_logprobs if req.prompt_logprobs is not None else None))
        return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=self.usage(prompts, finals))

    def _stream_completion(self, req, gens, prompts, echo, rid, created, model, n, k):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        async def body() -> AsyncIterator[str]:
            sent_text: dict[int, int] = {}
            sent_toks: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            latest: dict[int, RequestOutput] = {}
            try:
                async for i, out in merge(gens):
                    latest[i] = out
                    if out.finished:
                        finals[i] = out
                    for o in out.outputs:
                        idx = i * n + o.index
                        if idx in sent_text and sent_text[idx] < 0:
                            continue  # already finished
                        start = sent_text.get(idx, 0)
                        delta = o.text[start:]
                        first = idx not in sent_text
                        if not delta and o.finish_reason is None:
                            continue
                        if first and echo[i]:
                            delta = echo[i] + delta
                        lp = None
                        if req.logprobs is not None and o.logprobs is not None:
                            t0 = sent_toks.get(idx, 0)
                            t1 = len(o.token_ids) if o.finish_reason else min(len(o.token_ids), len(o.logprobs))
                            lp = self.choice_logprobs(out, prompts[i], echo[i] if first else "",
                                                      o.logprobs[t0:t1], o.token_ids[t0:t1], k,
                                                      start + (0 if first else len(echo[i])))
                            sent_toks[idx] = t1
                        sent_text[idx] = -1 if o.finish_reason else len(o.text)
                        chunk = CompletionResponse(id=rid, created=created, model=model, choices=[
                            CompletionResponseChoice(
                                index=idx, text=delta, logprobs=lp, finish_reason=o.finish_reason,
                                stop_reason=o.stop_reason,
                                prompt_logprobs=out.prompt_logprobs if first and req.prompt_logprobs is not None
                                else None)])
                        if continuous:
                            chunk.usage = self.usage(prompts, latest)
                        yield _sse(_chunk_dict(chunk))
                if include_usage:
                    chunk = CompletionResponse(id=rid, created=created, model=model, choices=[],
                                               usage=self.usage(prompts, finals))
                    yield _sse(chunk.model_dump())
            except (APIError, EngineDeadError, ValueError) as e:
                status = e.status if isinstance(e, APIError) else 400 if isinstance(e, ValueError) else 503
                yield _sse(json.loads(error_response(str(e), status).body))
            yield _sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream")

    # -- /v1/chat/completions --------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type", "text") != "text":
                        raise APIError(f"content part type {part.get('type')!r} is not supported (text only)",
                                       400, param="messages")
                    parts.append(part.get("text", ""))
                content = "\n".join(parts)
            d["content"] = content or ""
            messages.append(d)
        if not messages:
            raise APIError("messages must not be empty", 400, param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                tokenize=False, **(req.chat_template_kwargs or {}))
        except Exception as e:  # template errors (e.g. raise_exception in the template) are the caller's
            raise APIError(f"chat template failed: {e}", 400, param="messages") from e
        if req.continue_final_message:
            end = self.tokenizer.eos_token or ""
            text = text.rstrip()
            if end and text.endswith(end):
                text = text[: -len(end)]
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", 400, param="top_logprobs")
        self.check_prompt_logprobs(req)
        ids = self.chat_prompt(req)
        max_tokens = self.check_length(ids, req.requested_max_tokens(), "messages")
        params = self.params(req, max_tokens)
        rid = req.request_id or random_id("chatcmpl")
        created = int(time.time())
        k = req.top_logprobs or 0
        gens = self.start([ids], [None], params, rid, req.cache_salt)
        if req.stream:
            return self._stream_chat(req, gens, [ids], rid, created, model, params.n, k)
        finals = await self.collect(raw, gens)
        out = finals[0]
        choices = [ChatCompletionResponseChoice(
            index=o.index, message=ChatResponseMessage(content=o.text),
            logprobs=chat_logprobs(o.logprobs, o.token_ids, k) if req.logprobs and o.logprobs is not None else None,
            finish_reason=o.finish_reason, stop_reason=o.stop_reason) for o in out.outputs]
        return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=self.usage([ids], finals), prompt_logprobs=out.prompt_logprobs)

    def _stream_chat(self, req, gens, prompts, rid, created, model, n, k):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def chunk(choices, usage=None) -> str:
            c = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=choices, usage=usage)
            return _sse(_chunk_dict(c))

        async def body() -> AsyncIterator[str]:
            sent_text: dict[int, int] = {}
            sent_toks: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            try:
                for i in range(n):
                    yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                                self.usage(prompts, {}) if continuous else None)
                async for _, out in merge(gens):
                    if out.finished:
                        finals[0] = out
                    for o in out.outputs:
                        idx = o.index
                        if sent_text.get(idx, 0) < 0:
                            continue
                        start = sent_text.get(idx, 0)
                        delta = o.text[start:]
                        if not delta and o.finish_reason is None:
                            continue
                        lp = None
                        if req.logprobs and o.logprobs is not None:
                            t0 = sent_toks.get(idx, 0)
                            t1 = len(o.token_ids) if o.finish_reason else min(len(o.token_ids), len(o.logprobs))
                            lp = chat_logprobs(o.logprobs[t0:t1], o.token_ids[t0:t1], k)
                            sent_toks[idx] = t1
                        sent_text[idx] = -1 if o.finish_reason else len(o.text)
                        yield chunk([ChatCompletionStreamChoice(
                            index=idx, delta=DeltaMessage(content=delta), logprobs=lp,
                            finish_reason=o.finish_reason, stop_reason=o.stop_reason)],
                            self.usage(prompts, {0: out}) if continuous else None)
                if include_usage:
                    yield _sse(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                            usage=self.usage(prompts, finals)).model_dump())
            except (APIError, EngineDeadError, ValueError) as e:
                status = e.status if isinstance(e, APIError) else 400 if isinstance(e, ValueError) else 503
                yield _sse(json.loads(error_response(str(e), status).body))
            yield _sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream")


class APIKeyMiddleware:
    """Require `Authorization: Bearer KEY` on /v1/*. Pure ASGI (not BaseHTTPMiddleware), so
    client disconnects still reach the endpoints."""

    def __init__(self, app, api_key: str, on_reject=None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not secrets.compare_digest(header, self.expected):
                if self.on_reject is not None:
                    self.on_reject()
                resp = error_response("Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                                      401, "AuthenticationError")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: LLMEngine, *, served_model_names: list[str] | None = None, api_key: str | None = None,
               model_root: str | None = None, engine_thread: bool = True) -> FastAPI:
    """Build the app around a loaded engine. With `engine_thread` the engine loop starts in a
    background thread with the app (lifespan); without, the caller runs
    `app.state.async_engine.run()` itself (`prefixkv serve` does, on the main thread)."""
    names = list(served_model_names or [model_root or DEFAULT_MODEL_NAME])
    metrics = ServerMetrics(engine, names[0])
    async_engine = AsyncEngine(engine, on_finished=metrics.on_finished, on_aborted=metrics.aborted.inc)
    serving = OpenAIServing(engine, async_engine, metrics, names, model_root)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            async_engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="prefixkv", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving

    def count_error(status: int) -> None:
        metrics.http_errors.labels(status=str(status), **metrics.labels).inc()

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, on_reject=lambda: count_error(401))

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        count_error(exc.status)
        return error_response(exc.message, exc.status, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        count_error(400)
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            msg = "Malformed JSON in the request body: " + "; ".join(str(e.get("ctx", {}).get("error", e.get("msg")))
                                                                     for e in errs)
        else:
            msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}"
                            for e in errs)
        return error_response(msg or "invalid request", 400, "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        count_error(exc.status_code)
        return error_response(str(exc.detail), exc.status_code, HTTPStatus(exc.status_code).phrase.replace(" ", ""))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request: Request, exc: EngineDeadError):
        count_error(503)
        return error_response(str(exc), 503)

    @app.exception_handler(ValueError)
    async def value_error(_request: Request, exc: ValueError):
        count_error(400)
        return error_response(str(exc), 400)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.create_chat_completion(req, raw)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=n, root=model_root or n, max_model_len=engine.max_model_len)
                               for n in names])

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return error_response("the engine is not running", 503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok = await async_engine.reset_prefix_cache()
        if not ok:
            return error_response("the prefix cache cannot be reset while requests hold blocks; "
                                  "retry when idle", 409)
        return JSONResponse({"success": True})

    return app
