"""Limits before any work: the token bucket and the per-caller middleware (pure ASGI, a fake
clock), the request-shape checks, and the engine queue's admission on the real model.

The end-to-end tests (tests/e2e/test_client_limits.py) check the same limits through a real
server and the openai client.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections import Counter
from typing import Any

import pytest

from proxy.adapters.registry import ServedModels
from proxy.api.auth import PRINCIPAL_KEY, Principal
from proxy.api.limits import CallerLimitsMiddleware, TokenBucket
from proxy.chat.record import CallInfo
from proxy.chat.request import RequestLimits, check_shape, json_shape
from proxy.chat.service import ChatService
from proxy.engines.base import GenerationRequest, SamplingParams
from proxy.engines.local import LocalEngine
from proxy.errors import InvalidRequestError, OverloadedError
from proxy.protocols.chat import ChatCompletionRequest
from proxy.settings import Settings

ALICE, BOB = Principal("key-a", "inference"), Principal("key-b", "inference")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------- token bucket


def test_a_bucket_holds_a_minutes_worth_then_refills_at_the_per_second_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(60, clock)  # one a second, a burst of 60
    assert [bucket.take("a") for _ in range(60)] == [0.0] * 60
    assert bucket.take("a") == pytest.approx(1.0)  # empty: one token a second from now
    clock.now += 0.5
    assert bucket.take("a") == pytest.approx(0.5)  # half a token came back: not enough
    clock.now += 0.5
    assert bucket.take("a") == 0.0
    assert bucket.take("a") > 0


def test_a_refused_request_spends_nothing() -> None:
    clock = FakeClock()
    bucket = TokenBucket(2, clock)
    bucket.take("a"), bucket.take("a")
    for _ in range(10):
        assert bucket.take("a") > 0
    clock.now += 30.0  # 2 per minute: one token per 30 s
    assert bucket.take("a") == 0.0


def test_each_caller_has_its_own_bucket() -> None:
    bucket = TokenBucket(1, FakeClock())
    assert bucket.take("a") == 0.0
    assert bucket.take("a") > 0
    assert bucket.take("b") == 0.0


def test_buckets_idle_for_a_minute_are_forgotten() -> None:
    clock = FakeClock()
    bucket = TokenBucket(10, clock)
    for i in range(100):
        bucket.take(f"caller-{i}")
    assert len(bucket) == 100
    clock.now += 61.0
    bucket.take("new")
    assert len(bucket) == 1
    assert [bucket.take("caller-0") for _ in range(10)] == [0.0] * 10  # a fresh, full bucket


# ----------------------------------------------------------------------------- middleware


class Reply:
    """A minimal ASGI app: answers 200, holding its body open until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.started = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.started += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await self.release.wait()
        await send({"type": "http.response.body", "body": b"last", "more_body": False})


async def call(
    app: Any, path: str = "/v1/chat/completions", host: str = "10.0.0.1", principal: Any = None
) -> tuple[int, dict[str, str], bytes]:
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [],
        "client": (host, 5000),
        "state": {} if principal is None else {PRINCIPAL_KEY: principal},
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def assert_openai_429(status: int, headers: dict[str, str], body: bytes, code: str) -> None:
    assert status == 429
    assert int(headers["retry-after"]) >= 1
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "requests" and error["code"] == code and error["message"]


async def test_over_the_rate_is_a_429_with_retry_after_and_the_app_never_runs() -> None:
    clock, app = FakeClock(), Reply()
    limited = CallerLimitsMiddleware(app, per_minute=2, concurrency=0, clock=clock)
    assert (await call(limited, principal=ALICE))[0] == 200
    assert (await call(limited, principal=ALICE))[0] == 200
    status, headers, body = await call(limited, principal=ALICE)
    assert_openai_429(status, headers, body, "rate_limit_exceeded")
    assert headers["retry-after"] == "30"  # 2 a minute: the next token in 30 s
    assert app.started == 2
    clock.now += 30.0
    assert (await call(limited, principal=ALICE))[0] == 200


