"""Limits through a real server and real clients: every limit answers with OpenAI's 4xx before
any work, a 429 is `openai.RateLimitError` with `retry-after`, and what was admitted completes.

Two servers of this module's own (their settings are tiny limits) and the shared one for the
request-shape limits. Callers are told apart by their address: each test sends from its own
loopback address (127.0.0.2, ...), as a client on another machine would.
"""

from __future__ import annotations

import select
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import own_server
from tests.e2e.test_openai_errors import assert_openai_error

HI = [{"role": "user", "content": "Hi"}]
LONG_STORY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
    "max_tokens": 2000,
    # Temperature 2 all but never samples the end token: the generation runs until it is closed.
    "temperature": 2.0,
    "seed": 1,
}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, model_data_dir) -> Iterator[Server]:
    """Tiny limits, counted per client address (no keys): the opt-in address mode."""
    env = {
        "RLPROXY_CALLER_REQUESTS_PER_MINUTE": "3",
        "RLPROXY_CALLER_CONCURRENCY": "1",
        "RLPROXY_CALLER_ADDRESS_LIMITS": "true",
    }
    with own_server(tmp_path_factory.mktemp("limited"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, model_data_dir) -> Iterator[Server]:
    """One row decodes, one waits; a request head must be complete within a second."""
    env = {
        "RLPROXY_MAX_BATCH_SIZE": "1",
        "RLPROXY_MAX_QUEUED_ROWS": "1",
        "RLPROXY_HEADER_TIMEOUT_S": "1",
    }
    with own_server(tmp_path_factory.mktemp("small"), model_data_dir, env) as server:
        yield server


def client_at(server: Server, address: str) -> OpenAI:
    """An openai client whose connections come from `address` (one caller per address)."""
    http = httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=280)
    return OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, http_client=http)


def assert_429(exc: openai.RateLimitError, code: str) -> None:
    assert exc.status_code == 429 and exc.code == code, exc
    assert int(exc.response.headers["retry-after"]) >= 1
    error = assert_openai_error(exc.response, 429)
    assert error["type"] == "requests"


