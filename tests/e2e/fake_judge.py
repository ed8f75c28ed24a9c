"""A scripted fake of a judge model on loopback, for RULER's tests.

The real judge is a paid model (o3, Claude, ...) that cannot run here. This fake follows OpenAI's
documented Chat Completions protocol (https://platform.openai.com/docs/api-reference/chat/create):
`POST /v1/chat/completions` answers with a JSON `chat.completion` body (id, object, created,
model, choices[0].message.content, finish_reason, usage), and errors are `{"error": {message,
type, param, code}}` with the HTTP status. It does not stream and never calls tools.

A test scripts what the next requests get, in order:

    with FakeJudgeServer() as judge:
        judge.reply('{"scores": [...]}')       # a 200 with this content
        judge.delay(3, '{"scores": [...]}')    # the same, after 3 s (for client timeouts)
        judge.status(500)                      # an OpenAI-shaped error with this status
        ...
        judge.requests                         # every request body received, in order

A request that finds the script empty gets a 500 that says so, so a test that under-scripts fails
loudly, unless the test set a rule (`judge.rule(fn)`: `fn(request body) -> content` answers
every request the script does not). Nothing here looks at the meaning of the messages; a rule
may (tests/e2e/test_judge_gate.py).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

PROMPT_TOKENS = 120
COMPLETION_TOKENS = 30


@dataclass(frozen=True)
class _Reply:
    content: str
    delay_s: float = 0.0
    usage: bool = True


@dataclass(frozen=True)
class _Status:
    code: int
    message: str


@dataclass
class FakeJudge:
    """The script and the record of one fake judge; safe to use from the test's thread."""

    port: int
    requests: list[dict[str, Any]] = field(default_factory=list)
    _script: deque[_Reply | _Status] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count = field(default_factory=itertools.count)
    _rule: Callable[[dict[str, Any]], str] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def reply(self, content: str, *, usage: bool = True) -> FakeJudge:
        """The next request gets a 200 with this message content (and usage unless told not)."""
        return self._push(_Reply(content, usage=usage))

    def delay(self, seconds: float, content: str) -> FakeJudge:
        """The next request gets `content` after `seconds` (or nothing if the client leaves)."""
        return self._push(_Reply(content, delay_s=seconds))

    def status(self, code: int, message: str = "The fake judge failed.") -> FakeJudge:
        """The next request gets an OpenAI-shaped error with this HTTP status."""
        return self._push(_Status(code, message))

    def rule(self, fn: Callable[[dict[str, Any]], str] | None) -> FakeJudge:
        """Answer every request the script does not with a 200 whose content is `fn(body)`."""
        with self._lock:
            self._rule = fn
        return self

    def reset(self) -> None:
        """Forget the script and the recorded requests (between tests sharing one server)."""
        with self._lock:
            self._script.clear()
            self.requests.clear()

    @property
    def pending(self) -> int:
        """Scripted behaviours not yet consumed."""
        with self._lock:
            return len(self._script)

    def _push(self, item: _Reply | _Status) -> FakeJudge:
        with self._lock:
            self._script.append(item)
        return self

    def _next(self, body: dict[str, Any]) -> _Reply | _Status:
        with self._lock:
            self.requests.append(body)
            if not self._script and self._rule is not None:
                return _Reply(self._rule(body))
            if not self._script:
                return _Status(500, "The fake judge has no scripted reply left.")
            return self._script.popleft()


def _error(status: _Status) -> JSONResponse:
    kind = "server_error" if status.code >= 500 else "invalid_request_error"
    error = {"message": status.message, "type": kind, "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=status.code)


def build_app(fake: FakeJudge) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        step = fake._next(body)
        if isinstance(step, _Status):
            return _error(step)
        deadline = time.monotonic() + step.delay_s
        while time.monotonic() < deadline:
            # Stop waiting once the client has given up, so shutdown never waits on a sleeper.
            if await request.is_disconnected():
                return JSONResponse({}, status_code=499)
            await asyncio.sleep(0.05)
        response: dict[str, Any] = {
            "id": f"chatcmpl-fakejudge-{next(fake._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "judge"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": step.content},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
        }
        if step.usage:
            response["usage"] = {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": COMPLETION_TOKENS,
                "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
            }
        return response

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeJudgeServer:
    """Run the fake with uvicorn in a daemon thread: `with FakeJudgeServer() as judge:`."""

    def __init__(self, port: int | None = None) -> None:
        self.fake = FakeJudge(port or _free_port())
        config = uvicorn.Config(
            build_app(self.fake),
            host="127.0.0.1",
            port=self.fake.port,
            log_level="warning",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FakeJudge:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake judge server did not start")
            time.sleep(0.05)
        return self.fake

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
