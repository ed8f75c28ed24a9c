"""Credential scrubbing (`proxy.redact`): the patterns, the server's own key values, log records
of every kind, provider errors, and what the store writes.

The end-to-end proof (a real server, a provider that echoes the key, grep of the database and the
logs) is tests/e2e/test_secret_scrubbing.py.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from proxy.engines.upstream import UpstreamEngine, to_api_error
from proxy.redact import MARK, Redactor, install_log_redaction
from proxy.settings import Settings, UpstreamTarget
from storage import CallRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome

SERVER_KEY = "provider-key-7f3a9c2e"  # no recognisable shape: only the exact value can catch it


@pytest.mark.parametrize(
    "text",
    [
        "Incorrect API key provided: sk-proj-4fGh7Jk9Lm2Np5Qr8St1. You can find your key...",
        "Incorrect API key provided: sk-ant-api03-abcdefgh12345678",
        "request headers: {'Authorization': 'Bearer abcdefgh12345678'}",
        'the body was {"api_key": "abcdefgh"}',
        "https://provider/v1?api_key=abcdefgh&x=1",
        "Authorization: Basic dXNlcjpwYXNzd29yZA==",
        "password=hunter2!",
        "github token ghp_0123456789abcdefghijklmnopqrstuvwxyzAB",
        "aws AKIAIOSFODNN7EXAMPLE in the config",
        "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789",
        "session eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36",
        "hex secret 0123456789abcdef0123456789abcdef0123456789abcdef end",
        "base64 secret Zm9vYmFyYmF6cXV4UXV1eDEyMzQ1Njc4OTBhYmNkZWZnaGlq end",
    ],
)
def test_credential_shapes_are_scrubbed(text: str) -> None:
    out = Redactor()(text)
    assert MARK in out
    secret = text.split()[-2] if text.endswith(" end") else None
    if secret is not None:
        assert secret not in out


@pytest.mark.parametrize(
    "text",
    [
        "trajectory 0123456789abcdef0123456789abcdef closed",  # a uuid4 hex is an id, not a key
        "chatcmpl-req_0123456789abcdef0123456789abcdef",
        "/tmp/pytest-of-root/pytest-3/test_disk0/HuggingFaceTB/SmolLM2-135M-Instruct/model.gguf",
        "the token sequence was long; Basic functionality; max_tokens=16 prompt_tokens: 7",
        "ix_trajectories_status_created_at_id RLPROXY_UPSTREAM_MODELS",
    ],
)
def test_ids_paths_and_prose_are_left_alone(text: str) -> None:
    assert Redactor()(text) == text


def test_the_servers_own_key_values_are_scrubbed_whatever_their_shape() -> None:
    env = {"TK": SERVER_KEY, "ANTHROPIC_API_KEY": "another-secret-value", "HOME": "/root/home"}
    redact = Redactor.from_environ(["TK"], env)
    text = f"echo: {SERVER_KEY} and another-secret-value in /root/home"
    assert redact(text) == f"echo: {MARK} and {MARK} in /root/home"
    # Named like a key holder or named by the settings; too short a value is never a secret.
    assert Redactor.from_environ([], {"X_TOKEN": "short"}).secrets == []


def test_for_settings_covers_upstream_judge_and_database_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MY_UPSTREAM", SERVER_KEY)
    monkeypatch.setenv("MY_JUDGE", "judge-key-31415926")
    settings = Settings(
        upstream_models={"teacher": {"model": "openai/x", "api_key_env": "MY_UPSTREAM"}},
        judge={"api_key_env": "MY_JUDGE"},
        database_url="postgresql+asyncpg://rl:db-pass-2718@127.0.0.1/test",
    )
    redact = Redactor.for_settings(settings)
    assert redact(f"{SERVER_KEY} judge-key-31415926 db-pass-2718") == f"{MARK} {MARK} {MARK}"


def _status_error(status: int, body: dict[str, object]) -> Exception:
    request = httpx.Request("POST", "http://provider/v1/chat/completions")
    response = httpx.Response(status, request=request, json={"error": body})
    return openai.AuthenticationError(str(body), response=response, body=body)


def test_a_provider_echoing_the_key_never_reaches_the_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TK", SERVER_KEY)
    engine = UpstreamEngine({"teacher": UpstreamTarget(model="openai/x", api_key_env="TK")})
    echo = {
        "message": f"Incorrect API key provided: Bearer {SERVER_KEY}",
        "type": "invalid_request_error",
        "param": SERVER_KEY,
        "code": f"bad_key_{SERVER_KEY}",
    }
    err = engine.api_error(_status_error(401, echo))
    assert err.status_code == 401
    assert SERVER_KEY not in str(err.body())
    # Without the server's values the shapes still go: a `Bearer` token, an sk- key.
    shaped = to_api_error(_status_error(401, {"message": "key sk-abcdefgh12345678 refused"}))
    assert "sk-abcdefgh12345678" not in shaped.message


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """A handler on the root logger and the record factory installed, both undone afterwards."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger()
    factory = logging.getLogRecordFactory()
    root.addHandler(handler)
    install_log_redaction(Redactor([SERVER_KEY]))
    try:
        yield stream
    finally:
        logging.setLogRecordFactory(factory)
        root.removeHandler(handler)


