"""Serving first, end to end through real `rlproxy serve` processes on loopback: background work
(the judge, the trainer child) gives way to the users the server serves.

- A judge that failed its checks backs off: it judges one group every RLPROXY_JUDGE_RETRY_S and
  the other ready groups wait, ready, never failed or lost.
- With nothing to use the scores (no trainer here, no trainer announced on the database), ready
  groups wait unjudged; a trainer's presence lease, or the setting that judges always, lets the
  judge at them.
- The trainer child runs every one of its threads at RLPROXY_TRAINER_NICE (10), the server at
  its own priority.
- The local judge's requests are paused on the engine when a user's request arrives, and resume
  after it.

The first two use a scripted judge on loopback (`fake_judge.py`, OpenAI's Chat Completions
protocol): the real judge is a paid model that cannot run here. The last uses the real local
judge (the embedded model judging through its own engine). Figures are read where an operator
reads them: `GET /rl/stats` ("background"), `GET /rl/groups`, `/proc`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from proxy.adapters.deployment import trainer_presence_name
from storage.store import Store
from tests.e2e.conftest import Server
from tests.e2e.fake_judge import FakeJudge, FakeJudgeServer
from tests.e2e.helpers import own_server, wait_for
from trainer.scoring.scoring import EARLY_CANARIES

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")

MEMBER = re.compile(r'<trajectory id="(\d+)">')
RETRY_S = 4.0  # RLPROXY_JUDGE_RETRY_S of the back-off server
BACKOFF_GROUPS = 14  # EARLY_CANARIES to fail, a few tries, and some left over that must wait
GROUPS = {
    "RLPROXY_SCORING_INTERVAL_S": "0.5",
    # Every call's first turn sampled twice in one batch, stored as a shadow group of two.
    "RLPROXY_SHADOW_SAMPLES": "2",
    "RLPROXY_GROUP_MIN_SIZE": "2",
}
WHEN_USED = {"RLPROXY_SCORING": "auto"}  # the default: judge only while something uses the scores
ALWAYS = {"RLPROXY_SCORING": "true"}
ALWAYS_SETTING = "RLPROXY_SCORING=true"  # what the waiting reason suggests


def _judge_env(judge: FakeJudge) -> dict[str, str]:
    return {
        "RLPROXY_JUDGE_MODEL": "openai/judge",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "RLPROXY_JUDGE_API_KEY_ENV": "FAKE_JUDGE_KEY",
        "FAKE_JUDGE_KEY": "sk-judge",
    }


class SameScore:
    """A judge that cannot tell members apart: every member, the canary included, gets 0.5, so
    every canary ties the real members' median and fails. Notes when each request came."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> str:
        with self._lock:
            self.times.append(time.monotonic())
        ids = MEMBER.findall(body["messages"][1]["content"])
        entries = [{"trajectory_id": i, "explanation": "alike", "score": 0.5} for i in ids]
        return json.dumps({"scores": entries})


def _ranks(body: dict[str, Any]) -> str:
    """A judge that tells members apart (checks are off where it is used)."""
    ids = MEMBER.findall(body["messages"][1]["content"])
    entries = [
        {"trajectory_id": i, "explanation": "ranked", "score": round(0.2 + 0.6 * k / len(ids), 2)}
        for k, i in enumerate(ids)
    ]
    return json.dumps({"scores": entries})


def _ask(server: Server, question: str) -> Any:
    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        return c.chat.completions.create(
            model="rlproxy",
            messages=[
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": question},
            ],
            max_tokens=4,
            temperature=1.0,
        )


def _ask_many(server: Server, count: int) -> None:
    """`count` first turns at once (one engine batch): `count` shadow groups of two."""
    tag = uuid.uuid4().hex[:6]
    questions = [f"Name a colour, please ({tag}-{k})." for k in range(count)]
    with ThreadPoolExecutor(max_workers=count) as pool:
        list(pool.map(lambda q: _ask(server, q), questions))


