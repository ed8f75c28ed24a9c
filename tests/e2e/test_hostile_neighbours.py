"""The quick part of the hostile corpus (`tests/fuzz/hostile.py`), in the default suite.

Every quick entry (refused before the model, or a sampling edge) is sent at once beside innocent
greedy completions from the openai client: no entry is a 5xx and each pinned status holds, each
innocent request gets exactly the answer it gets alone, and the server is healthy afterwards.
The whole corpus, alone and together, and schemathesis run in `make test-fuzz`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.fuzz.hostile import INNOCENT_PROMPTS, QUICK, send


def _greedy(client: OpenAI, prompt: str) -> str:
    completion = client.chat.completions.create(
        model="rlproxy", messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0
    )
    assert completion.choices[0].finish_reason in ("stop", "length"), completion
    return completion.choices[0].message.content or ""


def test_quick_hostile_requests_are_4xx_or_served_and_hurt_no_neighbour(
    server: Server, client: OpenAI
) -> None:
    prompts = INNOCENT_PROMPTS[:2]
    alone = {p: _greedy(client, p) for p in prompts}
    created = client.chat.completions.create(
        model="rlproxy", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    with (
        ThreadPoolExecutor(max_workers=12) as hostile_pool,
        ThreadPoolExecutor(max_workers=len(prompts)) as innocent_pool,
    ):
        hostile = [(h, hostile_pool.submit(send, server.url, h, created.id)) for h in QUICK]
        beside = {p: innocent_pool.submit(_greedy, client, p) for p in prompts}
        together = {p: f.result(timeout=300) for p, f in beside.items()}
        for entry, future in hostile:
            response = future.result(timeout=300)
            assert response.status_code < 500, f"{entry.name}: {response.text[:300]}"
            if entry.expect is not None:
                assert response.status_code in entry.expect, f"{entry.name}: {response.text[:300]}"
    assert together == alone
    health = httpx.get(f"{server.url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["engine"]["last_error"] is None, health