def test_log_records_are_scrubbed_in_message_args_and_traceback(log_stream: io.StringIO) -> None:
    log = logging.getLogger("tests.redact")
    log.warning(f"inline {SERVER_KEY}")
    log.warning("as an argument %s (%d)", SERVER_KEY, 3)

    class Holder:
        def __str__(self) -> str:
            return f"object holding {SERVER_KEY}"

    log.warning("as an object %s", Holder())
    log.warning("as a mapping %(k)s", {"k": SERVER_KEY})
    try:
        raise RuntimeError(f"provider said: {SERVER_KEY}")
    except RuntimeError:
        log.exception("a traceback")
    out = log_stream.getvalue()
    assert SERVER_KEY not in out
    assert out.count(MARK) == 5  # four messages, and the exception's text in the traceback
    assert "as an argument [REDACTED] (3)" in out


def test_uvicorn_style_access_records_keep_their_arguments(log_stream: io.StringIO) -> None:
    # uvicorn's access formatter unpacks record.args: scrubbing must keep the tuple's shape.
    captured: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(record)

    log = logging.getLogger("tests.redact.access")
    handler = Keep()
    log.addHandler(handler)
    try:
        log.warning(
            '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", f"/x?api_key={SERVER_KEY}", "1.1", 200
        )
    finally:
        log.removeHandler(handler)
    (record,) = captured
    assert isinstance(record.args, tuple) and len(record.args) == 5
    assert record.args[4] == 200 and SERVER_KEY not in record.getMessage()


async def test_the_store_scrubs_error_texts_params_and_judge_failures(tmp_path: Path) -> None:
    store = await Store.open(
        f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}", redact=Redactor([SERVER_KEY])
    )
    try:
        now = time.time()
        calls = []
        for i in range(2):
            record = CallRecord(
                id=f"c{i}",
                created_at=now,
                finished_at=now,
                model_requested="teacher",
                engine="upstream",
                request_messages=[{"role": "user", "content": "same task"}],
                params={"user": SERVER_KEY, "metadata": {"note": f"key={SERVER_KEY}"}},
                status="error",
                error=f"The upstream provider failed: {SERVER_KEY}",
            )
            calls.append(await store.record_call(record))
            await store.end_trajectory(calls[-1])
        (gid,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
        assert await store.claim_group(gid) == gid
        failure = f"judge answered HTTP 401: Incorrect API key provided: {SERVER_KEY}"
        await store.finish_scoring(
            gid, JudgeOutcome(status="failed", scores=[], judge_model="j", failure=failure)
        )
    finally:
        await store.close()
    for path in tmp_path.iterdir():  # the database, its WAL and shared memory
        assert SERVER_KEY.encode() not in path.read_bytes(), path.name