def _background(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/rl/stats", timeout=60)
    r.raise_for_status()
    background = r.json()["background"]
    assert background is not None
    return dict(background)


def _judge(server: Server) -> dict[str, Any]:
    judge = _background(server)["judge"]
    assert judge is not None, "scoring is on: /rl/stats must report the judge"
    return dict(judge)


def _statuses(server: Server) -> list[str]:
    r = httpx.get(f"{server.url}/rl/groups", params={"limit": 500}, timeout=60)
    r.raise_for_status()
    assert not r.json()["has_more"]
    return [g["status"] for g in r.json()["data"]]


def _presence(data_dir: Path, holder: str, *, hold: bool) -> None:
    """Take (or give up) the lease a running `rlproxy train` renews on the database."""

    async def go() -> None:
        store = await Store.open(f"sqlite+aiosqlite:///{data_dir / 'rlproxy.db'}")
        try:
            name = trainer_presence_name("rlproxy")
            if hold:
                assert await store.acquire_lease(name, holder, 120.0)
            else:
                assert await store.release_lease(name, holder)
        finally:
            await store.close()

    asyncio.run(go())


# ----------------------------------------------------------------------------- back-off


@pytest.fixture
def failing_judge() -> Iterator[tuple[FakeJudge, SameScore]]:
    rule = SameScore()
    with FakeJudgeServer() as fake:
        fake.rule(rule)
        yield fake, rule


@pytest.fixture
def backoff_server(
    tmp_path: Path, model_data_dir: Path, failing_judge: tuple[FakeJudge, SameScore]
) -> Iterator[Server]:
    env = {
        **GROUPS,
        **ALWAYS,  # no trainer here: judge all the same
        **_judge_env(failing_judge[0]),
        "RLPROXY_JUDGE_CHECKS": "true",
        "RLPROXY_JUDGE_CANARY_SHARE": "1",  # a canary in every group
        "RLPROXY_JUDGE_POSITION_SHARE": "0",  # one judge call per group
        # RLPROXY_JUDGE_GATE_MIN_CHECKS stays 20: the judge fails early, at EARLY_CANARIES
        # canaries whose 95% upper bound (0/5: 0.43) is below the pass rate it needs (0.8).
        "RLPROXY_JUDGE_RETRY_S": str(RETRY_S),
    }
    with own_server(tmp_path, model_data_dir, env) as server:
        yield server


def test_a_judge_that_failed_its_canaries_judges_one_group_per_retry_interval(
    backoff_server: Server, failing_judge: tuple[FakeJudge, SameScore]
) -> None:
    judge, rule = failing_judge
    _ask_many(backoff_server, BACKOFF_GROUPS)

    status = wait_for(
        lambda: (s := _judge(backoff_server))["state"] == "backing off" and s,
        120,
        "the judge to back off after failing its canaries",
        poll_s=0.2,
    )
    assert re.search(r"canaries 0/\d+ passed", status["reason"]), status
    assert status["retry_s"] == RETRY_S
    assert status["retry_at"] is not None and status["retry_at"] <= time.time() + RETRY_S
    failed_at = len(judge.requests)
    # It failed on its EARLY_CANARIES-th canary (one per group, one call per group), judged
    # back to back before that.
    assert failed_at == EARLY_CANARIES
    assert status["groups_last_hour"] == status["judge_calls_last_hour"] == failed_at

    # Watch it back off: one judge call (one group) per RETRY_S at most, yet it keeps trying.
    started = time.monotonic()
    while time.monotonic() < started + 3 * RETRY_S:
        assert _judge(backoff_server)["state"] in ("backing off", "judging")
        time.sleep(0.25)
    tries = len(judge.requests) - failed_at
    assert 1 <= tries <= 4, f"{tries} judge calls in {3 * RETRY_S:.0f} s of backing off"
    after = rule.times[EARLY_CANARIES - 1 :]  # the failing call, then each try
    gaps = [b - a for a, b in itertools.pairwise(after)]
    assert gaps and min(gaps) >= RETRY_S - 0.5, gaps

    # Every group is still there: judged ones held (the judge is not proven), the rest ready.
    # Read while its next try is at least a second away, so that nothing is being judged.
    status = wait_for(
        lambda: (
            (s := _judge(backoff_server))["state"] == "backing off"
            and s["retry_at"] > time.time() + 1
            and s
        ),
        2 * RETRY_S,
        "the judge to back off again",
        poll_s=0.2,
    )
    statuses = _statuses(backoff_server)
    assert len(statuses) == BACKOFF_GROUPS, statuses
    assert set(statuses) <= {"ready", "held"}, statuses
    judged = len(judge.requests)
    assert statuses.count("held") == judged == status["groups_last_hour"]
    assert statuses.count("ready") == BACKOFF_GROUPS - judged >= 1


# ----------------------------------------------------------------------------- no trainer


@pytest.fixture
def passing_judge() -> Iterator[FakeJudge]:
    with FakeJudgeServer() as fake:
        fake.rule(_ranks)
        yield fake


def test_ready_groups_wait_unjudged_until_something_uses_the_scores(
    tmp_path: Path, model_data_dir: Path, passing_judge: FakeJudge
) -> None:
    judge = passing_judge
    env = {**GROUPS, **WHEN_USED, **_judge_env(judge)}  # RLPROXY_TRAIN=false, no telemetry
    with own_server(tmp_path, model_data_dir, env) as server:
        _ask_many(server, 2)
        wait_for(
            lambda: (
                _statuses(server) == ["ready", "ready"] and _judge(server)["state"] == "waiting"
            ),
            60,
            "two ready groups and a waiting judge",
            poll_s=0.2,
        )
        status = _judge(server)
        assert "nothing uses the scores" in status["reason"]
        assert ALWAYS_SETTING in status["reason"]
        # Ten scoring passes: none judges.
        watched = time.monotonic()
        while time.monotonic() < watched + 5:
            assert not judge.requests, "the judge was called with nothing to use its scores"
            assert _statuses(server) == ["ready", "ready"]
            assert _judge(server)["state"] == "waiting"
            time.sleep(0.25)

        # A trainer announces itself on the database (as a running `rlproxy train` does).
        _presence(tmp_path, "test-trainer", hold=True)
        wait_for(
            lambda: _statuses(server) == ["scored", "scored"],
            60,
            "the groups judged once a trainer is present",
            poll_s=0.2,
        )
        assert len(judge.requests) == 2
        assert _judge(server)["state"] != "waiting"

        # The trainer leaves: a new group waits again.
        _presence(tmp_path, "test-trainer", hold=False)
        _ask_many(server, 1)
        wait_for(
            lambda: (
                sorted(_statuses(server)) == ["ready", "scored", "scored"]
                and _judge(server)["state"] == "waiting"
            ),
            60,
            "the new group to wait once the trainer left",
            poll_s=0.2,
        )
        assert len(judge.requests) == 2

    # The same database served with the setting that judges always: the waiting group is
    # judged with no trainer anywhere.
    with own_server(tmp_path, model_data_dir, {**env, **ALWAYS}) as server:
        wait_for(
            lambda: _statuses(server) == ["scored"] * 3,
            60,
            f"the waiting group judged with {ALWAYS_SETTING}",
            poll_s=0.2,
        )
        assert len(judge.requests) == 3
        assert _judge(server)["state"] in ("idle", "judging")


# ----------------------------------------------------------------------------- the trainer


def _thread_niceness(pid: int) -> dict[int, int]:
    """Each thread's niceness (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        out[int(task.name)] = int(fields[16])  # fields 3 on: field 19 is the 17th
    return out


def test_the_trainer_child_runs_every_thread_at_a_lower_priority(
    tmp_path: Path, model_data_dir: Path
) -> None:
    with own_server(tmp_path, model_data_dir, {"RLPROXY_TRAIN": "true"}) as server:
        log = tmp_path / "trainer.log"
        # Its threads (the asyncio pool, torch's) exist once it has loaded the model and trains.
        wait_for(
            lambda: log.exists() and re.search(r"training rlproxy into", log.read_text()),
            120,
            "the trainer child to start training",
            poll_s=0.2,
        )
        trainer = _background(server)["trainer"]
        pid = trainer["pid"]
        health = httpx.get(f"{server.url}/health", timeout=60).json()
        assert pid is not None and pid == health["trainer"]["pid"]
        assert trainer["nice"] == 10
        niceness = _thread_niceness(pid)
        assert len(niceness) > 1, niceness
        assert set(niceness.values()) == {10}, niceness
        assert "trainer niceness 10 (RLPROXY_TRAINER_NICE)" in log.read_text()
        # Serving keeps the priority it was started with (this test's).
        server_pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert set(_thread_niceness(server_pid).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}


# ----------------------------------------------------------------------------- the engine


@pytest.fixture
def local_judge_server(tmp_path: Path, model_data_dir: Path) -> Iterator[Server]:
    env = {
        **GROUPS,
        **ALWAYS,  # no trainer here; no RLPROXY_JUDGE_MODEL: the served base model judges
        "RLPROXY_BACKGROUND_IDLE_S": "0",  # the judge starts the moment users are gone
    }
    with own_server(tmp_path, model_data_dir, env) as server:
        yield server


# Slow (`make test-slow`, about a minute): CI checks the same rule on the engine itself,
# tests/proxy/test_background_priority.py (real model, the judge's requests paused and resumed).
@pytest.mark.slow
def test_a_users_request_pauses_the_local_judge_and_is_answered(
    local_judge_server: Server,
) -> None:
    server = local_judge_server
    _ask_many(server, 3)  # a backlog of three groups for the local judge
    wait_for(
        lambda: _background(server)["engine"]["running_rows"] >= 1,
        120,
        "the local judge generating on the engine",
        poll_s=0.05,
    )
    before = _background(server)["engine"]
    assert before["serving_first"] is True

    answer = _ask(server, "What is the capital of France?")
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and answer.usage.completion_tokens >= 1

    engine = _background(server)["engine"]
    assert engine["pauses"] > before["pauses"], (before, engine)
    # The judge resumes once the user is answered.
    tokens = engine["tokens"]
    wait_for(
        lambda: _background(server)["engine"]["tokens"] > tokens,
        60,
        "the local judge to resume after the user's request",
        poll_s=0.1,
    )
    assert _judge(server)["state"] == "judging"
