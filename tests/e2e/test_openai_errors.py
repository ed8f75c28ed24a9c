"""Errors as clients see them: the openai SDK's typed exceptions, and raw HTTP for bad bodies.

Every error has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a string
code; every response, success or error, carries an `x-request-id` header; a request that fails
because of its own content is a 4xx, never a 5xx (clients retry 5xx).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

HI = [{"role": "user", "content": "Hi"}]


def assert_openai_error(resp: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """The body is exactly OpenAI's error object; returns its inner `error`."""
    if status is not None:
        assert resp.status_code == status, resp.text
    assert resp.headers.get("x-request-id"), "error responses need an x-request-id"
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert isinstance(error["code"], str) and error["code"], error
    return error


def assert_sdk_error(
    exc: openai.APIStatusError, status: int, *, param: str | None = None, code: str | None = None
) -> None:
    assert exc.status_code == status
    assert exc.request_id, "the SDK reads x-request-id into exc.request_id"
    assert isinstance(exc.body, dict) and exc.body.get("message")
    assert isinstance(exc.code, str) and exc.code
    if param is not None:
        assert exc.param == param
    if code is not None:
        assert exc.code == code
    assert_openai_error(exc.response, status)


# ----------------------------------------------------------------------------- SDK exceptions


def test_top_logprobs_above_20(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="rlproxy", messages=HI, max_tokens=1, logprobs=True, top_logprobs=21
        )
    assert_sdk_error(info.value, 400, param="top_logprobs")


def test_stream_options_without_stream(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="rlproxy", messages=HI, max_tokens=1, stream_options={"include_usage": True}
        )
    assert_sdk_error(info.value, 400, param="stream_options")


def test_tool_choice_names_an_unknown_tool(client: OpenAI) -> None:
    tool = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="rlproxy",
            messages=HI,
            max_tokens=1,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "multiply"}},
        )
    assert_sdk_error(info.value, 400, param="tool_choice")


def test_n_too_large(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="rlproxy", messages=HI, max_tokens=1, n=100)
    assert_sdk_error(info.value, 400, param="n")


def test_json_schema_without_schema(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="rlproxy",
            messages=HI,
            max_tokens=1,
            response_format={"type": "json_schema", "json_schema": {"name": "answer"}},
        )
    assert_sdk_error(info.value, 400)
    assert info.value.param and info.value.param.startswith("response_format")


def test_unknown_model(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HI, max_tokens=1)
    assert_sdk_error(info.value, 404, code="model_not_found")


def test_unknown_model_retrieve(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert_sdk_error(info.value, 404, code="model_not_found")


def test_unloaded_adapter_version_is_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="rlproxy@999", messages=HI, max_tokens=1)
    assert_sdk_error(info.value, 404, code="model_not_found")


def test_prompt_over_the_context_window(client: OpenAI) -> None:
    long = " ".join(["word"] * 9000)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="rlproxy", messages=[{"role": "user", "content": long}], max_tokens=1
        )
    assert_sdk_error(info.value, 400, code="context_length_exceeded")


# ----------------------------------------------------------------------------- raw HTTP


@pytest.fixture(scope="module")
def http(server):  # server: conftest.Server
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_malformed_json_body(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/chat/completions",
        content=b'{"model": "rlproxy", "messages": [',
        headers={"content-type": "application/json"},
    )
    error = assert_openai_error(resp, 400)
    assert error["type"] == "invalid_request_error"


