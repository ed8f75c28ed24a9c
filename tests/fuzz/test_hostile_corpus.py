"""Every hostile request of the corpus (`tests/fuzz/hostile.py`), alone and all at once.

Alone: each entry is never a 5xx, and its answer has OpenAI's shape (an error object for a 4xx).
All at once: the whole corpus is sent concurrently beside innocent greedy completions from the
openai client; every innocent request gets exactly the answer it gets alone, and the server is
healthy afterwards. Entries with a `known_5xx` are strict xfails alone (they flip when fixed)
and are still sent in the storm, where only their neighbours are judged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.fuzz.hostile import CORPUS, INNOCENT_PROMPTS, Hostile, send

pytestmark = pytest.mark.fuzz


@pytest.fixture(scope="module")
def http(fuzz_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def openai_client(fuzz_server: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=fuzz_server.base_url, api_key="sk-fuzz", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def completion_id(http: httpx.Client) -> str:
    """A completion that exists, for the routes that take one (rewards)."""
    body = {"model": "rlproxy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def check_answer(entry: Hostile, response: httpx.Response) -> None:
    """Never a 5xx; the pinned status if any; OpenAI's shape either way."""
    assert response.status_code < 500, f"{entry.name}: {response.status_code} {response.text[:500]}"
    if entry.expect is not None:
        assert response.status_code in entry.expect, f"{entry.name}: {response.text[:500]}"
    assert response.headers.get("x-request-id"), entry.name
    anthropic = entry.path.startswith("/v1/messages")
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    if response.status_code >= 400 and anthropic:  # Anthropic's shape on its paths
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
    elif streamed and anthropic:
        assert response.text.rstrip().endswith('data: {"type":"message_stop"}'), entry.name
    elif streamed and entry.path.startswith("/v1/responses"):
        last = response.text.rstrip().rsplit("\n", 1)[-1]
        assert '"type":"response.completed"' in last or '"type":"response.incomplete"' in last
    elif streamed:
        assert response.text.rstrip().endswith("data: [DONE]"), f"{entry.name}: cut stream"
    elif entry.path == "/v1/chat/completions":
        assert response.json()["object"] == "chat.completion", response.text[:500]


def _param(entry: Hostile) -> Any:
    marks = []
    if entry.known_5xx:
        marks.append(pytest.mark.xfail(strict=True, reason=entry.known_5xx))
    return pytest.param(entry, id=entry.name, marks=marks)


@pytest.mark.parametrize("entry", [_param(h) for h in CORPUS])
def test_a_hostile_request_is_never_a_5xx(
    fuzz_server: Server, completion_id: str, entry: Hostile
) -> None:
    check_answer(entry, send(fuzz_server.url, entry, completion_id))


def innocent(client: OpenAI, prompt: str) -> tuple[str, float]:
    """One plain greedy completion (its text) and how long it took."""
    started = time.monotonic()
    completion = client.chat.completions.create(
        model="rlproxy",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length"), completion
    assert isinstance(choice.message.content, str)
    return choice.message.content, time.monotonic() - started


def test_hostile_requests_never_hurt_innocent_neighbours(
    fuzz_server: Server, http: httpx.Client, openai_client: OpenAI, completion_id: str
) -> None:
    alone = {p: innocent(openai_client, p)[0] for p in INNOCENT_PROMPTS}
    with (
        ThreadPoolExecutor(max_workers=16) as hostile_pool,
        ThreadPoolExecutor(max_workers=len(INNOCENT_PROMPTS)) as innocent_pool,
    ):
        hostile = [
            (h, hostile_pool.submit(send, fuzz_server.url, h, completion_id)) for h in CORPUS
        ]
        # The innocents go out while the corpus is in flight, twice over.
        beside = [innocent_pool.submit(innocent, openai_client, p) for p in INNOCENT_PROMPTS * 2]
        answers = [f.result(timeout=600) for f in beside]
        for entry, future in hostile:
            if entry.known_5xx:  # judged alone (a strict xfail); here only its neighbours are
                future.exception(timeout=600)
            else:
                check_answer(entry, future.result(timeout=600))
    for prompt, (text, _) in zip(INNOCENT_PROMPTS * 2, answers, strict=True):
        assert text == alone[prompt], (prompt, text, alone[prompt])
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["engine"]["last_error"] is None, health
    assert innocent(openai_client, INNOCENT_PROMPTS[0])[0] == alone[INNOCENT_PROMPTS[0]]
