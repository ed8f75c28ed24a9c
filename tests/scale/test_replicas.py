"""Two `rlproxy serve` replicas on one Postgres behind HAProxy, the agents going through the
balancer: rewarded groups that arrived through both replicas train one version that both serve,
and a replica SIGKILLed under load loses nothing it acknowledged while the balancer routes
around it.

Both replicas run with training on (RLPROXY_TRAIN=true): the trainer lease lets exactly one of
them run a trainer (docs/scaling.md, "Several proxies on one database"). Both score, follow the
policy's active version in the database and serve. No API keys here
(loopback): the default limits never refuse this load.

The load of the kill test is calls to an upstream model, `teacher`: the fake OpenAI provider on
loopback (tests/e2e/fake_openai.py, OpenAI's documented protocol), a fake because the embedded
135M model on two shared cores makes a few calls a second, not load. Upstream calls are stored
and acknowledged exactly as the policy's (the row is committed before the response).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import free_port
from tests.e2e.fake_openai import FakeOpenAI, FakeOpenAIServer
from tests.e2e.helpers import wait_for
from tests.scale.deployment import REPLICA_HEADER, Deployment, deployment

pytestmark = pytest.mark.scale

TASKS = {
    "planet": [
        {"role": "system", "content": "Reply with one word."},
        {"role": "user", "content": "Name a planet."},
    ],
    "colour": [
        {"role": "system", "content": "Reply with one word."},
        {"role": "user", "content": "Name a colour."},
    ],
}
REWARDS = (0.0, 0.25, 0.75, 1.0)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAIServer(free_port()) as server:
        yield server


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, fake: FakeOpenAI
) -> Iterator[Deployment]:
    teacher = {"model": "openai/fake-model", "api_base": fake.base_url, "api_key_env": "FAKE_KEY"}
    common = {
        "RLPROXY_UPSTREAM_MODELS": json.dumps({"teacher": teacher}),
        "FAKE_KEY": "sk-fake-provider",
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "1",
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_ADAPTER_POLL_S": "1",
        "RLPROXY_GROUP_MIN_SIZE": "4",
        "RLPROXY_TRAIN": "true",
        "RLPROXY_TRAIN_POLL_S": "1",
        # The smallest real step: both groups (8 samples of at most 8 tokens) in one update.
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": 2, "micro_batch_size": 4}),
    }
    replicas: dict[str, dict[str, str]] = {"a": {}, "b": {}}
    work = tmp_path_factory.mktemp("scale-pair")
    with deployment(work, model_data_dir, replicas, common) as (d, _):
        yield d


def chat(http: httpx.Client, url: str, messages: list[dict[str, Any]], **fields: Any) -> Any:
    body = {"model": "rlproxy", "messages": messages, "max_tokens": 8, **fields}
    return http.post(f"{url}/v1/chat/completions", json=body)


def test_groups_through_both_replicas_train_one_version_that_both_serve(pair: Deployment) -> None:
    served: dict[str, list[tuple[str, str]]] = {task: [] for task in TASKS}
    with httpx.Client(timeout=120) as http:
        # One call at a time: the balancer alternates between the replicas (equal load), and
        # the task order flips every round, so each task's four runs arrive through both.
        for i, _ in enumerate(REWARDS):
            for task, messages in list(TASKS.items())[:: 1 if i % 2 else -1]:
                r = chat(http, pair.url, messages, temperature=1.0)
                assert r.status_code == 200, r.text
                served[task].append((r.json()["id"], r.headers[REPLICA_HEADER]))
        for task, runs in served.items():
            assert {replica for _, replica in runs} == {"a", "b"}, (task, runs)
            for (completion_id, _), reward in zip(runs, REWARDS, strict=True):
                r = http.post(
                    f"{pair.url}/rl/trajectories/{completion_id}/reward",
                    json={"reward": reward, "source": "env"},
                )
                assert r.status_code == 200, r.text

        def serves_version_1(replica: str) -> bool:
            url = pair.replicas[replica].url  # straight to the replica, not the balancer
            return "rlproxy@1" in [m["id"] for m in http.get(f"{url}/v1/models").json()["data"]]

        for replica in pair.replicas:
            wait_for(lambda r=replica: serves_version_1(r), 600, f"rlproxy@1 on replica {replica}")

        # One version, trained from both groups in one step (with what the groups held, should
        # a second version appear: which trajectories went where, on which replica).
        versions = sorted(p.name for p in (pair.data_dir / "checkpoints" / "rlproxy").iterdir())
        groups = pair.rows("SELECT id, key, status, trained_step, member_count FROM groups")
        members = pair.rows("SELECT group_id, trajectory_id FROM group_members")
        detail = ([dict(g) for g in groups], [dict(m) for m in members])
        assert versions == ["0001"], detail
        assert sorted((g["status"], g["trained_step"], g["member_count"]) for g in groups) == [
            ("scored", 1, 4),
            ("scored", 1, 4),
        ], detail

        # One trainer ran: the lease's holder; the other replica stood by.
        states = sorted(
            http.get(f"{r.url}/health").json()["trainer"]["state"] for r in pair.replicas.values()
        )
        assert states == ["running", "standby"], states

        # Each replica answers the policy name with version 1: the stored calls say so.
        for replica in pair.replicas:
            r = chat(http, pair.replicas[replica].url, TASKS["planet"], temperature=0)
            assert r.status_code == 200, r.text
            (row,) = pair.rows(
                "SELECT adapter_version FROM calls WHERE completion_id = $1", r.json()["id"]
            )
            assert row["adapter_version"] == 1, replica


@dataclass
class Outcome:
    status: int
    completion_id: str | None
    replica: str | None
    after_kill: bool


def test_a_replica_killed_under_load_loses_nothing_it_acknowledged(pair: Deployment) -> None:
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    killed = threading.Event()
    stop = threading.Event()

    def agent(worker: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = 0
            while not stop.is_set():
                i += 1
                messages = [{"role": "user", "content": f"Agent {worker}, step {i}: say hi."}]
                after = killed.is_set()
                try:
                    r = chat(http, pair.url, messages, model="teacher")
                    outcome = Outcome(
                        r.status_code,
                        r.json()["id"] if r.status_code == 200 else None,
                        r.headers.get(REPLICA_HEADER),
                        after,
                    )
                except httpx.HTTPError:  # the connection died with the replica
                    outcome = Outcome(0, None, None, after)
                with lock:
                    outcomes.append(outcome)

    workers = [threading.Thread(target=agent, args=(w,)) for w in range(8)]
    for w in workers:
        w.start()
    try:
        wait_for(
            lambda: (
                _count(outcomes, lock, replica="a") >= 100
                and _count(outcomes, lock, replica="b") >= 100
            ),
            300,
            "both replicas serving the load",
            poll_s=0.05,
        )
        pair.kill("b")
        killed.set()
        wait_for(lambda: _count(outcomes, lock, after_kill=True) >= 200, 300, "200 after the kill")
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=180)

    # Every acknowledged call is in the database, whichever replica answered it.
    acknowledged = [o.completion_id for o in outcomes if o.status == 200]
    stored = {
        r["completion_id"]
        for r in pair.rows(
            "SELECT completion_id FROM calls WHERE completion_id = ANY($1::text[])", acknowledged
        )
    }
    assert len(acknowledged) >= 400
    assert set(acknowledged) <= stored, set(acknowledged) - stored

    # What failed was in flight on "b" when it died (at most one per agent); after that the
    # balancer sent everything to "a".
    failed = [o for o in outcomes if o.status != 200]
    assert len(failed) <= len(workers), Counter(o.status for o in failed)
    after = [o for o in outcomes if o.after_kill and o.status == 200]
    assert {o.replica for o in after} == {"a"}
    with httpx.Client(timeout=120) as http:
        hi = [{"role": "user", "content": "Hi"}]
        tail = [chat(http, pair.url, hi, model="teacher") for _ in range(8)]
        tail += [chat(http, pair.url, hi) for _ in range(2)]  # the policy, on the local engine
    assert [(r.status_code, r.headers[REPLICA_HEADER]) for r in tail] == [(200, "a")] * 10


def _count(
    outcomes: list[Outcome],
    lock: threading.Lock,
    replica: str | None = None,
    after_kill: bool | None = None,
) -> int:
    with lock:
        return sum(
            o.status == 200
            and (replica is None or o.replica == replica)
            and (after_kill is None or o.after_kill == after_kill)
            for o in outcomes
        )