async def test_health_and_the_rl_routes_are_not_limited() -> None:
    limited = CallerLimitsMiddleware(Reply(), per_minute=1, concurrency=1, clock=FakeClock())
    assert (await call(limited, "/v1/models", principal=ALICE))[0] == 200
    assert (await call(limited, "/v1/chat/completions", principal=ALICE))[0] == 429
    for _ in range(5):
        assert (await call(limited, "/health", principal=ALICE))[0] == 200
        assert (await call(limited, "/rl/trajectories", principal=ALICE))[0] == 200


async def test_the_caller_is_the_api_key_and_requests_without_one_are_not_limited() -> None:
    limited = CallerLimitsMiddleware(Reply(), per_minute=1, concurrency=0, clock=FakeClock())
    alice, bob = Principal("key-a", "inference"), Principal("key-b", "inference")
    open_mode = Principal(None, "admin", "open")
    assert (await call(limited, principal=alice))[0] == 200
    assert (await call(limited, principal=alice, host="10.9.9.9"))[0] == 429  # same key
    assert (await call(limited, principal=bob))[0] == 200  # same address, another key
    for _ in range(5):  # no key (open mode): neither the address nor anything else counts
        assert (await call(limited, principal=open_mode, host="10.0.0.7"))[0] == 200
        assert (await call(limited, host="10.0.0.7"))[0] == 200


async def test_with_address_limits_on_a_request_without_a_key_counts_against_its_address() -> None:
    limited = CallerLimitsMiddleware(
        Reply(), per_minute=1, concurrency=0, by_address=True, clock=FakeClock()
    )
    open_mode = Principal(None, "admin", "open")
    assert (await call(limited, principal=open_mode, host="10.0.0.7"))[0] == 200
    assert (await call(limited, host="10.0.0.7"))[0] == 429  # no key: the address counts
    assert (await call(limited, host="10.0.0.8"))[0] == 200
    assert (await call(limited, principal=Principal("key-a", "inference"), host="10.0.0.7"))[
        0
    ] == 200  # a key is its own caller, wherever it comes from


@pytest.mark.parametrize(
    "principal", [None, Principal(None, "admin", "open")], ids=["none", "open"]
)
async def test_the_default_limits_serve_a_batch_of_50_a_second_without_keys_for_minutes(
    principal: Principal | None,
) -> None:
    """A batch client on loopback, one address, no key: 50 requests a second for five minutes
    (15,000 requests; the old default refused the 601st) are all served."""
    settings = Settings()
    clock, app = FakeClock(), Reply()
    limited = CallerLimitsMiddleware(
        app,
        per_minute=settings.limits.caller_requests_per_minute,
        concurrency=settings.limits.caller_concurrency,
        by_address=settings.limits.caller_address_limits,
        clock=clock,
    )
    statuses = Counter()
    for _ in range(5 * 60 * 50):
        statuses[(await call(limited, host="127.0.0.1", principal=principal))[0]] += 1
        clock.now += 1 / 50
    assert statuses == {200: 15_000}


async def test_the_default_per_key_rate_serves_50_a_second_and_refuses_a_runaway_loop() -> None:
    settings = Settings()
    clock = FakeClock()
    limited = CallerLimitsMiddleware(
        Reply(),
        per_minute=settings.limits.caller_requests_per_minute,
        concurrency=settings.limits.caller_concurrency,
        clock=clock,
    )
    key = Principal("key-a", "inference")
    for _ in range(5 * 60 * 50):
        assert (await call(limited, principal=key))[0] == 200
        clock.now += 1 / 50
    statuses = Counter()
    for _ in range(10_000):  # 1,000 a second for ten seconds: the bucket runs dry
        statuses[(await call(limited, principal=key))[0]] += 1
        clock.now += 1 / 1000
    assert statuses[429] > 0 and statuses[200] > 0


