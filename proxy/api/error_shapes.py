"""Errors in the shape of the protocol a path speaks.

Every error of this server is built once, in OpenAI's shape (`proxy.errors`), by whichever
layer refuses the request: the body-size limit, authentication, the caller limits, validation,
the route. Anthropic's clients read another shape, so for the Messages API's paths this
middleware, outside all of those, rewrites each error answer's body to
`{"type": "error", "error": {"type", "message"}, "request_id"}` for the same status. Answers
that are not errors, streams included, pass through untouched.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.protocols.messages import anthropic_error

ANTHROPIC_PATHS = ("/v1/messages",)


class AnthropicErrorsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not any(
            path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS
        ):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshape(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole (small) error body is here
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            raw = b"".join(chunks)
            try:
                original = json.loads(raw)
            except ValueError:
                original = {}
            rid = scope.get("state", {}).get("request_id")
            body = json.dumps(anthropic_error(start["status"], original, rid)).encode()
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshape)
