"""`prefixkv serve`: the server's flags, and the process - engine loop on the main thread, HTTP in
a thread, signals turned into a graceful shutdown."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from .limits import RequestLimits
from .stats_logger import interval_from_env
from .tools import TOOL_PARSERS

DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="read flags from a YAML file, keys as the flags are spelled (max-model-len: 512); flags on the "
        "command line override the file's",
    )
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1; use 0.0.0.0 to listen on all interfaces)",
    )
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument(
        "--api-key",
        # one key per flag, repeated for several (vLLM also takes `--api-key A B`, but there a key
        # placed before MODEL swallows it: `--api-key k ./model` would serve the default model)
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /metrics and "
        "/version; repeat the flag for several keys, each accepted; an empty key "
        "means none (default: $VLLM_API_KEY, else none)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        type=_lora_module,
        metavar="NAME=PATH",
        help='LoRA adapters (PEFT folders) served as models: name=path or {"name": ..., "path": ...}; needs '
        '--enable-lora; requests pick one with "model": name',
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=None,
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora); without "
        "this flag or $VLLM_ALLOW_RUNTIME_LORA_UPDATING=true those routes do not exist (404), as vLLM",
    )
    g.add_argument(
        "--lora-allowed-dir",
        default=None,
        metavar="DIR",
        help="runtime LoRA loads must resolve (symlinks and .. followed) inside DIR "
        "(default: $PREFIXKV_LORA_ALLOWED_DIR, else any folder the server can read)",
    )
    g.add_argument(
        "--chat-template",
        type=load_chat_template,
        default=None,
        help="Jinja chat template to use instead of the model's: a file, or the template itself inline "
        "(as vLLM: a value with no '{', '}' or newline that is no file is an error)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is reported (default: MODEL, or "
        "HuggingFaceTB/SmolLM2-135M-Instruct for the embedded model)",
    )
    g.add_argument(
        "--require-cache-salt",
        action="store_true",
        help="refuse requests without a cache_salt (multi-tenant deployments: without a salt, a "
        "client can tell from the time to first token whether someone sent a prompt before); /metrics then "
        "needs the --api-key, or without one leaves out the image encoder cache's counters",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=32 << 20,
        help="larger request bodies get 413 before they are read (default: 32 MiB)",
    )
    g.add_argument(
        "--max-n",
        type=_positive_int,
        default=RequestLimits.max_n,
        help=f"most sequences per prompt, 'n' (default: {RequestLimits.max_n})",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=_positive_int,
        default=RequestLimits.max_prompts,
        help=f"most prompts in one /v1/completions request (default: {RequestLimits.max_prompts})",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGTERM/SIGINT, seconds in-flight requests may still run before they end with an "
        f"error; new requests get 503 meanwhile (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" on /v1/chat/completions: the model calls tools when it decides to '
        "(needs --tool-call-parser); required / named choices work without it",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are found in the model's text: hermes (<tool_call>{json}</tool_call>: "
        "Qwen2.5/3, Hermes, SmolLM3 templates), llama3_json (Llama 3.1+), mistral ([TOOL_CALLS] [...]) or "
        "qwen3_coder / qwen3_xml (<tool_call><function=f><parameter=k>v</parameter>...: Qwen3-Coder) or "
        "glm45 / glm47 (<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>...: GLM-4.5 to 4.7) or "
        'minimax_m2 (<minimax:tool_call><invoke name="f">...: MiniMax-M2), pythonic ([f(a=1), ...]: '
        "Llama 3.2 / 4), llama4_pythonic (the same in <|python_start|> tags) or openai (gpt-oss's harmony "
        "commentary to functions.f; with --reasoning-parser openai_gptoss)",
    )
    g.add_argument(
        "--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log every request")
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older spelling of the default: requests are not logged unless --enable-log-requests",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log one line per request: its id, the prompt (cut to --max-log-len) and its sampling parameters",
    )
    g.add_argument(
        "--max-log-len",
        type=_non_negative_int,
        default=None,
        help="with --enable-log-requests: most prompt characters and prompt token ids logged (default: all)",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="vLLM's switch for usage.prompt_tokens_details.cached_tokens; prefixkv always reports it "
        "(accepted, logged)",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat completion messages when the request's last message is not from that role "
        "(vLLM: used with add_generation_prompt) (default: assistant)",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name each token 'token_id:N' (a token that is part of a character is then still "
        "named exactly); a request's return_tokens_as_token_ids overrides it (vLLM's)",
    )
    g.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a proxy serves this server under (FastAPI's root_path), e.g. /llm: the OpenAPI "
        "docs and redirects carry it; routes answer with and without it (default: none)",
    )
    cors = p.add_argument_group(
        "CORS (browsers calling the API from pages of other origins; starlette's CORSMiddleware). Off unless "
        "--allowed-origins is given (vLLM allows every origin by default)"
    )
    cors.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        help="JSON list of origins allowed, e.g. '[\"https://app.example\"]' or '[\"*\"]' (default: no CORS)",
    )
    cors.add_argument(
        "--allowed-methods", type=_json_list, default=None, help='JSON list of allowed methods (default: ["*"])'
    )
    cors.add_argument(
        "--allowed-headers", type=_json_list, default=None, help='JSON list of allowed headers (default: ["*"])'
    )
    cors.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow cookies and Authorization headers on cross-origin requests (default: off)",
    )
    tls = p.add_argument_group("TLS (uvicorn's): serve https")
    tls.add_argument("--ssl-keyfile", default=None, help="the server's private key, PEM (with --ssl-certfile)")
    tls.add_argument("--ssl-certfile", default=None, help="the server's certificate chain, PEM (with --ssl-keyfile)")
    tls.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates against")
    tls.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*; default: 0)",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="do not log vLLM's periodic stats line (throughput, running / waiting requests, KV cache usage, "
        "prefix cache hit rate; every $VLLM_LOG_STATS_INTERVAL seconds, default 10)",
    )


def load_chat_template(value: str) -> str:
    """--chat-template: a file's content, or the inline template (escapes such as \\n decoded),
    as vLLM's load_chat_template; checked to compile now, not at the first request."""
    import codecs

    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise argparse.ArgumentTypeError(
                f"the chat template {value!r} looks like a file path, but it cannot be opened: {e.strerror or e}"
            ) from e
        text = codecs.decode(value, "unicode_escape")
    from ..model.chat_template import compile_chat_template

    try:
        compile_chat_template(text)
    except Exception as e:  # jinja2's TemplateSyntaxError and friends
        raise argparse.ArgumentTypeError(f"the chat template does not compile: {e}") from e
    return text