async def test_a_concurrency_slot_is_held_until_a_streamed_body_ends() -> None:
    app = Reply()
    limited = CallerLimitsMiddleware(app, per_minute=0, concurrency=1)
    app.release.clear()
    first = asyncio.create_task(call(limited, principal=ALICE))
    while app.started == 0:  # the first request is in the app, its body still open
        await asyncio.sleep(0)
    status, headers, body = await call(limited, principal=ALICE)
    assert_openai_429(status, headers, body, "rate_limit_exceeded")
    app.release.set()
    assert (await first)[0] == 200
    assert limited.in_flight == {}
    assert (await call(limited, principal=ALICE))[0] == 200


async def test_other_callers_keep_their_own_concurrency_slots() -> None:
    app = Reply()
    limited = CallerLimitsMiddleware(app, per_minute=0, concurrency=1)
    app.release.clear()
    first = asyncio.create_task(call(limited, principal=ALICE))
    while app.started == 0:
        await asyncio.sleep(0)
    second = asyncio.create_task(call(limited, principal=BOB))
    while app.started == 1:
        await asyncio.sleep(0)
    assert dict(limited.in_flight) == {"key:key-a": 1, "key:key-b": 1}
    app.release.set()
    assert [(await first)[0], (await second)[0]] == [200, 200]


async def test_a_slot_is_freed_when_the_app_fails() -> None:
    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    limited = CallerLimitsMiddleware(broken, per_minute=0, concurrency=1)
    for _ in range(3):
        with pytest.raises(RuntimeError):
            await call(limited, principal=ALICE)
    assert limited.in_flight == {}


async def test_zero_turns_both_limits_off() -> None:
    limited = CallerLimitsMiddleware(Reply(), per_minute=0, concurrency=0)
    for _ in range(50):
        assert (await call(limited, principal=ALICE))[0] == 200


# ----------------------------------------------------------------------------- request shape


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "rlproxy", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_json_shape_counts_depth_and_values_without_recursion() -> None:
    assert json_shape(5) == (0, 1)
    assert json_shape([]) == (1, 1)
    assert json_shape({"type": "string"}) == (1, 2)
    assert json_shape({"a": [1, {"b": None}]}) == (3, 5)
    deep: Any = []
    for _ in range(50_000):  # far past Python's recursion limit
        deep = [deep]
    assert json_shape(deep) == (50_001, 50_001)


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
        ({"tools": [tool(f"t{i}", None) for i in range(129)]}, "tools", "array_above_max_length"),
        (
            {"messages": [{"role": "user", "content": "Hi"}] * 11},
            "messages",
            "array_above_max_length",
        ),
        ({"tools": [tool("f", nested(6))]}, "tools[0].function.parameters", "invalid_value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": nested(6)}}},
            "response_format.json_schema.schema",
            "invalid_value",
        ),
        (
            {"tools": [tool(f"t{i}", {"enum": list(range(30))}) for i in range(4)]},
            "tools",
            "invalid_value",
        ),
    ],
    ids=["5 stops", "129 tools", "11 messages", "deep tool", "deep response_format", "big"],
)
def test_a_request_over_a_shape_limit_is_a_400(fields: dict, param: str, code: str) -> None:
    limits = RequestLimits(max_messages=10, max_schema_depth=12, max_schema_nodes=100)
    with pytest.raises(InvalidRequestError) as info:
        check_shape(request(**fields), limits)
    assert info.value.param == param and info.value.code == code
    assert info.value.status_code == 400


def test_a_request_at_every_shape_limit_passes() -> None:
    limits = RequestLimits(max_messages=10, max_schema_depth=13, max_schema_nodes=200)
    check_shape(
        request(
            messages=[{"role": "user", "content": "Hi"}] * 10,
            stop=["a", "b", "c", "d"],
            tools=[tool("f", nested(6)), *(tool(f"t{i}", None) for i in range(127))],
        ),
        limits,
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": "5"},
        {"max_tokens": 5.0},
        {"max_completion_tokens": "5"},
        {"n": "1"},
        {"n": True},
        {"seed": "1"},
        {"top_logprobs": "2", "logprobs": True},
        {"temperature": "0.5"},
        {"top_p": "1"},
        {"presence_penalty": "0"},
    ],
    ids=repr,
)
def test_numbers_are_strict(fields: dict) -> None:
    with pytest.raises(ValueError, match=r"valid (integer|number)"):
        request(**fields)


