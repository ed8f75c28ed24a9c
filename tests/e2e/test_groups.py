"""Groups from real traffic, and RULER's handling of judge replies, through a real server.

The server samples 4 shadow answers per first turn and judges with a scripted fake judge on
loopback (`fake_judge.py`: a paid judge model cannot run here; the fake follows OpenAI's Chat
Completions protocol). Background scoring is off: each test scores its group through
`POST /rl/groups/{id}/score` (or `rlproxy score`) and checks how it ended. The local engine as
judge is tested in test_ruler_local.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.fake_judge import FakeJudge, FakeJudgeServer
from tests.e2e.helpers import db_rows, own_server

REPO = Path(__file__).resolve().parents[2]
SHADOW_K = 4
MIN_SIZE = 3


@pytest.fixture(scope="module")
def judge() -> Iterator[FakeJudge]:
    with FakeJudgeServer() as fake:
        yield fake


@pytest.fixture(scope="module")
def gserver(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, judge: FakeJudge
) -> Iterator[Server]:
    env = {
        "RLPROXY_SHADOW_SAMPLES": str(SHADOW_K),
        "RLPROXY_GROUP_MIN_SIZE": str(MIN_SIZE),
        "RLPROXY_JUDGE_MODEL": "openai/judge",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "RLPROXY_JUDGE_API_KEY_ENV": "FAKE_JUDGE_KEY",
        "FAKE_JUDGE_KEY": "sk-judge",
        "RLPROXY_JUDGE_TIMEOUT_S": "2",
    }
    with own_server(tmp_path_factory.mktemp("groups-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def client(gserver: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=gserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        yield c


def _ask(client: OpenAI, question: str, **kw: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model="rlproxy",
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": question},
        ],
        max_tokens=6,
        temperature=1.0,
        **kw,
    )


def _trajectory_of(server: Server, request_id: str) -> str:
    rows = db_rows(
        server.data_dir, "SELECT trajectory_id FROM calls WHERE request_id = ?", (request_id,)
    )
    assert len(rows) == 1
    return str(rows[0]["trajectory_id"])


def _run_and_end(server: Server, client: OpenAI, question: str, **kw: Any) -> str:
    raw = _ask(client, question, **kw)
    tid = _trajectory_of(server, raw.headers["x-request-id"])
    r = httpx.post(f"{server.url}/rl/trajectories/{tid}/end", timeout=30)
    assert r.status_code == 200
    return tid


def _groups(server: Server, **params: Any) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.url}/rl/groups", params={"limit": 500, **params}, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def _group(server: Server, group_id: str) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/rl/groups/{group_id}", timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _form(server: Server) -> None:
    """Run the grouping pass now (the scorer's first step) without scoring anything."""
    subprocess_env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(server.data_dir),
        "RLPROXY_GROUP_MIN_SIZE": str(MIN_SIZE),
    }
    # `rlproxy score` always forms groups first; an unknown group id makes it stop right after.
    subprocess.run(
        [sys.executable, "-m", "proxy.cli", "score", "--group", "none"],
        env={**subprocess_env, "RLPROXY_JUDGE_MODEL": "openai/unused"},
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )


def _score(server: Server, group_id: str) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/rl/groups/{group_id}/score", timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _valid_reply(n: int, scores: list[float] | None = None) -> str:
    scores = scores or [round(i / max(n - 1, 1), 2) for i in range(n)]
    return json.dumps(
        {
            "scores": [
                {"trajectory_id": str(i + 1), "explanation": f"member {i + 1}", "score": s}
                for i, s in enumerate(scores)
            ]
        }
    )


# --------------------------------------------------------------------------- group sources