def api_keys_of(args: argparse.Namespace) -> list[str]:
    """The accepted keys: the flags', else $VLLM_API_KEY (or $PREFIXKV_API_KEY); empty ones dropped."""
    keys = (
        args.api_key
        if args.api_key is not None
        else [os.environ.get("VLLM_API_KEY") or os.environ.get("PREFIXKV_API_KEY") or ""]
    )
    return [k for k in keys if k]


def check_server_args(args: argparse.Namespace) -> None:
    """Flag combinations refused before the model loads (vLLM's messages)."""
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise SystemExit("error: When `--enable-auto-tool-choice` is set, `--tool-call-parser` must be set")
    harmony_tools = getattr(args, "tool_call_parser", None) == "openai"
    if harmony_tools and getattr(args, "reasoning_parser", None) != "openai_gptoss":
        # harmony's tool calls are messages of their own: the reasoning parser's split reads them
        raise SystemExit("error: --tool-call-parser openai needs --reasoning-parser openai_gptoss (gpt-oss's harmony)")
    # the runtime LoRA flags change nothing on their own: refused by name rather than ignored
    from .lora import runtime_lora_updating_from_env

    runtime = getattr(args, "allow_runtime_lora_updating", None) or runtime_lora_updating_from_env()
    if getattr(args, "allow_runtime_lora_updating", None) and not getattr(args, "enable_lora", False):
        raise SystemExit("error: --allow-runtime-lora-updating needs --enable-lora")
    if getattr(args, "allowed_origins", None) is None:
        for dest, flag in (
            ("allowed_methods", "--allowed-methods"),
            ("allowed_headers", "--allowed-headers"),
            ("allow_credentials", "--allow-credentials"),
        ):
            if getattr(args, dest, None):
                raise SystemExit(f"error: {flag} needs --allowed-origins (CORS is off without it)")
    if bool(getattr(args, "ssl_keyfile", None)) != bool(getattr(args, "ssl_certfile", None)):
        raise SystemExit("error: --ssl-keyfile and --ssl-certfile go together (the key and its certificate)")
    if not getattr(args, "ssl_certfile", None):
        for dest, flag in (("ssl_ca_certs", "--ssl-ca-certs"), ("ssl_cert_reqs", "--ssl-cert-reqs")):
            if getattr(args, dest, None):
                raise SystemExit(f"error: {flag} needs --ssl-keyfile and --ssl-certfile (TLS)")
    if getattr(args, "max_log_len", None) is not None and not getattr(args, "enable_log_requests", False):
        raise SystemExit("error: --max-log-len needs --enable-log-requests (nothing is logged without it)")
    root = getattr(args, "root_path", None)
    if root and (not root.startswith("/") or root.endswith("/")):
        raise SystemExit(f"error: --root-path must start with '/' and not end with one, got {root!r}")
    if getattr(args, "lora_allowed_dir", None) and not runtime:
        raise SystemExit(
            "error: --lora-allowed-dir needs runtime LoRA updating "
            "(--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)"
        )


def _lora_module(text: str) -> Any:
    from .lora import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _json_list(text: str) -> list[str]:
    """vLLM's CORS flags: a JSON list of strings ('["https://a.example"]')."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} (e.g. '[\"https://a.example\"]')") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class PortInUse(OSError):
    """The server's address cannot be bound (another process holds the port)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the server's address before the model loads, as vLLM does, so a port in use fails in
    a moment, not after the load. No SO_REUSEPORT (vLLM sets it): with it a second server would
    bind the same port and share its connections."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUse(f"cannot resolve --host {host!r}: {e}") from e
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers only
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise PortInUse(
            f"cannot bind {host}:{port}: {e.strerror or e} (is another server running on that port?)"
        ) from e
    sock.set_inheritable(True)
    return sock