def test_a_json_integer_is_a_number() -> None:
    req = request(temperature=1, top_p=1, max_tokens=5, seed=-3, n=2)
    assert req.temperature == 1.0 and isinstance(req.temperature, float)


# ----------------------------------------------------------------------------- engine queue


@pytest.fixture(scope="module")
async def engine(loaded_model):
    engine = LocalEngine(loaded_model, max_batch_size=1)
    await engine.start()
    yield engine
    await engine.stop()


async def until(condition: Any, timeout: float = 60.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def long_request(tokenizer: Any) -> GenerationRequest:
    ids = tokenizer.encode("Write a very long story about the sea.", add_special_tokens=False)
    # Temperature 2 all but never samples the end token: the row runs until it is closed.
    return GenerationRequest(ids, SamplingParams(max_tokens=2000, temperature=2.0, seed=1))


async def test_the_engine_counts_rows_waiting_for_the_batch(engine, tokenizer) -> None:
    assert engine.queued_rows() == 0
    running = engine.generate(long_request(tokenizer))
    await anext(running)  # decoding: the batch (of 1) is full
    waiting = engine.generate(long_request(tokenizer))
    pending = asyncio.ensure_future(anext(waiting))
    assert await until(lambda: engine.queued_rows() == 1)
    await running.aclose()  # the running row leaves; the waiting one starts
    await pending
    assert engine.queued_rows() == 0
    cancelled = engine.generate(long_request(tokenizer))
    pending = asyncio.ensure_future(anext(cancelled))
    assert await until(lambda: engine.queued_rows() == 1)
    pending.cancel()  # gone while waiting: dropped, and no longer counted
    with contextlib.suppress(asyncio.CancelledError):
        await pending
    await waiting.aclose()
    assert await until(lambda: engine.queued_rows() == 0 and engine.health().ok)
    assert engine.health().detail["running_rows"] in (0, 1)


async def test_admission_counts_requests_not_yet_handed_to_the_engine(engine, tokenizer) -> None:
    """A burst admitted before any of it reaches the engine cannot overshoot the bound; a
    request dropped without running gives its place back."""
    chat = ChatService(engine, ServedModels("rlproxy"), tokenizer, max_queued_rows=2)

    async def prepare(n: int = 1) -> Any:
        return await chat.prepare(CallInfo(request(max_tokens=2, n=n), "req"))

    first, second = await prepare(), await prepare()
    assert engine.queued_rows() == 0  # nothing has reached the engine yet
    with pytest.raises(OverloadedError) as info:
        await prepare()
    assert info.value.status_code == 429 and info.value.headers == {"retry-after": "1"}
    del second
    gc.collect()
    third = await prepare()
    body = await chat.complete(first)  # handed over, generated, done
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    fourth = await prepare()
    for prep in (third, fourth):
        await chat.complete(prep)
    assert chat._admissions.rows == 0
    assert await until(lambda: engine.queued_rows() == 0)
    big = await prepare(n=3)  # alone in the queue, a request bigger than the bound is admitted
    await chat.complete(big)


async def test_a_stream_never_read_gives_its_place_back(engine, tokenizer) -> None:
    chat = ChatService(engine, ServedModels("rlproxy"), tokenizer, max_queued_rows=1)
    stream = chat.stream(await chat.prepare(CallInfo(request(max_tokens=2, stream=True), "req")))
    with pytest.raises(OverloadedError):
        await chat.prepare(CallInfo(request(max_tokens=2), "req"))
    del stream  # the response was never sent (the client left first)
    gc.collect()
    assert chat._admissions.rows == 0
    await chat.complete(await chat.prepare(CallInfo(request(max_tokens=2), "req")))