def test_shadow_samples_form_a_group_per_first_turn(gserver: Server, client: OpenAI) -> None:
    raw = _ask(client, "Name a color.")
    completion = raw.parse()
    assert len(completion.choices) == 1  # the client receives one completion
    returned = completion.choices[0].message.content
    tid = _trajectory_of(gserver, raw.headers["x-request-id"])
    call_id = db_rows(gserver.data_dir, "SELECT id FROM calls WHERE trajectory_id = ?", (tid,))[0][
        "id"
    ]
    (group,) = [g for g in _groups(gserver, source="shadow") if g["key"] == call_id]
    assert group["status"] == "ready" and group["member_count"] == SHADOW_K
    detail = _group(gserver, group["id"])
    members = detail["members"]
    assert len(members) == SHADOW_K
    assert [m["returned"] for m in members].count(True) == 1
    (shown,) = [m for m in members if m["returned"]]
    assert shown["messages"][-1]["content"] == returned
    samples = db_rows(
        gserver.data_dir,
        "SELECT sample_index, completion_token_ids FROM call_samples WHERE call_id = ?",
        (call_id,),
    )
    assert len(samples) == SHADOW_K - 1
    for s in samples:
        ids = json.loads(s["completion_token_ids"])
        assert ids and all(isinstance(i, int) for i in ids)
    assert all(m["turns"][0]["completion_tokens"] for m in members)
    # The trajectory shows only the returned answer.
    traj = httpx.get(f"{gserver.url}/rl/trajectories/{tid}", timeout=30).json()
    assert [m["content"] for m in traj["turns"][0]["response_messages"]] == [returned]


def test_later_turns_get_no_shadow_samples(gserver: Server, client: OpenAI) -> None:
    before = len(_groups(gserver, source="shadow"))
    client.chat.completions.create(
        model="rlproxy",
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Name a fruit."},
        ],
        max_tokens=4,
    )
    assert len(_groups(gserver, source="shadow")) == before


def test_repeated_runs_of_a_task_form_a_group(gserver: Server, client: OpenAI) -> None:
    question = f"Say a number. ({uuid.uuid4().hex[:6]})"
    runs = [_run_and_end(gserver, client, question) for _ in range(MIN_SIZE)]
    _form(gserver)
    groups = [
        g
        for g in _groups(gserver, source="task")
        if {m["trajectory_id"] for m in _group(gserver, g["id"])["members"]} == set(runs)
    ]
    assert len(groups) == 1 and groups[0]["status"] == "ready"


def test_explicit_keys_form_a_group(gserver: Server, client: OpenAI) -> None:
    key = f"exp-{uuid.uuid4().hex[:8]}"
    runs = [
        _run_and_end(gserver, client, "Pick a letter.", extra_headers={"X-RLProxy-Group": key}),
        _run_and_end(gserver, client, "Pick a digit.", metadata={"group_id": key}),
        _run_and_end(gserver, client, "Pick a word.", extra_body={"rlproxy": {"group_id": key}}),
    ]
    _form(gserver)
    (group,) = [g for g in _groups(gserver, source="explicit") if g["key"] == key]
    assert group["status"] == "ready"
    assert [m["trajectory_id"] for m in _group(gserver, group["id"])["members"]] == runs


# --------------------------------------------------------------------------- judge replies


@pytest.fixture
def shadow_group(gserver: Server, client: OpenAI) -> dict[str, Any]:
    """A fresh ready group of SHADOW_K members."""
    raw = _ask(client, f"Name an animal. ({uuid.uuid4().hex[:6]})")
    tid = _trajectory_of(gserver, raw.headers["x-request-id"])
    call_id = db_rows(gserver.data_dir, "SELECT id FROM calls WHERE trajectory_id = ?", (tid,))[0][
        "id"
    ]
    (group,) = [g for g in _groups(gserver, source="shadow") if g["key"] == call_id]
    return group


