"""HTTP servers on loopback that answer with a test's handler: for clients whose own HTTP stack
is what a test means to run (pool, stream reading, broken connections).

    runner, url = await serve("replica-a", handler)   # handler(Req) -> httpx.Response | None
    ...
    await runner.cleanup()

A handler answers with an `httpx.Response` (its body may be an async generator: a stream), None
(a 404), or raises `HangUp`, and the server then drops the connection without a word (before the
status: a server that went away; in the middle of a body: one that died mid-answer).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from aiohttp import web


@dataclass
class Req:
    """What a handler sees of one request."""

    replica: str  # the name the server was given (`serve`'s first argument)
    path: str
    content: bytes
    peer: Any  # the client's address: one per connection


class HangUp(Exception):
    """Raised by a handler or inside a streamed body: the server drops the connection."""


Handler = Callable[[Req], Any]


async def serve(name: str, handler: Handler) -> tuple[web.AppRunner, str]:
    """A server on a loopback port, named `name`, where every request goes to `handler`; its
    runner (to clean up) and base URL."""

    async def route(request: web.Request) -> web.StreamResponse:
        try:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            result = handler(Req(name, request.path, await request.read(), peer))
            if asyncio.iscoroutine(result):
                result = await result
        except HangUp:
            request.transport.close()  # type: ignore[union-attr]
            raise web.HTTPInternalServerError() from None  # never reaches the client
        if result is None:
            result = httpx.Response(404, json={"error": {}})
        response = web.StreamResponse(status=result.status_code)
        if "content-type" in result.headers:
            response.content_type = result.headers["content-type"].split(";")[0]
        await response.prepare(request)
        try:
            async for piece in result.aiter_bytes():
                await response.write(piece)
        except HangUp:
            request.transport.close()  # type: ignore[union-attr]
            return response
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", route)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    return runner, f"http://127.0.0.1:{sock.getsockname()[1]}"
