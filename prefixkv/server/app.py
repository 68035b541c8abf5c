"""The OpenAI-compatible HTTP app (FastAPI), shaped like `vllm serve`: routes and wiring only.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings, GET /v1/models,
GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /health, GET|POST /ping, GET /version,
GET /metrics, POST /v1/cache/pin and /v1/cache/unpin (cache_control.py), and POST /reset_prefix_cache
in dev mode only (VLLM_SERVER_DEV_MODE=1, as vLLM). The routes' work lives in
completions.py and chat.py (shared parts in serving.py, the stream loop in streaming.py), errors
in errors.py, auth and limits in middleware.py, the process (flags, signals) in launch.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field

from fastapi import Body, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..engine.llm_engine import LLMEngine
from ..lora.request import LoRARequest
from ..model.default_model import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME
from ..reasoning import GptOssReasoningParser
from .anthropic import add_anthropic_routes
from .async_engine import AsyncEngine
from .cache_control import add_cache_control_routes
from .chat import OpenAIServingChat
from .completions import OpenAIServingCompletion
from .embeddings import OpenAIServingEmbedding
from .errors import APIError, error_response, install_error_handlers
from .limits import RequestLimits
from .lora import (
    LoRARegistry,
    add_lora_routes,
    load_startup_adapters,
    lora_allowed_dir_from_env,
    runtime_lora_updating_from_env,
)
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import OPEN_PATHS, APIKeyMiddleware, BodyLimitMiddleware, DrainMiddleware
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    PoolingRequest,
)
from .request_logger import RequestLogger
from .responses import add_responses_routes
from .stats_logger import StatsLogger
from .tokenization import OpenAIServingTokenization

DEFAULT_MAX_BODY_BYTES = 32 << 20  # 32 MiB: far above any prompt that fits a context


@dataclass(frozen=True)
class CORSOptions:
    """--allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials (vLLM's)."""

    allow_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_methods: list[str] = field(default_factory=lambda: ["*"])
    allow_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


__all__ = ["CORSOptions", "APIError", "DEFAULT_MODEL_NAME", "create_app", "error_response"]


def create_app(
    engine: LLMEngine,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | list[str] | None = None,
    model_root: str | None = None,
    engine_thread: bool = True,
    limits: RequestLimits | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora_modules: list[LoRARequest] | None = None,
    dev_mode: bool | None = None,
    log_stats_interval: float | None = None,
    tool_call_parser: str | None = None,
    allow_runtime_lora_updating: bool | None = None,
    lora_allowed_dir: str | None = None,
    root_path: str | None = None,
    cors: CORSOptions | None = None,
    response_role: str = "assistant",
    request_logger: RequestLogger | None = None,
    response_id_prefix: str = "resp",
    return_tokens_as_token_ids: bool = False,
) -> FastAPI:
    """Build the app around a loaded engine. With `engine_thread` the engine loop starts in a
    background thread with the app (lifespan); without, the caller runs
    `app.state.async_engine.run()` itself (`prefixkv serve` does, on the main thread).
    An empty `api_key` (or a list of empty keys) means no key, as None does. `dev_mode` (default:
    $VLLM_SERVER_DEV_MODE, as vLLM) adds the admin routes: POST /reset_prefix_cache.
    `log_stats_interval`: seconds between vLLM's periodic stats lines (None: none).
    `allow_runtime_lora_updating` (default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING) adds POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter; `lora_allowed_dir` (default:
    $PREFIXKV_LORA_ALLOWED_DIR) confines their loads to that folder. `root_path`: the prefix a
    proxy serves the app under (FastAPI's). `cors`: starlette's CORSMiddleware settings (None: no
    CORS headers). `response_role`: the chat reply's role. `request_logger`: logs each request.
    `return_tokens_as_token_ids`: logprobs name tokens `token_id:N` unless a request says otherwise."""
    if dev_mode is None:
        dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() in ("1", "true", "yes")
    names = list(served_model_names or [model_root or DEFAULT_MODEL_NAME])
    limits = limits or RequestLimits()
    keys = [k for k in ([api_key] if isinstance(api_key, str) else api_key or []) if k]
    # A multi-tenant server (--require-cache-salt): /metrics must not tell one tenant what another
    # sent. With a key, /metrics is behind it like the API; without one it stays open (probes,
    # scrapes) but leaves out the counters that move when one particular item is seen again.
    tenants = limits.require_cache_salt
    metrics = ServerMetrics(engine, names[0], per_item_signals=not (tenants and not keys))
    if tenants:
        logging.getLogger("prefixkv.server").info(
            "--require-cache-salt: %s",
            "/metrics needs the API key"
            if keys
            else "/metrics is open (no --api-key) and leaves out the image encoder cache's counters",
        )
    async_engine = AsyncEngine(
        engine, on_finished=metrics.on_finished, on_aborted=metrics.aborted.inc, on_step=metrics.on_step
    )

    def count_error(status: int) -> None:
        metrics.http_errors.labels(status=str(status), **metrics.labels).inc()

    as_ids = return_tokens_as_token_ids
    completions = OpenAIServingCompletion(engine, async_engine, names, limits, count_error, tokens_as_ids=as_ids)
    chat = OpenAIServingChat(engine, async_engine, names, limits, count_error, tokens_as_ids=as_ids)
    chat.tool_parser = tool_call_parser  # tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser)
    if tool_call_parser == "openai" and not isinstance(chat.inputs.reasoning, GptOssReasoningParser):
        raise ValueError("tool_call_parser 'openai' needs reasoning_parser 'openai_gptoss' (gpt-oss's harmony format)")
    if engine.model_config.architecture == "GptOssForCausalLM" and chat.inputs.reasoning is None:
        logging.getLogger("prefixkv.server").warning(
            "gpt-oss answers in harmony's channels: without --reasoning-parser openai_gptoss a chat reply's "
            "content is the whole reply, its analysis included (as vLLM's); add it, and for tools "
            "--enable-auto-tool-choice --tool-call-parser openai"
        )
    chat.response_role = response_role
    completions.request_logger = chat.request_logger = request_logger
    embeddings = OpenAIServingEmbedding(engine, async_engine, names, limits, count_error)
    tokenization = OpenAIServingTokenization(chat)
    loras: LoRARegistry | None = None
    if getattr(engine.config, "enable_lora", False) or lora_modules:
        loras = LoRARegistry(names)
        load_startup_adapters(engine, loras, list(lora_modules or []))
        completions.loras = chat.loras = loras

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            async_engine.start()
        stats_task = None
        if log_stats_interval is not None:
            stats_task = asyncio.create_task(StatsLogger(engine).run(log_stats_interval))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="prefixkv", version=__version__, lifespan=lifespan, root_path=root_path or "")
    app.state.engine = engine
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.loras = loras  # the replicas' ingress asks it for an adapter's block-key identity
    # Added last = outermost: the body cap answers before the key is even looked at.
    app.add_middleware(DrainMiddleware, is_draining=lambda: async_engine.is_draining)
    if keys:
        open_paths = OPEN_PATHS - {"/metrics"} if tenants else OPEN_PATHS
        app.add_middleware(APIKeyMiddleware, api_key=keys, on_reject=lambda: count_error(401), open_paths=open_paths)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes, on_reject=lambda: count_error(413))
    if cors is not None:  # outermost: a browser's preflight is answered before the key is asked for
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors.allow_origins,
            allow_methods=cors.allow_methods,
            allow_headers=cors.allow_headers,
            allow_credentials=cors.allow_credentials,
        )
    install_error_handlers(app, count_error)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await chat.create(req, raw)

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw: Request):
        return await embeddings.create(req, raw)

    @app.post("/pooling")
    async def create_pooling(req: PoolingRequest, raw: Request):
        return await embeddings.create_pooling(req, raw)

    def adapter(model: str | None) -> LoRARequest | None:
        completions.check_model(model)  # 404 for a model this server does not serve
        return completions.lora_for(model)

    add_cache_control_routes(app, async_engine, adapter)
    # /v1/responses: chat admission and engine path, Responses shapes
    add_responses_routes(app, chat, id_prefix=response_id_prefix)
    # /v1/messages: chat admission and engine path, Anthropic's shapes
    add_anthropic_routes(app, chat)

    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = runtime_lora_updating_from_env()
    if lora_allowed_dir is None:
        lora_allowed_dir = lora_allowed_dir_from_env()
    if loras is not None and allow_runtime_lora_updating:
        if not keys:
            logging.getLogger("prefixkv.server").warning(
                "runtime LoRA updating is on without --api-key: any client can load adapters from %s",
                f"folders inside {lora_allowed_dir!r}" if lora_allowed_dir else "any folder the server can read",
            )
        add_lora_routes(app, loras, async_engine, lora_allowed_dir)

    def model_cards() -> list[ModelCard]:
        cards = [ModelCard(id=n, root=model_root or n, max_model_len=engine.max_model_len) for n in names]
        return cards + (loras.cards(engine.max_model_len) if loras is not None else [])

    @app.get("/v1/models")
    async def models():
        return ModelList(data=model_cards())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        for card in model_cards():
            if card.id == model_id:
                return card
        raise APIError(f"The model `{model_id}` does not exist.", 404, "NotFoundError", "model")

    @app.post("/tokenize")
    async def tokenize(body: dict = Body(...)):  # noqa: B008 - FastAPI's way to take the raw JSON object
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return await tokenization.detokenize(req)

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return error_response("the engine is not running", 503)
        if async_engine.is_draining:  # a health-checking load balancer takes the server out of rotation
            return error_response("the server is shutting down", 503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if not dev_mode:
        return app

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        # reset_external: there is no external (connector) cache, so there is nothing more to reset
        if reset_running_requests:
            raise APIError(
                "reset_running_requests=true is not supported: the cache is reset only when no request holds blocks",
                400,
                param="reset_running_requests",
            )
        ok = await async_engine.reset_prefix_cache()
        if not ok:
            raise APIError("the prefix cache cannot be reset while requests hold blocks; retry when idle", 409)
        return JSONResponse({"success": True})

    return app
