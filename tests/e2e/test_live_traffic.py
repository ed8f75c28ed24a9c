"""Live traffic through a real server: an unchanged agent asks every question once and posts
the environment's reward (examples/arithmetic_agent.py, the plain openai SDK).

With the grouping defaults (cohorts on) those answers join their agent's cohort and a version is
trained and served from them; with cohorts off they wait alone, and `/rl/stats` and `rlproxy
status` say so and name what would make them train. The lone-task wait is shortened from 60 s
to 1 s so the tests end quickly; nothing else about grouping is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server
from tests.e2e.helpers import own_server, wait_for

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = 8
ALONE = {"RLPROXY_GROUP_COHORT": "false"}
FAST = {
    "RLPROXY_GROUP_ALONE_S": "1",
    "RLPROXY_SCORING_INTERVAL_S": "0.5",
    "RLPROXY_TRAIN_POLL_S": "1",
    "RLPROXY_ADAPTER_POLL_S": "1",
}


def _ask_each_question_once(server: Server) -> None:
    env = {**os.environ, "OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "sk-test"}
    args = ["train", "--questions", str(QUESTIONS), "--runs", "1", "--seed", "3"]
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "arithmetic_agent.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["episodes"] == QUESTIONS


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        **FAST,
        "RLPROXY_TRAIN": "true",
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": 1, "micro_batch_size": 4}),
    }
    with own_server(tmp_path_factory.mktemp("live-data"), model_data_dir, env) as server:
        yield server


def test_questions_asked_once_form_cohorts_and_train_a_version(live_server: Server) -> None:
    _ask_each_question_once(live_server)
    url = live_server.url

    def cohorts() -> list[dict[str, object]]:
        data = httpx.get(f"{url}/rl/groups", params={"source": "cohort"}, timeout=30).json()
        return list(data["data"])

    def members(groups: list[dict[str, object]]) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for g in groups:
            out += httpx.get(f"{url}/rl/groups/{g['id']}", timeout=30).json()["members"]
        return out

    # How the eight answers split into cohort parts depends on how many left their task groups
    # in one grouping pass (all at once: one part of 8; one by one: parts of 4), so the test
    # counts members, not parts: every answer ends in a cohort, and a part of 4 or more is ready.
    def all_in_cohorts() -> list[dict[str, object]]:
        groups = cohorts()
        ready = [g for g in groups if g["status"] != "forming"]
        return groups if ready and len(members(groups)) == QUESTIONS else []

    groups = wait_for(all_in_cohorts, 120, f"all {QUESTIONS} answers in cohort groups")
    for g in groups:
        detail = httpx.get(f"{url}/rl/groups/{g['id']}", timeout=30).json()
        if g["status"] != "forming":
            assert len(detail["members"]) >= 4
    assert all(m["reward_source"] == "explicit" for m in members(groups))
    assert (
        httpx.get(f"{url}/rl/groups", params={"status": "forming", "source": "task"}).json()["data"]
        == []
    )

    def trained() -> bool:
        data = httpx.get(f"{url}/rl/adapters", timeout=30).json()["data"]
        return any(a["version"] == 1 and a["status"] == "loaded" for a in data)

    wait_for(trained, 400, "version 1 trained from cohorts and loaded (see trainer.log)")
    models = httpx.get(f"{live_server.base_url}/models", timeout=30).json()["data"]
    assert "rlproxy@1" in [m["id"] for m in models]


@pytest.fixture(scope="module")
def alone_server(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[Server]:
    env = {**FAST, **ALONE}
    with own_server(tmp_path_factory.mktemp("alone-data"), model_data_dir, env) as server:
        yield server


def test_with_cohorts_off_status_says_why_nothing_trains(alone_server: Server) -> None:
    _ask_each_question_once(alone_server)

    def reasons() -> list[dict[str, str]]:
        stats = httpx.get(f"{alone_server.url}/rl/stats", timeout=30).json()
        waiting = stats["groups"]["waiting"]
        return stats["groups"]["why_not_training"] if waiting["alone"] == QUESTIONS else []

    found = wait_for(reasons, 60, f"{QUESTIONS} trajectories alone in /rl/stats")
    text = " ".join(f"{r['what']} {r['fix']}" for r in found)
    assert f"{QUESTIONS} trajectories wait alone in their task's group" in text
    assert "RLPROXY_GROUP_COHORT=true" in text

    # the command reads the same settings as the server it reports on
    env = {**os.environ, **ALONE, "RLPROXY_DATA_DIR": str(alone_server.data_dir)}
    status = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "why traffic is not training yet:" in status.stdout
    assert f"{QUESTIONS} trajectories wait alone" in status.stdout
    assert "RLPROXY_GROUP_COHORT=true" in status.stdout