def app_from_args(
    args: argparse.Namespace, engine: Any, model_name: str, log_stats: bool = True, response_id_prefix: str = "resp"
) -> Any:
    """The OpenAI app of `serve`'s flags around a loaded engine: what single-engine serve runs and
    what every engine replica of `serve --replicas` runs (prefixkv/replicas/engine_replica.py)."""
    from .app import CORSOptions, create_app
    from .request_logger import RequestLogger

    limits = RequestLimits(
        max_n=args.max_n,
        max_prompts=args.max_prompts_per_request,
        max_logprobs=getattr(engine.config, "max_logprobs", RequestLimits.max_logprobs),
        require_cache_salt=args.require_cache_salt,
    )
    if getattr(args, "chat_template", None):
        engine.tokenizer.set_chat_template(args.chat_template)
        logging.getLogger("prefixkv.server").info("chat template: from --chat-template")
    log = logging.getLogger("prefixkv.server")
    if getattr(args, "enable_prompt_tokens_details", False):
        log.info("--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is always reported")
    if getattr(args, "disable_log_requests", False):
        log.info("--disable-log-requests: requests are not logged (the default without --enable-log-requests)")
    cors = None
    if getattr(args, "allowed_origins", None) is not None:
        cors = CORSOptions(
            allow_origins=args.allowed_origins,
            allow_methods=args.allowed_methods or ["*"],
            allow_headers=args.allowed_headers or ["*"],
            allow_credentials=args.allow_credentials,
        )
    api_keys = api_keys_of(args)
    return create_app(
        engine,
        served_model_names=args.served_model_name or [model_name],
        api_key=api_keys or None,
        model_root=model_name,
        engine_thread=False,
        limits=limits,
        max_request_body_bytes=args.max_request_body_bytes,
        lora_modules=getattr(args, "lora_modules", None),
        allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", None),
        lora_allowed_dir=getattr(args, "lora_allowed_dir", None),
        log_stats_interval=None if args.disable_log_stats or not log_stats else interval_from_env(),
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        root_path=getattr(args, "root_path", None),
        cors=cors,
        response_role=getattr(args, "response_role", "assistant"),
        request_logger=RequestLogger(args.max_log_len) if getattr(args, "enable_log_requests", False) else None,
        response_id_prefix=response_id_prefix,
        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
    )


def run_server(args: argparse.Namespace, engine: Any, model_name: str, sock: socket.socket | None = None) -> int:
    """Serve a loaded engine until a signal; returns the process exit code. `sock`: the address
    bound before the load (bind_socket); bound here when not given."""
    import uvicorn

    log = logging.getLogger("prefixkv.server")
    api_keys = api_keys_of(args)
    app = app_from_args(args, engine, model_name)
    scheme = "https" if args.ssl_certfile else "http"
    log.info("serving on %s://%s:%d (API key %s)", scheme, args.host, args.port, "required" if api_keys else "off")
    async_engine = app.state.async_engine
    # The engine loop stays on the main thread (torch runs slower from threads started later, see
    # server/async_engine.py); HTTP runs in a thread, and signals reach it through should_exit.
    # uvicorn waits a little longer than the engine, so the requests the engine ends at the
    # deadline still get their error event or 503 out before connections are closed.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=int(args.shutdown_timeout) + 5,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
    )
    if sock is None:
        sock = bind_socket(args.host, args.port)
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="prefixkv-http", daemon=True)

    signalled = threading.Event()

    def close_when_drained() -> None:
        # The listener stays open while requests are in flight, so that new connections get a 503
        # (and /health a 503) rather than "connection refused": a load balancer sees the server
        # leave and retries elsewhere. Once nothing is in flight (or the engine has ended what
        # was left at the deadline) uvicorn closes the listener and finishes its connections.
        deadline = time.monotonic() + args.shutdown_timeout + 1.0
        while async_engine.num_in_flight and time.monotonic() < deadline and not server.should_exit:
            time.sleep(0.05)
        server.should_exit = True

    def stop(signum: int, _frame: Any) -> None:
        if signalled.is_set():  # a second signal: stop now
            log.info("signal %d again: exiting at once", signum)
            server.should_exit = True
            server.force_exit = True
            async_engine.begin_drain(0.0)
            return
        signalled.set()
        log.info(
            "signal %d: draining (in-flight requests may run %gs more), then exiting", signum, args.shutdown_timeout
        )
        async_engine.begin_drain(args.shutdown_timeout)
        threading.Thread(target=close_when_drained, name="prefixkv-drain", daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    http.start()
    async_engine.run(keep_going=http.is_alive)
    http.join(timeout=args.shutdown_timeout + 15)
    if hasattr(engine, "shutdown"):
        engine.shutdown()  # the KV event publisher sends what it queued and closes its sockets
    return 0 if server.should_exit else 1  # the HTTP server ended by itself: it failed to start