def test_unknown_route_is_an_openai_404(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/no-such-route"), 404)


def _chat(**fields: Any) -> dict[str, Any]:
    # max_tokens=1 so that a body the server wrongly accepts still answers at once.
    return {"model": "rlproxy", "messages": HI, "max_tokens": 1, **fields}


BAD_BODIES: dict[str, Any] = {
    "empty object": {},
    "no messages": {"model": "rlproxy"},
    "empty messages": _chat(messages=[]),
    "no model": {"messages": HI},
    "model not a string": _chat(model=123),
    "messages a string": _chat(messages="Hi"),
    "unknown role": _chat(messages=[{"role": "wizard", "content": "Hi"}]),
    "user without content": _chat(messages=[{"role": "user"}]),
    "content an int": _chat(messages=[{"role": "user", "content": 5}]),
    "image part": _chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
            }
        ]
    ),
    "tool message without tool_call_id": _chat(messages=[*HI, {"role": "tool", "content": "5"}]),
    "tool call arguments not a string": _chat(
        messages=[
            *HI,
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
                ],
            },
        ]
    ),
    "temperature 3": _chat(temperature=3),
    "top_p 0": _chat(top_p=0),
    "frequency_penalty 5": _chat(frequency_penalty=5),
    "max_tokens 0": _chat(max_tokens=0),
    "max_tokens a word": _chat(max_tokens="ten"),
    "n 0": _chat(n=0),
    "stop an int": _chat(stop=5),
    "seed a word": _chat(seed="abc"),
    "logit_bias a string": _chat(logit_bias="x"),
    "top_logprobs without logprobs": _chat(top_logprobs=2),
    "tool_choice without tools": _chat(tool_choice="required"),
    "tool_choice unknown word": _chat(
        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"
    ),
    "tool name with spaces": _chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
    "tool parameters a list": _chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}],
        tool_choice="required",
    ),
    "tool parameters not a schema": _chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
        tool_choice="required",
    ),
    "two tools with one name": _chat(
        tools=[
            {"type": "function", "function": {"name": "f"}},
            {"type": "function", "function": {"name": "f"}},
        ],
        tool_choice="required",
    ),
    "response_format xml": _chat(response_format={"type": "xml"}),
    "json_schema schema a string": _chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "x"}}
    ),
    "json_schema schema invalid": _chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    ),
    "stream_options without stream": _chat(stream_options={"include_usage": True}),
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_body_is_a_4xx_in_openai_shape(http: httpx.Client, body: Any) -> None:
    resp = http.post("/v1/chat/completions", json=body)
    assert 400 <= resp.status_code < 500, f"{resp.status_code}: {resp.text}"
    assert_openai_error(resp)


@pytest.mark.parametrize("body", [b"[1, 2]", b"null", b'"hi"', b""], ids=repr)
def test_non_object_json_body(http: httpx.Client, body: bytes) -> None:
    resp = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert 400 <= resp.status_code < 500, f"{resp.status_code}: {resp.text}"
    assert_openai_error(resp)


# ----------------------------------------------------------------------------- request ids


def test_every_response_has_a_request_id(http: httpx.Client) -> None:
    responses = [
        http.get("/health"),
        http.get("/v1/models"),
        http.get("/v1/models/gpt-4o-mini"),
        http.get("/v1/models/no-such-model"),
        http.get("/v1/no-such-route"),
        http.post("/v1/chat/completions", json=_chat()),
        http.post("/v1/chat/completions", json=_chat(n=100)),
        http.post(
            "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
        ),
        http.get("/rl/adapters"),
    ]
    with http.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as streamed:
        streamed.read()
        responses.append(streamed)
    ids = [r.headers.get("x-request-id") for r in responses]
    assert all(ids), list(zip([str(r.request.url) for r in responses], ids, strict=True))
    assert len(set(ids)) == len(ids)


def test_sdk_success_carries_the_request_id(client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="rlproxy", messages=HI, max_tokens=1
    )
    rid = raw.headers.get("x-request-id")
    assert rid
    completion = raw.parse()
    assert completion._request_id == rid


def test_a_client_that_disconnects_stops_its_generation(server) -> None:
    """Non-streamed: the server notices the closed connection and the rows leave the batch."""
    payload = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 2000,
        # Temperature 2 all but never samples the end token: the generation runs long.
        "temperature": 2.0,
        "seed": 1,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=3)
    assert running_rows_after(server, seconds=60) == 0


def test_a_streaming_client_that_disconnects_stops_its_generation(server) -> None:
    payload = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 2000,
        # Temperature 2 all but never samples the end token: the generation runs long.
        "temperature": 2.0,
        "seed": 1,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=payload, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    assert running_rows_after(server, seconds=60) == 0


def running_rows_after(server, seconds: float) -> int:
    """Poll /health until the engine has no running rows or `seconds` pass; return the count.

    2000 tokens take well over a minute here, so a generation that was not stopped shows."""
    deadline = time.monotonic() + seconds
    while True:
        rows = httpx.get(f"{server.url}/health", timeout=10).json()["engine"]["running_rows"]
        if rows == 0 or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


# ----------------------------------------------------------------------------- bad neighbours


def _post_chat(http: httpx.Client, **body: Any) -> httpx.Response:
    payload = {"model": "rlproxy", "messages": HI, "max_tokens": 6, **body}
    return http.post("/v1/chat/completions", json=payload)


