"""rlproxy with `RLPROXY_ENGINE=vllm` in front of a vLLM-protocol server: what is stored, and
what is never forwarded.

The replicas (`tests/fakes/vllm_server.py`) generate with the real embedded model and write every
completion they finish to a file; a call's stored prompt ids, completion ids and logprobs must be
exactly one of those. vLLM's admin routes must not be reachable through rlproxy.
One replica keeps this module cheap; routing between replicas, versions, dead replicas and
the client suites are in test_vllm_clients.py (slow, two replicas), the replica rules in
test_vllm_replicas.py (slow; the real-vLLM suite runs them in CI), and the engine's rules
against vLLM-shaped handlers in tests/proxy/test_vllm_engine.py and test_vllm_routing.py (the
default run's share of the vllm engine).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, stored_prompts
from tests.fakes.stack import FakeReplica, vllm_stack


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[tuple[Server, list[FakeReplica]]]:
    with vllm_stack(tmp_path_factory.mktemp("vllm-serving"), model_data_dir, replicas=1) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(stack: tuple[Server, list[FakeReplica]]) -> Iterator[OpenAI]:
    with OpenAI(base_url=stack[0].base_url, api_key="sk-test", max_retries=0, timeout=280) as c:
        yield c


def _stored(server: Server, trajectory: str) -> list[dict[str, Any]]:
    rows = db_rows(
        server.data_dir,
        "SELECT c.id, c.status, c.engine, c.stream, ch.choice_index, "
        "ch.completion_token_ids, ch.completion_logprobs FROM calls c "
        "JOIN call_choices ch ON ch.call_id = c.id WHERE c.trajectory_id = "
        "(SELECT trajectory_id FROM calls WHERE explicit_trajectory_id = ? LIMIT 1) "
        "ORDER BY c.recorded_at, ch.choice_index",
        (trajectory,),
    )
    prompts = stored_prompts(server.data_dir, [r["id"] for r in rows])
    return [
        {
            **dict(r),
            "prompt_token_ids": prompts[r["id"]].token_ids,
            "completion_token_ids": json.loads(r["completion_token_ids"]),
            "completion_logprobs": json.loads(r["completion_logprobs"]),
        }
        for r in rows
    ]


def test_stored_ids_and_logprobs_are_what_a_replica_generated(
    stack: tuple[Server, list[FakeReplica]], client: OpenAI
) -> None:
    server, replicas = stack
    trajectory = "vllm-ids-1"
    headers = {"X-RLProxy-Trajectory": trajectory}
    messages = [{"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(
        model="rlproxy", messages=messages, max_tokens=8, n=2, extra_headers=headers
    )
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}]
    messages += [{"role": "user", "content": "And three animals?"}]
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="rlproxy", messages=messages, max_tokens=8, stream=True, extra_headers=headers
        )
        if chunk.choices
    )
    assert streamed

    stored = _stored(server, trajectory)
    assert [(s["stream"], s["choice_index"]) for s in stored] == [(0, 0), (0, 1), (1, 0)]
    assert all(s["status"] == "completed" for s in stored)
    assert {s["engine"] for s in stored} == {"vllm"}  # the stats count it as the policy's
    generated = [
        (c["prompt_token_ids"], choice["token_ids"], choice["token_logprobs"])
        for r in replicas
        for c in r.completions()
        for choice in c["choices"]
    ]
    for s in stored:
        same = [
            g
            for g in generated
            if g[0] == s["prompt_token_ids"] and g[1] == s["completion_token_ids"]
        ]
        assert same, "a stored call's ids are not what any replica generated"
        assert s["completion_logprobs"] == pytest.approx(same[0][2], abs=1e-6)
        assert len(s["completion_logprobs"]) == len(s["completion_token_ids"]) > 0
    # The second turn's prompt holds the first answer's tokens as the replica sampled them.
    tokenizer_free_prefix = stored[0]["prompt_token_ids"]
    assert stored[2]["prompt_token_ids"][: len(tokenizer_free_prefix)] == tokenizer_free_prefix


def test_logprobs_taken_under_a_grammar_are_flagged(
    client: OpenAI, stack: tuple[Server, list[FakeReplica]]
) -> None:
    """vLLM takes logprobs after a grammar's mask: such a call says so in its stored params, and
    the trainer does not use them as its ratio's reference (trainer `masked_logprobs`)."""
    server, _ = stack
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    for trajectory, extra in (
        ("vllm-grammar", {"tools": [tool], "tool_choice": "required"}),
        ("vllm-free", {}),
    ):
        client.chat.completions.create(
            model="rlproxy",
            messages=ask,
            max_tokens=24,
            temperature=0,
            extra_headers={"X-RLProxy-Trajectory": trajectory},
            **extra,
        )
    rows = db_rows(
        server.data_dir,
        "SELECT explicit_trajectory_id AS t, params FROM calls "
        "WHERE explicit_trajectory_id IN ('vllm-grammar', 'vllm-free')",
    )
    flags = {r["t"]: json.loads(r["params"]).get("logprobs_after_grammar") for r in rows}
    assert flags == {"vllm-grammar": True, "vllm-free": None}


@pytest.mark.parametrize(
    "path",
    [
        "/sleep",
        "/wake_up",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/completions",
    ],
)
def test_vllm_admin_routes_are_not_reachable(
    stack: tuple[Server, list[FakeReplica]], path: str
) -> None:
    server, replicas = stack
    body = {"lora_name": "evil", "lora_path": "/tmp", "prompt": [1, 2], "method": "x"}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code in (404, 405), r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    for replica in replicas:
        assert replica.admin_calls() == []
        models = httpx.get(f"{replica.url}/v1/models", timeout=30).json()["data"]
        assert "evil" not in [m["id"] for m in models]


def test_health_lists_the_replicas(stack: tuple[Server, list[FakeReplica]]) -> None:
    server, replicas = stack
    body = httpx.get(f"{server.url}/health", timeout=30).json()
    assert body["status"] == "ok"
    detail = body["engine"]
    assert detail["engine"] == "vllm"
    assert [(r["url"], r["healthy"]) for r in detail["replicas"]] == [
        (r.url, True) for r in replicas
    ]