def test_valid_judge_reply_scores_every_member(
    gserver: Server, judge: FakeJudge, shadow_group: dict[str, Any]
) -> None:
    judge.reset()
    judge.reply(_valid_reply(SHADOW_K, [0.1, 0.9, 0.5, 0.3]))
    scored = _score(gserver, shadow_group["id"])
    assert scored["status"] == "scored" and scored["judge_attempts"] == 1
    assert scored["judge_model"] == "openai/judge"
    assert scored["judge_prompt_tokens"] and scored["judge_latency_s"] > 0
    assert [m["ruler"]["score"] for m in scored["members"]] == [0.1, 0.9, 0.5, 0.3]
    assert [m["ruler"]["explanation"] for m in scored["members"]] == [
        f"member {i}" for i in range(1, SHADOW_K + 1)
    ]
    assert all(m["reward"] == m["ruler"]["score"] for m in scored["members"])
    assert all(m["ruler"]["rubric_hash"] == scored["rubric_hash"] for m in scored["members"])
    (request,) = judge.requests
    assert request["response_format"]["type"] == "json_schema"


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (lambda: _valid_reply(SHADOW_K - 1), "3"),
        (
            lambda: _valid_reply(SHADOW_K).replace('"trajectory_id": "2"', '"trajectory_id": "9"'),
            "9",
        ),
        (lambda: '{"scores": [', "JSON"),
        (lambda: _valid_reply(SHADOW_K, [0.1, 1.5, 0.2, 0.3]), "1.5"),
    ],
    ids=["wrong-count", "unknown-id", "malformed-json", "out-of-range"],
)
def test_invalid_reply_is_retried_once_with_the_error(
    gserver: Server, judge: FakeJudge, shadow_group: dict[str, Any], bad: Any, reason: str
) -> None:
    judge.reset()
    judge.reply(bad()).reply(_valid_reply(SHADOW_K))
    scored = _score(gserver, shadow_group["id"])
    assert scored["status"] == "scored" and scored["judge_attempts"] == 2
    retry = judge.requests[1]["messages"]
    assert retry[-2]["role"] == "assistant" and retry[-1]["role"] == "user"
    assert reason in retry[-1]["content"]

    judge.reset()
    judge.reply(bad()).reply(bad())
    failed = _score(gserver, shadow_group["id"])
    assert failed["status"] == "failed" and reason in failed["failure"]


def test_timeout_and_server_error_fail_the_group_not_the_server(
    gserver: Server, client: OpenAI, judge: FakeJudge, shadow_group: dict[str, Any]
) -> None:
    judge.reset()
    judge.delay(5, _valid_reply(SHADOW_K)).delay(5, _valid_reply(SHADOW_K))
    with ThreadPoolExecutor(2) as pool:
        scoring = pool.submit(_score, gserver, shadow_group["id"])
        # The server keeps serving while the judge hangs.
        answer = client.chat.completions.create(
            model="rlproxy", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert answer.choices[0].message.content is not None
        timed_out = scoring.result(timeout=60)
    assert timed_out["status"] == "failed" and "timed out" in timed_out["failure"].lower()

    judge.reset()
    judge.status(500).status(500)
    failed = _score(gserver, shadow_group["id"])
    assert failed["status"] == "failed" and "500" in failed["failure"]

    judge.reset()
    judge.status(500).reply(_valid_reply(SHADOW_K))
    assert _score(gserver, shadow_group["id"])["status"] == "scored"
    assert httpx.get(f"{gserver.url}/health", timeout=10).status_code == 200


def test_score_cli_prints_a_table(
    gserver: Server, judge: FakeJudge, shadow_group: dict[str, Any]
) -> None:
    judge.reset()
    judge.reply(_valid_reply(SHADOW_K, [0.25, 0.5, 0.75, 1.0]))
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(gserver.data_dir),
        "RLPROXY_JUDGE_MODEL": "openai/judge",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "OPENAI_API_KEY": "sk-judge",
        # One scripted reply for the group's own members: no canary or re-ordered judging.
        "RLPROXY_JUDGE_CHECKS": "false",
    }
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "score", "--group", shadow_group["id"]],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(shadow_group["id"][:10])]
    assert len(lines) == SHADOW_K
    assert "1.00" in lines[-1] and "member 4" in lines[-1]
    assert _group(gserver, shadow_group["id"])["status"] == "scored"


def test_unknown_group_is_a_404(gserver: Server) -> None:
    r = httpx.get(f"{gserver.url}/rl/groups/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "group_not_found"
    r = httpx.post(f"{gserver.url}/rl/groups/nope/score", timeout=10)
    assert r.status_code == 404