@pytest.mark.parametrize(
    ("bad", "status"),
    [
        ({"temperature": 1e-45}, 200),  # the greedy distribution, not NaN
        ({"seed": 2**64}, 400),  # outside OpenAI's integer range: refused before the engine
        ({"seed": -(2**63) - 1}, 400),
        ({"seed": 2**63 - 1, "n": 2}, 200),  # row 1's seed is past 64 bits: still a seed
    ],
)
def test_a_bad_request_never_hurts_its_batch_neighbours(
    http: httpx.Client, pool, bad: dict[str, Any], status: int
) -> None:
    neighbours = [pool.submit(_post_chat, http, temperature=0.7, seed=i) for i in range(3)]
    odd = pool.submit(_post_chat, http, **bad)
    more = [pool.submit(_post_chat, http, temperature=0.7, seed=10 + i) for i in range(2)]
    response = odd.result(timeout=120)
    if status == 400:
        error = assert_openai_error(response, 400)
        assert error["param"] == "seed"
    else:
        assert response.status_code == 200, response.text
    for future in neighbours + more:
        answer = future.result(timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["engine"]["last_error"] is None


# ----------------------------------------------------------------------------- big bodies


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(http: httpx.Client) -> None:
    big = b'{"model": "rlproxy", "messages": [{"role": "user", "content": "' + b"x" * (9 * 2**20)
    error = assert_openai_error(http.post("/v1/chat/completions", content=big + b'"}]}'), 413)
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"

    def chunks():  # no content-length: the limit holds while the body streams in
        yield big[:1024]
        for _ in range(10):
            yield b"x" * 2**20
        yield b'"}]}'

    error = assert_openai_error(http.post("/v1/chat/completions", content=chunks()), 413)
    assert error["code"] == "request_too_large"
    assert http.get("/health").json()["status"] == "ok"


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(client: OpenAI) -> None:
    """A few megabytes of text would take seconds to tokenize, blocking the event loop."""
    huge = [{"role": "user", "content": "hello world " * 400_000}]  # 4.8 MB, under the limit
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="rlproxy", messages=huge, max_tokens=1)
    assert_sdk_error(info.value, 400, param="messages", code="context_length_exceeded")
    assert "more than" in info.value.message


# ----------------------------------------------------------------------------- odd input, 4xx


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (b'"messages": [{"role": "user", "content": "a\\ud800b"}]', "messages.0.content"),
        (b'"messages": [{"role": "user", "content": "hi"}], "user": "\\udfff"', "user"),
        (
            b'"messages": [{"role": "user", "content": "hi"}], "metadata": {"k": "\\ud800"}',
            "metadata.k",
        ),
        (b'"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]', "stop.0"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_before_any_work(
    http: httpx.Client, fields: bytes, param: str
) -> None:
    """Valid JSON, not Unicode text: refused before generation (it once failed the store after
    the whole generation, a 500). A valid pair (an emoji) is text and is served."""
    body = b'{"model": "rlproxy", "max_tokens": 2, ' + fields + b"}"
    error = assert_openai_error(
        http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        ),
        400,
    )
    assert error["param"] == param and "surrogate" in error["message"]
    pair = b'{"model": "rlproxy", "max_tokens": 2, "messages": [{"role": "user", "content": '
    pair += b'"\\ud83d\\ude00"}]}'
    ok = http.post(
        "/v1/chat/completions", content=pair, headers={"content-type": "application/json"}
    )
    assert ok.status_code == 200


@pytest.mark.parametrize("model", ["rlproxy@\u00b2", "rlproxy@" + "1" * 5000, "rlproxy@-1"])
def test_odd_version_suffixes_are_model_not_found(http: httpx.Client, model: str) -> None:
    chat = http.post("/v1/chat/completions", json={"model": model, "messages": HI})
    assert assert_openai_error(chat, 404)["code"] == "model_not_found"
    retrieve = http.get(f"/v1/models/{model}")
    assert assert_openai_error(retrieve, 404)["code"] == "model_not_found"


@pytest.mark.parametrize(
    "raw",
    [
        b'[1e999, "x"]',
        b"[" + b"9" * 400 + b', "x"]',
        b"[" * 5000 + b"]" * 5000,
        b"[1, 2]",
        b"x" * 600,
    ],
)
@pytest.mark.parametrize("route", ["/rl/trajectories", "/rl/groups"])
def test_a_forged_page_cursor_is_a_400(http: httpx.Client, route: str, raw: bytes) -> None:
    import base64

    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    error = assert_openai_error(http.get(route, params={"cursor": cursor}), 400)
    assert error["param"] == "cursor"


def test_a_wrong_method_is_a_405_that_says_which_are_allowed(http: httpx.Client) -> None:
    error = assert_openai_error(http.request("TRACE", "/health"), 405)
    assert error["code"] == "method_not_allowed"
    response = http.delete("/v1/chat/completions")
    assert response.status_code == 405 and "POST" in response.headers["allow"]
