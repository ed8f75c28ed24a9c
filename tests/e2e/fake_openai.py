"""A fake OpenAI-compatible provider on loopback, for the upstream engine's tests.

It follows OpenAI's documented Chat Completions protocol
(https://platform.openai.com/docs/api-reference/chat/create and
https://platform.openai.com/docs/api-reference/chat-streaming): a JSON `chat.completion` body,
or server-sent `chat.completion.chunk` events ending in `data: [DONE]`, with a final usage chunk
when `stream_options.include_usage` is set, and errors as `{"error": {message, type, param,
code}}` with the HTTP status. It answers with fixed text ("Hello from fake"), or with one call of
the first tool when tools are given, and records every request (headers and body) it saw.

A message whose content contains `trigger-400` gets a 400 `invalid_request_error`; one that
contains `trigger-echo-key` gets a 401 whose message echoes the `Authorization` header it was
sent, as careless providers do (OpenAI itself masks all but the key's last characters);
`trigger-500` and `trigger-503` get those statuses with a `server_error` body;
`trigger-stream-error` streams its first content chunk and then an `{"error": ...}` event (how
OpenAI reports a failure after the status line is sent); `trigger-slow` waits 8 s before
answering. It is not a model: nothing here looks at the meaning of the messages.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TEXT_PIECES = ["Hello", " from", " fake"]
TEXT = "".join(TEXT_PIECES)


@dataclass
class Seen:
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeOpenAI:
    port: int
    seen: list[Seen] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def _usage() -> dict[str, int]:
    return {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def _tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    tools = body.get("tools") or []
    if not tools or body.get("tool_choice") == "none":
        return None
    return {
        "id": "call_fake_1",
        "type": "function",
        "function": {"name": tools[0]["function"]["name"], "arguments": '{"query": "x"}'},
    }


def build_app(fake: FakeOpenAI) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        fake.seen.append(Seen({k.lower(): v for k, v in request.headers.items()}, body))
        if any("trigger-400" in str(m.get("content")) for m in body.get("messages", [])):
            error = {
                "message": "The fake refuses this request (trigger-400).",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "invalid_value",
            }
            return JSONResponse({"error": error}, status_code=400)
        if any("trigger-echo-key" in str(m.get("content")) for m in body.get("messages", [])):
            sent = request.headers.get("authorization", "")
            error = {
                "message": f"Incorrect API key provided: {sent}. Check the key you sent.",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
            return JSONResponse({"error": error}, status_code=401)
        for status in (500, 503):
            if any(f"trigger-{status}" in str(m.get("content")) for m in body["messages"]):
                error = {"message": f"The fake failed ({status}).", "type": "server_error"}
                return JSONResponse({"error": {**error, "param": None, "code": None}}, status)
        if any("trigger-slow" in str(m.get("content")) for m in body["messages"]):
            await asyncio.sleep(8)
        call = _tool_call(body)
        created = int(time.time())
        if body.get("stream") and any(
            "trigger-stream-error" in str(m.get("content")) for m in body["messages"]
        ):
            return StreamingResponse(_failing_events(body["model"]), media_type="text/event-stream")
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": None if call else TEXT}
            if call:
                message["tool_calls"] = [call]
            return {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": created,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": "tool_calls" if call else "stop",
                    }
                ],
                "usage": _usage(),
            }
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _events(body["model"], created, call, include_usage), media_type="text/event-stream"
        )

    return app


def _events(
    model: str, created: int, call: dict[str, Any] | None, include_usage: bool
) -> Iterator[str]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}

    yield chunk([delta({"role": "assistant", "content": ""})])
    if call:
        head = {**call, "index": 0, "function": {"name": call["function"]["name"], "arguments": ""}}
        yield chunk([delta({"tool_calls": [head]})])
        for piece in ('{"query": ', '"x"}'):
            yield chunk([delta({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})])
        yield chunk([delta({}, "tool_calls")])
    else:
        for piece in TEXT_PIECES:
            yield chunk([delta({"content": piece})])
        yield chunk([delta({}, "stop")])
    if include_usage:
        yield chunk([], _usage())
    yield "data: [DONE]\n\n"


def _failing_events(model: str) -> Iterator[str]:
    """One content chunk, then the error event a provider sends when it fails mid-stream."""
    first = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": TEXT_PIECES[0]}}],
    }
    yield f"data: {json.dumps(first)}\n\n"
    error = {"message": "The fake broke mid-stream.", "type": "server_error", "code": None}
    yield f"data: {json.dumps({'error': {**error, 'param': None}})}\n\n"


class FakeOpenAIServer:
    """Run the fake with uvicorn in a daemon thread: `with FakeOpenAIServer(port) as fake:`."""

    def __init__(self, port: int) -> None:
        self.fake = FakeOpenAI(port)
        config = uvicorn.Config(
            build_app(self.fake), host="127.0.0.1", port=port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake OpenAI server did not start")
            time.sleep(0.05)
        return self.fake

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