def eventually(check: Any, seconds: float = 60.0) -> bool:
    """Poll `check()` until it is true or `seconds` pass (the server notices in its own time)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# ----------------------------------------------------------------------------- per caller


def test_a_caller_over_its_rate_gets_a_rate_limit_error(limited: Server) -> None:
    client = client_at(limited, "127.0.0.2")
    for _ in range(3):  # the bucket holds a minute's worth: 3
        client.models.list()
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="rlproxy", messages=HI, max_tokens=1)
    assert_429(info.value, "rate_limit_exceeded")
    with pytest.raises(openai.RateLimitError):
        client.models.list()

    other = client_at(limited, "127.0.0.3")  # another caller keeps its own budget
    answer = other.chat.completions.create(model="rlproxy", messages=HI, max_tokens=1)
    assert answer.choices[0].finish_reason in ("stop", "length")
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as http:
        for _ in range(5):  # /health is never limited
            assert http.get(f"{limited.url}/health").json()["status"] == "ok"


def test_an_open_stream_holds_its_callers_concurrency_slot(limited: Server) -> None:
    client = client_at(limited, "127.0.0.4")
    stream = client.chat.completions.create(model="rlproxy", stream=True, **LONG_STORY)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.RateLimitError) as info:  # one in flight is this caller's limit
        client.chat.completions.create(model="rlproxy", messages=HI, max_tokens=1)
    assert_429(info.value, "rate_limit_exceeded")
    assert "in flight" in info.value.message
    other = client_at(limited, "127.0.0.5")
    assert other.models.list().data

    stream.close()  # the stream ends: once the server notices, the slot is free

    def served() -> bool:
        try:
            return bool(client.models.list().data)
        except openai.RateLimitError as exc:
            assert "in flight" in exc.message  # never the rate: refusals spend no token
            return False

    assert eventually(served)


def test_the_default_limits_never_refuse_a_batch_without_keys(server: Server) -> None:
    """The shared server has the default limits and no keys. One process on loopback sends
    1,500 requests in a row, as fast as they are answered (the old default, 600 a minute keyed
    by client address, refused the 601st), then 32 at once: every one is served."""
    statuses: Counter[int] = Counter()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for i in range(1500):
            if i % 100 == 0:
                body = {"model": "rlproxy", "messages": HI, "max_tokens": 1}
                statuses[http.post("/v1/chat/completions", json=body).status_code] += 1
            else:
                statuses[http.get("/v1/models").status_code] += 1
    with ThreadPoolExecutor(max_workers=32) as threads:
        burst = threads.map(lambda _: httpx.get(f"{server.base_url}/models").status_code, range(32))
        statuses.update(burst)
    assert statuses == {200: 1532}


# ----------------------------------------------------------------------------- engine queue


def _chat(server: Server, i: int) -> tuple[str, Any]:
    """One request of a burst: ("ok", its text and finish reason) or ("429", the error)."""
    client = OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=280)
    payload: dict[str, Any] = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
        "max_tokens": 32,
        "seed": i,
    }
    try:
        if i % 2:  # half of them streamed: a refusal is still an HTTP status, never a chunk
            text, reason = "", None
            for chunk in client.chat.completions.create(stream=True, **payload):
                assert chunk.choices, chunk
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            return "ok", (text, reason)
        answer = client.chat.completions.create(**payload)
        assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 32
        return "ok", (answer.choices[0].message.content, answer.choices[0].finish_reason)
    except openai.RateLimitError as exc:
        return "429", exc
    finally:
        client.close()


def test_a_full_queue_refuses_with_429_and_what_was_admitted_completes(
    small: Server, pool: ThreadPoolExecutor
) -> None:
    outcomes = list(pool.map(lambda i: _chat(small, i), range(16)))
    refused = [exc for kind, exc in outcomes if kind == "429"]
    served = [answer for kind, answer in outcomes if kind == "ok"]
    assert len(refused) + len(served) == 16  # nothing else: no 5xx, no broken stream
    assert refused, "one row decoding and one waiting: a burst of 16 must overflow the queue"
    assert len(served) >= 2
    for exc in refused:
        assert_429(exc, "server_overloaded")
    for text, reason in served:
        assert isinstance(text, str) and reason in ("stop", "length")
    health = httpx.get(f"{small.url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["engine"]["last_error"] is None


# ----------------------------------------------------------------------------- slowloris


def _closed_by_server(sock: socket.socket, dribble: bytes = b"", seconds: float = 30.0) -> bool:
    """Wait until the server closes `sock` (True), sending `dribble` a byte at a time meanwhile;
    False if it is still open after `seconds`."""
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.2)
        if readable:
            try:
                if sock.recv(4096) == b"":
                    return True
            except ConnectionResetError:
                return True
        if sent < len(dribble):
            try:
                sock.sendall(dribble[sent : sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return True
            sent += 1
    return False


def _connect(server: Server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def test_a_connection_that_never_completes_its_request_head_is_closed(small: Server) -> None:
    with _connect(small) as slow, _connect(small) as silent, _connect(small) as dribbling:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        # Meanwhile the server answers everyone else.
        assert httpx.get(f"{small.url}/health", timeout=30).json()["status"] == "ok"
        assert _closed_by_server(slow)
        assert _closed_by_server(silent)
        # A byte every 0.2 s does not keep the connection: the deadline is for the whole head.
        dribbling.sendall(b"GET /health HTTP/1.1\r\n")
        assert _closed_by_server(dribbling, dribble=b"X-Slow: " + b"a" * 1000)


def test_a_keep_alive_connection_is_timed_again_for_its_next_request(small: Server) -> None:
    with _connect(small) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        conn.sendall(b"\r\n")  # a head in two pieces, complete in time: served
        response = conn.recv(65536)
        assert response.startswith(b"HTTP/1.1 200"), response
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 1")  # the next head never completes
        assert _closed_by_server(conn)


# ----------------------------------------------------------------------------- request shape


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


SHAPES: dict[str, tuple[dict[str, Any], str, str]] = {
    "five stop strings": ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
    "129 tools": (
        {"tools": [_tool(f"t{i}") for i in range(129)]},
        "tools",
        "array_above_max_length",
    ),
    "2049 messages": ({"messages": HI * 2049}, "messages", "array_above_max_length"),
    "tool parameters 300 objects deep": (
        {"tools": [_tool("f", _nested(300))], "tool_choice": "required"},
        "tools[0].function.parameters",
        "invalid_value",
    ),
    "response_format schema 300 objects deep": (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": _nested(300)}}},
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    "response_format schema of 12,000 values": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "schema": {
                        "type": "object",
                        "properties": {f"p{i}": {"type": "string"} for i in range(6000)},
                    }
                },
            }
        },
        "response_format",
        "invalid_value",
    ),
}


@pytest.mark.parametrize(("fields", "param", "code"), SHAPES.values(), ids=SHAPES.keys())
def test_a_request_over_a_shape_limit_is_a_400(
    http: httpx.Client, fields: dict[str, Any], param: str, code: str
) -> None:
    body = {"model": "rlproxy", "messages": HI, "max_tokens": 1, **fields}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param and error["code"] == code, error


STRICT: dict[str, dict[str, Any]] = {
    "max_tokens a numeric string": {"max_tokens": "5"},
    "max_tokens a float": {"max_tokens": 5.0},
    "max_completion_tokens a numeric string": {"max_completion_tokens": "5"},
    "n a numeric string": {"n": "1"},
    "seed a numeric string": {"seed": "7"},
    "top_logprobs a numeric string": {"logprobs": True, "top_logprobs": "2"},
    "temperature a numeric string": {"temperature": "0.5"},
    "top_p a numeric string": {"top_p": "1"},
}


@pytest.mark.parametrize("fields", STRICT.values(), ids=STRICT.keys())
def test_numbers_are_not_coerced(http: httpx.Client, fields: dict[str, Any]) -> None:
    body = {"model": "rlproxy", "messages": HI, "max_tokens": 1, **fields}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == next(k for k in fields if k != "logprobs")


def test_a_json_integer_is_a_number(http: httpx.Client) -> None:
    body = {"model": "rlproxy", "messages": HI, "max_tokens": 1, "temperature": 0, "top_p": 1}
    response = http.post("/v1/chat/completions", json=body)  # sent as `0` and `1`, not floats
    assert response.status_code == 200, response.text
