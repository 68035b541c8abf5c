"""Run one HTTP request through an in-process ASGI app and yield its response as messages.

An engine replica serves the very app single-engine `prefixkv serve` serves (prefixkv/server/app.py),
so every route, validation, error body and SSE event is the same by construction; the ingress hands
it the request's method, path, headers and body over a Ray Serve handle and relays what comes back:

    {"status": int, "headers": [[name, value], ...]}   first
    b"..."                                             then the body, chunk by chunk (SSE events as sent)

Leaving the iterator early (the client went away, the ingress cancelled the call) tells the app
the client disconnected, so the route aborts its engine request and its blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

ASGIApp = Any


def _scope(method: str, path: str, query: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }


async def call_asgi(
    app: ASGIApp, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
) -> AsyncIterator[dict[str, Any] | bytes]:
    raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(_scope(method, path, query, raw_headers), receive, send)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            kind = message["type"]
            if kind == "http.response.start":
                yield {
                    "status": int(message["status"]),
                    "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", [])],
                }
            elif kind == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    break
        await task  # re-raises what the app raised after sending nothing (its error handlers answer first)
    finally:
        disconnected.set()
        if not task.done():
            # give the route a moment to see the disconnect and abort its engine request itself
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            task.cancel()
