"""The upstream engine against a fake OpenAI-compatible provider, through a real rlproxy.

The fake (tests/e2e/fake_openai.py) follows OpenAI's documented Chat Completions protocol. The
server is configured with `RLPROXY_UPSTREAM_MODELS`; its provider key is in the server's own
environment, and the client sends a different key that must never reach the provider.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, InternalServerError, OpenAI

from tests.e2e.conftest import Server, free_port
from tests.e2e.fake_openai import TEXT, FakeOpenAI, FakeOpenAIServer
from tests.e2e.helpers import calls_of, get_trajectory, own_server

SERVER_KEY = "sk-server-side-secret"
CLIENT_KEY = "sk-client-key"
NOTE = "provider returned no token ids"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAIServer(free_port()) as fake:
        yield fake


@pytest.fixture(scope="module")
def upstream_server(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, fake: FakeOpenAI
) -> Iterator[Server]:
    models = {
        "teacher": {"model": "openai/fake-model", "api_base": fake.base_url, "api_key_env": "TK"},
        "down": {
            "model": "openai/fake-model",
            "api_base": f"http://127.0.0.1:{free_port()}/v1",  # nothing listens there
            "api_key_env": "TK",
        },
    }
    env = {"RLPROXY_UPSTREAM_MODELS": json.dumps(models), "TK": SERVER_KEY}
    with own_server(tmp_path_factory.mktemp("upstream-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def client(upstream_server: Server) -> Iterator[OpenAI]:
    with OpenAI(
        base_url=upstream_server.base_url, api_key=CLIENT_KEY, max_retries=0, timeout=120
    ) as c:
        yield c


def _trajectory_of(server: Server, request_id: str) -> str:
    r = httpx.get(f"{server.url}/rl/trajectories", params={"model": "teacher", "limit": 500})
    for item in r.json()["data"]:
        detail = get_trajectory(server, item["id"])
        for call in calls_of(server.data_dir, detail["id"]):
            if call["request_id"] == request_id:
                return detail["id"]
    raise AssertionError(f"no trajectory holds request {request_id}")


def test_models_lists_upstream_names(client: OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert "teacher" in ids and "down" in ids and "rlproxy" in ids
    assert client.models.retrieve("teacher").owned_by == "upstream"


def test_non_streamed_call_is_forwarded_and_stored(
    client: OpenAI, upstream_server: Server, fake: FakeOpenAI
) -> None:
    before = len(fake.seen)
    question = f"hello {uuid.uuid4().hex}"
    raw = client.chat.completions.with_raw_response.create(
        model="teacher", messages=[{"role": "user", "content": question}], temperature=0.5
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == TEXT
    assert completion.model == "teacher"
    assert completion.usage is not None and completion.usage.total_tokens == 10
    seen = fake.seen[before:]
    assert len(seen) == 1
    assert seen[0].body["model"] == "fake-model"
    assert seen[0].body["temperature"] == 0.5
    assert seen[0].headers["authorization"] == f"Bearer {SERVER_KEY}"
    assert CLIENT_KEY not in json.dumps(seen[0].headers)

    request_id = raw.headers["x-request-id"]
    calls = calls_of(upstream_server.data_dir, _trajectory_of(upstream_server, request_id))
    call = next(c for c in calls if c["request_id"] == request_id)
    assert call["engine"] == "upstream"
    assert call["status"] == "completed"
    assert call["token_ids_note"] == NOTE
    assert call["prompt_token_ids"] is None
    assert call["choices"][0]["completion_token_ids"] is None
    assert json.loads(call["choices"][0]["message"])["content"] == TEXT
    assert call["api_key_id"] and CLIENT_KEY not in call["api_key_id"]


def test_streamed_call_is_forwarded_and_stored(
    client: OpenAI, upstream_server: Server, fake: FakeOpenAI
) -> None:
    question = f"stream {uuid.uuid4().hex}"
    with client.chat.completions.with_streaming_response.create(
        model="teacher",
        messages=[{"role": "user", "content": question}],
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        request_id = raw.headers["x-request-id"]
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert {c.id for c in chunks} == {f"chatcmpl-{request_id}"}
    assert fake.seen[-1].headers["authorization"] == f"Bearer {SERVER_KEY}"

    calls = calls_of(upstream_server.data_dir, _trajectory_of(upstream_server, request_id))
    call = next(c for c in calls if c["request_id"] == request_id)
    assert call["engine"] == "upstream" and call["stream"]
    assert call["status"] == "completed"
    assert call["token_ids_note"] == NOTE
    assert json.loads(call["choices"][0]["message"])["content"] == TEXT
    assert json.loads(call["response"])["choices"][0]["message"]["content"] == TEXT


def test_streamed_tool_call_is_reassembled(client: OpenAI, upstream_server: Server) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "search",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            },
        }
    ]
    chunks = list(
        client.chat.completions.create(
            model="teacher",
            messages=[{"role": "user", "content": f"find {uuid.uuid4().hex}"}],
            tools=tools,  # type: ignore[arg-type]
            stream=True,
        )
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert calls[0].id == "call_fake_1" and calls[0].function.name == "search"
    assert "".join(tc.function.arguments or "" for tc in calls) == '{"query": "x"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_provider_400_is_a_400(client: OpenAI, upstream_server: Server) -> None:
    for stream in (False, True):
        with pytest.raises(BadRequestError) as info:
            client.chat.completions.create(
                model="teacher",
                messages=[{"role": "user", "content": "please trigger-400"}],
                stream=stream,
            )
        assert info.value.status_code == 400
        body = info.value.body
        assert isinstance(body, dict)
        assert body["code"] == "invalid_value" and body["param"] == "messages"
        assert "trigger-400" in body["message"]


def test_unreachable_provider_is_a_502(client: OpenAI) -> None:
    with pytest.raises(InternalServerError) as info:
        client.chat.completions.create(model="down", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 502
    assert isinstance(info.value.body, dict)
    assert info.value.body["type"] == "server_error"
    assert info.value.body["code"] == "upstream_unreachable"


def test_local_model_still_served(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model="rlproxy", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content is not None
