"""The server's provider key never leaves the server: not to a client, the database or a log.

One key is planted three ways: in the server's environment (the upstream key variable, so the
server sends it to the provider), in request body fields a client sent (a stored one, `user` and
`metadata`, and an unknown one, `api_key`), and in the provider's answer (the fake provider,
tests/e2e/fake_openai.py, echoes the `Authorization` header it got in a 401). The server runs
with DEBUG logging, so every library logs what it can. Afterwards the SQLite files (database,
WAL, shared memory), every log file in the data directory and the server's captured output hold
the key zero times, and so do the errors the clients got.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server, free_port
from tests.e2e.fake_openai import FakeOpenAI, FakeOpenAIServer
from tests.e2e.helpers import own_server

KEY = f"sk-proj-{uuid.uuid4().hex}{uuid.uuid4().hex[:12]}"
ECHO = "trigger-echo-key"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAIServer(free_port()) as fake:
        yield fake


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, fake: FakeOpenAI
) -> Iterator[Server]:
    models = {
        "teacher": {"model": "openai/fake-model", "api_base": fake.base_url, "api_key_env": "TK"}
    }
    env = {
        "RLPROXY_UPSTREAM_MODELS": json.dumps(models),
        "TK": KEY,
        "RLPROXY_LOG_LEVEL": "DEBUG",
    }
    with own_server(tmp_path_factory.mktemp("scrub-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=server.base_url, api_key="sk-client-key", max_retries=0, timeout=120) as c:
        yield c


def _echo(content: str = "hello") -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{ECHO} {content}"}]


def test_the_provider_received_the_key_it_echoes(client: OpenAI, fake: FakeOpenAI) -> None:
    """The premise: the server really sends KEY upstream, and the fake really echoes it."""
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="teacher", messages=_echo())
    assert fake.seen[-1].headers["authorization"] == f"Bearer {KEY}"


def test_an_echoed_key_never_reaches_the_client(client: OpenAI) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(model="teacher", messages=_echo("plain"))
    error = refused.value
    assert error.status_code == 401
    assert KEY not in str(error.body) and KEY not in error.message
    assert "Incorrect API key provided: Bearer [REDACTED]" in str(error.body)
    # Streamed: the provider fails before the first chunk, so it is an HTTP error too.
    with pytest.raises(openai.AuthenticationError) as streamed:
        client.chat.completions.create(model="teacher", messages=_echo("stream"), stream=True)
    assert KEY not in str(streamed.value.body)


def test_a_key_in_request_fields_is_not_stored(client: OpenAI, server: Server) -> None:
    fields = {"user": KEY, "metadata": {"note": f"my key is {KEY}"}, "api_key": KEY}
    for model in ("teacher", "rlproxy"):
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            extra_body=fields,
        )
        assert answer.choices
    # The body fields went through the server's own error path too: an echo with them set.
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="teacher", messages=_echo(), extra_body=fields)


def test_nothing_on_disk_or_in_the_logs_holds_the_key(server: Server) -> None:
    """Last in this module: every request above has been recorded and logged by now."""
    r = httpx.get(f"{server.url}/rl/trajectories", params={"limit": 500}, timeout=60)
    assert KEY not in r.text
    files = [p for p in server.data_dir.rglob("*") if p.is_file() and "models" not in p.parts]
    names = {p.name for p in files}
    assert {"rlproxy.db", "server.log"} <= names, names
    leaks = [p.name for p in files if KEY.encode() in p.read_bytes()]
    assert leaks == []
    log = server.log.read_text()
    assert "[REDACTED]" in log  # the key was there to scrub: DEBUG logging saw the provider error
    stored = server.data_dir / "rlproxy.db"
    assert stored.stat().st_size > 0
