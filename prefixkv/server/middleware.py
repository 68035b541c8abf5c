"""Pure ASGI middleware (not BaseHTTPMiddleware, so client disconnects still reach the routes):
the API key, the request body cap, and refusing new work while the server drains. CORS is
starlette's CORSMiddleware (create_app adds it outermost, so preflights never need a key)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

# Open without a key, as in vLLM: probes and scrapes. Everything else - the API, the admin
# route that flushes every tenant's cache, the OpenAPI docs - needs it.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


def route_path(scope: Scope) -> str:
    """The path the routes see: behind --root-path a request may carry that prefix or not, and
    both reach the same route (starlette strips it when present), so the checks here do too."""
    path: str = scope["path"]
    root = scope.get("root_path") or ""
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


class APIKeyMiddleware:
    """Require `Authorization: Bearer KEY` on every path but `open_paths` (default OPEN_PATHS);
    any of several keys (`--api-key` given more than once, as vLLM) is accepted. `x-api-key: KEY`
    (the header Anthropic's SDK sends) is taken as well."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | list[str],
        on_reject: Callable[[], Any] | None = None,
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self.expected = [f"Bearer {k}".encode() for k in keys if k]
        self.expected_plain = [k.encode() for k in keys if k]
        self.on_reject = on_reject
        self.open_paths = open_paths

    def _valid(self, header: bytes, plain: bytes) -> bool:
        # every key is compared (no early exit), so timing tells nothing about which one is near
        bearer = sum(secrets.compare_digest(header, e) for e in self.expected)
        return bearer + sum(secrets.compare_digest(plain, e) for e in self.expected_plain) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and route_path(scope) not in self.open_paths:
            headers = dict(scope.get("headers") or ())
            if not self._valid(headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")):
                if self.on_reject is not None:
                    self.on_reject()
                resp = error_response(
                    "Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                    401,
                    "AuthenticationError",
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413 before reading them: by Content-Length
    when it is sent, and while reading otherwise (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], Any] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    def _message(self) -> str:
        return (
            f"the request body is larger than this server's limit of {self.max_bytes} bytes (--max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                too_large = int(length) > self.max_bytes
            except ValueError:
                too_large = False  # the server rejects a malformed length itself
            if too_large:
                if self.on_reject is not None:
                    self.on_reject()
                await error_response(self._message(), 413)(scope, receive, send)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # raised inside the route's body read: the app's handler answers 413
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)


class DrainMiddleware:
    """While the server shuts down gracefully, new API requests get 503 (in-flight ones finish),
    with `Connection: close` so a keep-alive client (a load balancer) reconnects elsewhere."""

    def __init__(self, app: ASGIApp, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and route_path(scope).startswith("/v1/")
            and scope["method"] == "POST"
            and self.is_draining()
        ):
            response = error_response("the server is shutting down", 503)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
