"""The direct OpenAI-compatible path (`proxy.engines.openai_compat`) through a real rlproxy.

The openai SDK calls `rlproxy serve`, which forwards `openai/` targets over its own pooled httpx
client to the fake provider on loopback (tests/e2e/fake_openai.py, OpenAI's documented
protocol). A second name for the same provider is configured `via: litellm`, so the two paths
are compared on the same requests. Every call, failed ones included, must be stored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server, free_port
from tests.e2e.fake_openai import TEXT, FakeOpenAI, FakeOpenAIServer
from tests.e2e.helpers import db_rows, own_server

SERVER_KEY = "sk-direct-server-secret-0123456789"
CLAUDE_ALIAS = "claude-sonnet-4-5-20250929"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAIServer(free_port()) as fake:
        yield fake


@pytest.fixture(scope="module")
def direct_server(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, fake: FakeOpenAI
) -> Iterator[Server]:
    target = {"model": "openai/fake-model", "api_base": fake.base_url, "api_key_env": "DK"}
    models = {"direct": target, "via-litellm": {**target, "via": "litellm"}}
    env = {
        "RLPROXY_UPSTREAM_MODELS": json.dumps(models),
        "RLPROXY_UPSTREAM_TIMEOUT_S": "3",
        "RLPROXY_ALIASES": json.dumps([CLAUDE_ALIAS]),
        "DK": SERVER_KEY,
    }
    with own_server(tmp_path_factory.mktemp("direct-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def client(direct_server: Server) -> Iterator[OpenAI]:
    with OpenAI(
        base_url=direct_server.base_url, api_key="sk-client", max_retries=0, timeout=60
    ) as c:
        yield c


def _stored(server: Server, request_id: str) -> dict[str, Any]:
    rows = db_rows(server.data_dir, "SELECT * FROM calls WHERE request_id = ?", (request_id,))
    assert len(rows) == 1, f"{len(rows)} rows stored for {request_id}"
    return dict(rows[0])


def _ask(text: str) -> list[Any]:
    return [{"role": "user", "content": f"{text} {uuid.uuid4().hex}"}]


def test_non_streamed_is_forwarded_as_sent_and_stored(
    client: OpenAI, direct_server: Server, fake: FakeOpenAI
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    raw = client.chat.completions.with_raw_response.create(
        model="direct",
        messages=_ask("hello"),
        temperature=0.25,
        max_tokens=7,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        metadata={"trajectory_id": f"t-{uuid.uuid4().hex}"},
        extra_body={"rlproxy": {"group_id": "g"}, "not_an_openai_field": 1},
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == TEXT
    # No version of the policy served it: the answer names the upstream model, as asked.
    assert (completion.model, completion.system_fingerprint) == ("direct", "direct")
    assert "x-rlproxy-version" not in raw.headers
    assert completion.usage is not None and completion.usage.total_tokens == 10
    request_id = raw.headers["x-request-id"]
    assert completion.id == f"chatcmpl-{request_id}"

    sent = fake.seen[-1]
    assert sent.body["model"] == "fake-model"
    assert sent.body["temperature"] == 0.25 and sent.body["max_tokens"] == 7
    # The schema travels under its OpenAI name, not the Python attribute it is parsed into.
    assert sent.body["response_format"]["json_schema"]["schema"] == schema
    assert not {"metadata", "rlproxy", "not_an_openai_field", "stream"} & set(sent.body)
    assert sent.headers["authorization"] == f"Bearer {SERVER_KEY}"

    call = _stored(direct_server, request_id)
    assert call["engine"] == "upstream" and call["status"] == "completed"
    assert json.loads(call["response"])["choices"][0]["message"]["content"] == TEXT


def test_streamed_chunks_are_passed_through_and_stored(
    client: OpenAI, direct_server: Server, fake: FakeOpenAI
) -> None:
    for include_usage in (True, False):
        with client.chat.completions.with_streaming_response.create(
            model="direct",
            messages=_ask("stream"),
            stream=True,
            stream_options={"include_usage": include_usage},
        ) as raw:
            request_id = raw.headers["x-request-id"]
            chunks = list(raw.parse())
        assert fake.seen[-1].body["stream"] is True
        # rlproxy always asks the provider for usage (it stores it) ...
        assert fake.seen[-1].body["stream_options"] == {"include_usage": True}
        pieces = [c.choices[0].delta.content for c in chunks if c.choices]
        assert "".join(p or "" for p in pieces) == TEXT
        assert pieces[1:4] == ["Hello", " from", " fake"]  # one chunk per provider chunk
        assert chunks[-1 if not include_usage else -2].choices[0].finish_reason == "stop"
        # ... but forwards it only to a client that asked.
        assert (chunks[-1].usage is not None) is include_usage
        assert {c.id for c in chunks} == {f"chatcmpl-{request_id}"}
        call = _stored(direct_server, request_id)
        assert call["stream"] and call["status"] == "completed"
        assert json.loads(call["usage"])["total_tokens"] == 10
        assert json.loads(call["response"])["choices"][0]["message"]["content"] == TEXT


def test_direct_and_litellm_paths_answer_alike(client: OpenAI, fake: FakeOpenAI) -> None:
    client.chat.completions.create(model="direct", messages=_ask("which client"))
    assert fake.seen[-1].headers["user-agent"] == "rlproxy"  # the direct path, not litellm's SDK
    client.chat.completions.create(model="via-litellm", messages=_ask("which client"))
    assert fake.seen[-1].headers["user-agent"].startswith("AsyncOpenAI/")
    tools: Any = [
        {
            "type": "function",
            "function": {"name": "search", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    for kwargs in ({}, {"tools": tools}):
        direct = client.chat.completions.create(model="direct", messages=_ask("x"), **kwargs)
        lite = client.chat.completions.create(model="via-litellm", messages=_ask("x"), **kwargs)
        a, b = direct.model_dump(), lite.model_dump()
        for body in (a, b):  # what names the call and what served it (the name asked for)
            body.pop("id"), body.pop("created"), body.pop("model"), body.pop("system_fingerprint")
        assert a == b
        streamed = {}
        for model in ("direct", "via-litellm"):
            chunks = client.chat.completions.create(
                model=model, messages=_ask("s"), stream=True, **kwargs
            )
            streamed[model] = [c.choices[0].model_dump() for c in chunks if c.choices]
        assert streamed["direct"] == streamed["via-litellm"]


@pytest.mark.parametrize("stream", [False, True])
def test_provider_errors_keep_openai_shape_and_are_stored(
    client: OpenAI, direct_server: Server, stream: bool
) -> None:
    cases = [
        ("trigger-400", openai.BadRequestError, 400, "invalid_request_error", "invalid_value"),
        ("trigger-echo-key", openai.AuthenticationError, 401, "invalid_request_error", None),
        ("trigger-500", openai.InternalServerError, 502, "server_error", "upstream_error"),
        ("trigger-503", openai.InternalServerError, 503, "server_error", "upstream_error"),
        ("trigger-slow", openai.APIStatusError, 504, "server_error", "timeout"),
    ]
    for trigger, kind, status, type_, code in cases:
        with pytest.raises(kind) as info:
            client.chat.completions.create(model="direct", messages=_ask(trigger), stream=stream)
        err = info.value
        assert isinstance(err, openai.APIStatusError)
        assert err.status_code == status, trigger
        body = err.body
        assert isinstance(body, dict) and body["type"] == type_, (trigger, body)
        if code is not None:
            assert body["code"] == code, (trigger, body)
        assert SERVER_KEY not in json.dumps(body)
        request_id = err.response.headers["x-request-id"]
        call = _stored(direct_server, request_id)
        assert call["status"] == "error" and call["error"], trigger
        assert SERVER_KEY not in call["error"]


def test_error_after_the_first_chunk_ends_the_stream_and_is_stored(
    client: OpenAI, direct_server: Server
) -> None:
    with client.chat.completions.with_streaming_response.create(
        model="direct", messages=_ask("trigger-stream-error"), stream=True
    ) as raw:
        request_id = raw.headers["x-request-id"]
        assert raw.status_code == 200
        got = []
        with pytest.raises(openai.APIError, match="broke mid-stream"):
            for chunk in raw.parse():
                got.append(chunk)
    assert got and got[0].choices[0].delta.content == "Hello"
    call = _stored(direct_server, request_id)
    assert call["status"] == "error" and "broke mid-stream" in call["error"]
    choices = db_rows(
        direct_server.data_dir,
        "SELECT message FROM call_choices WHERE call_id = ?",
        (call["id"],),
    )
    assert json.loads(choices[0]["message"])["content"] == "Hello"  # what the client saw


SEARCH = {"type": "object", "properties": {"query": {"type": "string"}}}


def test_a_claude_name_can_alias_the_policy(direct_server: Server) -> None:
    """What Claude Code sends: its own model name, mapped to the policy by RLPROXY_ALIASES."""
    claude = anthropic.Anthropic(base_url=direct_server.url, api_key="sk-client", max_retries=0)
    message = claude.messages.create(model=CLAUDE_ALIAS, max_tokens=2, messages=_ask("hi"))
    assert message.model == "rlproxy@base"  # the version that served it, as for any alias
    (row,) = db_rows(
        direct_server.data_dir,
        "SELECT engine, model_requested FROM calls WHERE completion_id = ?",
        (message.id,),
    )
    assert (row["engine"], row["model_requested"]) == ("local", CLAUDE_ALIAS)


def test_the_other_protocols_reach_an_upstream_model(
    client: OpenAI, direct_server: Server, fake: FakeOpenAI
) -> None:
    """Responses and Messages requests for an upstream name go through the same upstream path
    (the provider is an OpenAI-compatible stand-in: no provider is reachable here), their
    answers translated back, their calls stored with engine "upstream" and their protocol."""
    response = client.responses.create(model="direct", input=_ask("hello"), max_output_tokens=7)
    assert response.output_text == TEXT and response.model == "direct"
    assert fake.seen[-1].body["max_tokens"] == 7
    with client.responses.stream(model="direct", input=_ask("stream")) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == TEXT

    claude = anthropic.Anthropic(base_url=direct_server.url, api_key="sk-client", max_retries=0)
    tools = [{"name": "search", "description": "Search.", "input_schema": SEARCH}]
    message = claude.messages.create(
        model="direct", max_tokens=9, messages=_ask("find"), tools=tools
    )
    [use] = message.content
    assert (use.type, use.name, use.input) == ("tool_use", "search", {"query": "x"})
    assert message.stop_reason == "tool_use"
    assert fake.seen[-1].body["tools"][0]["function"]["parameters"] == SEARCH
    with claude.messages.stream(model="direct", max_tokens=9, messages=_ask("s")) as events:
        assert "".join(events.text_stream) == TEXT

    rows = db_rows(
        direct_server.data_dir,
        "SELECT engine, protocol, completion_id FROM calls WHERE completion_id IN (?, ?, ?)",
        (response.id, streamed.id, message.id),
    )
    assert sorted((r["engine"], r["protocol"]) for r in rows) == [
        ("upstream", "messages"),
        ("upstream", "responses"),
        ("upstream", "responses"),
    ]
