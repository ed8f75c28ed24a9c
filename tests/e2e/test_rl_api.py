"""The /rl trajectory API and `rlproxy export`, against a real server and its SQLite file.

The module's server closes idle trajectories after a short timeout (20 s) so that idle closing
is seen too; the other tests act on a trajectory right after creating it. Trajectories are made
with explicit ids and a per-test group key, so each test sees only its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import get_trajectory, list_trajectories, own_server

IDLE_TIMEOUT_S = 20
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rl_server(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {"RLPROXY_TRAJECTORY_IDLE_TIMEOUT_S": str(IDLE_TIMEOUT_S)}
    with own_server(tmp_path_factory.mktemp("rl-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def client(rl_server: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=rl_server.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        yield c


def _call(
    client: OpenAI,
    trajectory_id: str | None,
    group: str | None = None,
    model: str = "rlproxy",
    content: str = "Say yes.",
    **kw: Any,
) -> Any:
    headers = {}
    if trajectory_id:
        headers["X-RLProxy-Trajectory"] = trajectory_id
    if group:
        headers["X-RLProxy-Group"] = group
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=kw.pop("max_tokens", 2),
        temperature=0,
        extra_headers=headers,
        **kw,
    )


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _assert_error(response: httpx.Response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code


def test_paging_and_filters(rl_server: Server, client: OpenAI) -> None:
    group = _new_id("group")
    ids = [_new_id("page") for _ in range(5)]
    models = ["rlproxy", "rlproxy", "rlproxy", "gpt-4o-mini", "gpt-4o-mini"]
    before = time.time() - 1
    with ThreadPoolExecutor(5) as pool:
        list(pool.map(lambda a: _call(client, a[0], group, a[1]), zip(ids, models, strict=True)))
    after = time.time() + 1

    seen: list[dict[str, Any]] = []
    cursor, pages = None, 0
    while True:
        params: dict[str, Any] = {"group_key": group, "limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = httpx.get(f"{rl_server.url}/rl/trajectories", params=params).json()
        assert page["object"] == "list" and len(page["data"]) <= 2
        seen += page["data"]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert sorted(t["id"] for t in seen) == sorted(ids)
    assert all(t["group_key"] == group and t["explicit"] for t in seen)
    created = [t["created_at"] for t in seen]
    assert created == sorted(created, reverse=True), "newest first"

    mini = list_trajectories(rl_server, group_key=group, model="gpt-4o-mini")
    assert sorted(t["id"] for t in mini) == sorted(ids[3:])
    assert len(list_trajectories(rl_server, group_key=group, since=before, until=after)) == 5
    assert list_trajectories(rl_server, group_key=group, until=before) == []
    assert list_trajectories(rl_server, group_key=group, since=after) == []
    open_ones = list_trajectories(rl_server, status="open")
    assert all(t["status"] == "open" for t in open_ones)


def test_detail_has_turns_in_order(rl_server: Server, client: OpenAI) -> None:
    tid = _new_id("detail")
    _call(client, tid, content="First question.")
    _call(client, tid, content="Second question.", max_tokens=3)
    detail = get_trajectory(rl_server, tid)
    assert detail["id"] == tid and detail["object"] == "rl.trajectory"
    assert detail["turn_count"] == 2 and detail["rewards"] == []
    turns = detail["turns"]
    assert [t["turn_index"] for t in turns] == [0, 1]
    assert [t["request_messages"][-1]["content"] for t in turns] == [
        "First question.",
        "Second question.",
    ]
    assert [t["completion_tokens"] for t in turns] == [2, 3]
    for turn in turns:
        assert turn["prompt_tokens"] > 0
        assert "adapter_version" in turn and turn["adapter_version"] is None
        assert turn["response_messages"][0]["role"] == "assistant"
        assert turn["model_requested"] == "rlproxy"


def test_reward_closes_and_is_stored(rl_server: Server, client: OpenAI) -> None:
    tid = _new_id("reward")
    _call(client, tid)
    assert get_trajectory(rl_server, tid)["status"] == "open"
    r = httpx.post(
        f"{rl_server.url}/rl/trajectories/{tid}/reward", json={"reward": 0.75, "source": "env"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["trajectory_id"] == tid and r.json()["status"] == "closed"
    detail = get_trajectory(rl_server, tid)
    assert detail["status"] == "closed" and detail["close_reason"] == "reward"
    assert [(x["reward"], x["source"]) for x in detail["rewards"]] == [(0.75, "env")]
    # A second reward (another source) is kept beside the first.
    r = httpx.post(
        f"{rl_server.url}/rl/trajectories/{tid}/reward", json={"reward": -1, "source": "judge"}
    )
    assert r.status_code == 200
    rewards = get_trajectory(rl_server, tid)["rewards"]
    assert sorted(x["reward"] for x in rewards) == [-1.0, 0.75]
    closed = list_trajectories(rl_server, status="closed")
    assert tid in {t["id"] for t in closed}


def test_end_closes(rl_server: Server, client: OpenAI) -> None:
    tid = _new_id("end")
    _call(client, tid)
    r = httpx.post(f"{rl_server.url}/rl/trajectories/{tid}/end")
    assert r.status_code == 200 and r.json()["was_open"] is True
    detail = get_trajectory(rl_server, tid)
    assert detail["status"] == "closed" and detail["close_reason"] == "end"
    again = httpx.post(f"{rl_server.url}/rl/trajectories/{tid}/end")
    assert again.status_code == 200 and again.json()["was_open"] is False
    assert tid not in {t["id"] for t in list_trajectories(rl_server, status="open")}


def test_unknown_trajectory_is_404(rl_server: Server) -> None:
    base = f"{rl_server.url}/rl/trajectories/no-such-trajectory"
    _assert_error(httpx.get(base), 404, "trajectory_not_found")
    _assert_error(httpx.post(f"{base}/end"), 404, "trajectory_not_found")
    reward = httpx.post(f"{base}/reward", json={"reward": 1.0, "source": "env"})
    _assert_error(reward, 404, "trajectory_not_found")


@pytest.mark.parametrize(
    "body",
    [
        b'{"reward": NaN, "source": "env"}',
        b'{"reward": Infinity, "source": "env"}',
        b'{"reward": 1e999, "source": "env"}',
        b'{"reward": 1e308, "source": "env"}',  # finite, but its advantages would overflow
        b'{"reward": -1000001, "source": "env"}',
        b'{"reward": "high", "source": "env"}',
        b'{"reward": true, "source": "env"}',
        b'{"reward": "0.5", "source": "env"}',  # a string is not a number, however it reads
        b'{"source": "env"}',
        b'{"reward": 1.0, "source": ""}',
        b"not json",
    ],
)
def test_bad_reward_is_400_and_stores_nothing(
    rl_server: Server, client: OpenAI, body: bytes
) -> None:
    tid = _new_id("badreward")
    _call(client, tid)
    r = httpx.post(
        f"{rl_server.url}/rl/trajectories/{tid}/reward",
        content=body,
        headers={"content-type": "application/json"},
    )
    _assert_error(r, 400)
    assert get_trajectory(rl_server, tid)["rewards"] == []


@pytest.mark.parametrize(
    "params", [{"status": "finished"}, {"limit": 0}, {"limit": 501}, {"cursor": "garbage!"}]
)
def test_bad_list_query_is_400(rl_server: Server, params: dict[str, Any]) -> None:
    _assert_error(httpx.get(f"{rl_server.url}/rl/trajectories", params=params), 400)


def test_idle_trajectory_closes(rl_server: Server, client: OpenAI) -> None:
    tid = _new_id("idle")
    _call(client, tid)
    deadline = time.monotonic() + IDLE_TIMEOUT_S * 8
    while time.monotonic() < deadline:
        detail = get_trajectory(rl_server, tid)
        if detail["status"] == "closed":
            assert detail["close_reason"] == "idle"
            return
        time.sleep(2)
    raise AssertionError(f"trajectory {tid} did not close after {IDLE_TIMEOUT_S} s idle")


def _export(server: Server, *args: str) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "proxy.cli", "export", "--format", "jsonl"]
    out = subprocess.run(
        [*command, *args, "--data-dir", str(server.data_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up facts about a topic.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string", "enum": ["history", "science"]}},
            "required": ["topic"],
            "additionalProperties": False,
        },
    },
}


def test_export_writes_finetuning_lines(rl_server: Server, client: OpenAI, tmp_path: Path) -> None:
    tid = _new_id("export")
    question = f"Tell me about science ({tid})."
    reply = _call(
        client,
        tid,
        content=question,
        tools=[LOOKUP_TOOL],
        tool_choice="required",
        max_tokens=60,
    )
    call = reply.choices[0].message.tool_calls[0]
    follow_up = [
        {"role": "user", "content": question},
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Science is a method."},
    ]
    client.chat.completions.create(
        model="rlproxy",
        messages=follow_up,  # type: ignore[arg-type]
        tools=[LOOKUP_TOOL],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=5,
        extra_headers={"X-RLProxy-Trajectory": tid},
    )
    open_tid = _new_id("export-open")
    _call(client, open_tid, content=f"Still open ({open_tid}).")
    assert httpx.post(f"{rl_server.url}/rl/trajectories/{tid}/end").status_code == 200

    closed_lines = _export(rl_server)
    mine = [ln for ln in closed_lines if ln["messages"][0]["content"] == question]
    assert len(mine) == 1
    line = mine[0]
    assert [m["role"] for m in line["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert line["messages"][1]["tool_calls"][0]["function"]["name"] == "lookup"
    assert line["tools"][0]["function"]["name"] == "lookup"
    assert all("content" in m or "tool_calls" in m for m in line["messages"])
    assert not any(open_tid in json.dumps(ln) for ln in closed_lines)

    out = tmp_path / "all.jsonl"
    assert _export(rl_server, "--status", "all", "--out", str(out)) == []
    all_lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert any(open_tid in json.dumps(ln) for ln in all_lines)
    assert len(all_lines) >= len(closed_lines) + 1
    for ln in all_lines:
        assert ln["messages"][-1]["role"] == "assistant"


def test_reward_by_completion_id(rl_server: Server, client: OpenAI) -> None:
    """An agent that knows nothing of rlproxy rewards the run behind the response it got."""
    completion = client.chat.completions.create(
        model="rlproxy",
        messages=[{"role": "user", "content": f"Say hi ({uuid.uuid4().hex[:6]})"}],
        max_tokens=3,
    )
    r = httpx.post(f"{rl_server.url}/rl/trajectories/{completion.id}/reward", json={"reward": 0.75})
    assert r.status_code == 200, r.text
    tid = r.json()["trajectory_id"]
    assert tid != completion.id
    detail = get_trajectory(rl_server, completion.id)
    assert detail["id"] == tid and detail["status"] == "closed"
    assert [w["reward"] for w in detail["rewards"]] == [0.75]
    missing = httpx.post(
        f"{rl_server.url}/rl/trajectories/chatcmpl-nope/reward", json={"reward": 1}
    )
    assert missing.status_code == 404


def test_errors_never_show_server_paths(rl_server: Server) -> None:
    """An unknown adapter version, an unknown route: the answers name no folder of the server."""
    secret_dir = str(rl_server.data_dir.resolve())
    for method, path in (
        ("POST", "/rl/adapters/42/load"),
        ("POST", "/rl/adapters/42/activate"),
        ("GET", "/no/such/route"),
        ("GET", "/rl/adapters"),
    ):
        r = httpx.request(method, f"{rl_server.url}{path}", timeout=30)
        assert secret_dir not in r.text, (method, path, r.text)
        assert REPO.as_posix() not in r.text, (method, path)
    r = httpx.post(f"{rl_server.url}/rl/adapters/42/load", timeout=30)
    assert r.status_code == 404 and "checkpoints/rlproxy/0042" in r.json()["error"]["message"]
