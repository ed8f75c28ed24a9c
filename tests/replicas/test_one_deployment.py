"""Two real `rlproxy serve` replicas on one Postgres database act as one deployment.

Each replica has its own data directory (its logs, its trainer's log) and the same checkpoint
volume (`checkpoints/` is one folder, linked into both, as a mounted volume would be), one fresh
Postgres database per module (dropped afterwards), the real embedded model on the local engine,
and the real trainer child (`rlproxy train`) on whichever replica holds the trainer lease.

- A canary's split is the same on both replicas: each conversation (keyed by its trajectory
  id) gets the version the stable hash of its key says, on A and on B.
- An activation (or a return to the base model) made through one replica is what the other
  serves after its next poll.
- SIGKILL the replica holding the trainer lease: its trainer dies with it, the other replica
  takes the trainer lease (and the publisher lease) once they expire and starts its trainer.

Marker `scale` (`make test-scale`): two servers and a trainer take a few minutes on 2 cores.
The shared vLLM case is test_shared_vllm.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.adapters.registry import canary_draw
from tests.e2e.helpers import wait_for
from tests.e2e.test_adapters import write_random_lora
from tests.replicas.cluster import Cluster, Replica, cluster

pytestmark = pytest.mark.scale

SHARE = 0.5
LEASE_S = 3.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("one-deployment")
    # Version 1 is on the volume before either replica starts: the first replica to hold the
    # publisher lease puts it on canary against the base model.
    write_random_lora(model_data_dir, work / "checkpoints" / "rlproxy" / "0001")
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        # The tests' random LoRA is word salad by the forgetting check's measure: it would be
        # held. This suite is about replicas acting as one; the check's: test_forgetting.py.
        "RLPROXY_FORGETTING_CHECK": "false",
        "RLPROXY_LEASE_S": str(LEASE_S),
        "RLPROXY_ROLLOUT": "true",
        "RLPROXY_ROLLOUT_SHARE": str(SHARE),
        "RLPROXY_TRAIN": "true",
        "RLPROXY_TRAINER_RESTART_S": "0.5",
    }
    with cluster(work, model_data_dir, ["a", "b"], env) as c:
        yield c


def _chat(replica: Replica, trajectory: str, model: str = "rlproxy") -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Say a colour ({trajectory})."}],
        "max_tokens": 2,
    }
    r = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json=body,
        headers={"X-RLProxy-Trajectory": trajectory},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _served_version(c: Cluster, completion_id: str) -> int | None:
    rows = c.rows("SELECT adapter_version FROM calls WHERE completion_id = $1", completion_id)
    assert len(rows) == 1, rows
    return rows[0]["adapter_version"]


def _listing(replica: Replica) -> dict[str, Any]:
    return dict(httpx.get(f"{replica.url}/rl/adapters", timeout=30).json())


def _health(replica: Replica) -> dict[str, Any]:
    return dict(httpx.get(f"{replica.url}/health", timeout=30).json())


def test_a_conversation_gets_the_same_canary_version_on_both_replicas(pair: Cluster) -> None:
    a, b = pair.replicas["a"], pair.replicas["b"]
    for replica in (a, b):
        wait_for(
            lambda r=replica: _listing(r)["rollout"]["canary"] == 1,
            60,
            f"replica {replica.name} serving version 1 on canary",
            poll_s=0.3,
        )
    expected: dict[str, int | None] = {}
    for i in range(12):
        trajectory = f"split-{i}"
        expected[trajectory] = 1 if canary_draw(f"t:{trajectory}", "rlproxy", 1) < SHARE else None
    assert set(expected.values()) == {1, None}  # these keys fall on both sides of the split
    for trajectory, version in expected.items():
        on_a = _served_version(pair, _chat(a, trajectory))
        on_b = _served_version(pair, _chat(b, trajectory))
        assert (on_a, on_b) == (version, version), trajectory


def test_an_activation_through_one_replica_is_served_by_the_other(pair: Cluster) -> None:
    a, b = pair.replicas["a"], pair.replicas["b"]
    r = httpx.post(f"{a.url}/rl/adapters/1/activate", timeout=60)
    assert r.status_code == 200, r.text
    listing = wait_for(
        lambda: (
            (d := _listing(b))["rollout"]["canary"] is None
            and any(v["version"] == 1 and v["active"] for v in d["data"])
            and d
        ),
        30,
        "replica b following the activation made through a",
        poll_s=0.2,
    )
    assert listing["rollout"]["baseline"] == 1
    assert {_served_version(pair, _chat(b, f"after-activation-{i}")) for i in range(3)} == {1}
    # back to the base model, through b this time: a follows
    assert httpx.post(f"{b.url}/rl/adapters/0/activate", timeout=60).status_code == 200
    wait_for(
        lambda: not any(v["active"] for v in _listing(a)["data"]),
        30,
        "replica a following the return to the base model made through b",
        poll_s=0.2,
    )
    assert _served_version(pair, _chat(a, "after-base")) is None
    state = pair.rows("SELECT active_version, canary_version, changed_by FROM policy_state")
    assert [tuple(s) for s in state] == [(0, None, "b")]


def test_killing_the_trainer_lease_holder_hands_the_trainer_to_the_other(pair: Cluster) -> None:
    def trainer(name: str) -> dict[str, Any]:
        return dict(_health(pair.replicas[name])["trainer"])

    holder = wait_for(
        lambda: next((n for n in pair.replicas if trainer(n)["state"] == "running"), None),
        120,
        "a replica running the trainer",
        poll_s=0.3,
    )
    other = next(n for n in pair.replicas if n != holder)
    held = trainer(holder)
    standby = trainer(other)
    assert held["lease"]["held"] is True and held["lease"]["holder"] == holder
    assert standby["state"] == "standby" and standby["lease"]["holder"] == holder
    child = held["pid"]
    leases = {r["name"]: r["holder"] for r in pair.rows("SELECT name, holder FROM leases")}
    assert leases["trainer:rlproxy"] == holder

    pair.kill(holder)  # SIGKILL: no lease given up, the trainer child is told by the kernel

    wait_for(lambda: not _alive(child), 60, "the dead replica's trainer to stop", poll_s=0.2)
    took_over = wait_for(
        lambda: (t := trainer(other))["state"] == "running" and t,
        120,
        f"replica {other} taking the trainer lease over",
        poll_s=0.3,
    )
    assert took_over["lease"] == {
        "name": "trainer:rlproxy",
        "replica": other,
        "held": True,
        "holder": other,
    }
    assert _alive(took_over["pid"])
    wait_for(
        lambda: (
            {r["name"]: r["holder"] for r in pair.rows("SELECT name, holder FROM leases")}
            == {"trainer:rlproxy": other, "publisher:rlproxy": other}
        ),
        60,
        "both leases held by the surviving replica",
        poll_s=0.3,
    )
    log = (pair.replicas[other].data_dir / "trainer.log").read_text()
    assert "rlproxy serve: trainer start" in log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by a parent that was SIGKILLed) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
