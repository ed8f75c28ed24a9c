"""A caller's rate holds across two replicas behind HAProxy when they share Redis.

The replicas run with API keys and a per-key rate of 10 a minute (a token every 6 s), both
naming one Redis (RLPROXY_REDIS_URL: a redis-server of this module's own, so that the last test
can stop it). The balancer alternates between them, so with
per-replica buckets every one of 20 quick requests would be served (10 on each); with the shared
bucket about 10 are, and both replicas refuse the rest. With Redis gone, requests are still
served (each replica counts on its own) and each replica counts the failure in /metrics.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.redis_server import redis_server
from tests.scale.deployment import REPLICA_HEADER, Deployment, deployment

pytestmark = pytest.mark.scale

PER_MINUTE = 10


@pytest.fixture(scope="module")
def redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with redis_server() as running:
        yield running


@pytest.fixture(scope="module")
def keyed(
    tmp_path_factory: pytest.TempPathFactory,
    model_data_dir: Path,
    redis: tuple[str, subprocess.Popen[bytes]],
) -> Iterator[tuple[Deployment, dict[str, str]]]:
    common = {
        "RLPROXY_SCORING": "false",
        "RLPROXY_TRAIN": "false",
        "RLPROXY_PUBLISH_ADAPTERS": "false",
        "RLPROXY_CALLER_REQUESTS_PER_MINUTE": str(PER_MINUTE),
        "RLPROXY_REDIS_URL": redis[0],
        "RLPROXY_KEY_REFRESH_S": "1",
    }
    work = tmp_path_factory.mktemp("scale-limits")
    replicas: dict[str, dict[str, str]] = {"a": {}, "b": {}}
    with deployment(
        work, model_data_dir, replicas, common, keys=["agents", "other", "later"]
    ) as made:
        yield made


def test_a_keys_rate_holds_across_both_replicas(
    keyed: tuple[Deployment, dict[str, str]],
) -> None:
    d, keys = keyed
    answers: list[tuple[int, str, httpx.Response]] = []
    with httpx.Client(headers={"authorization": f"Bearer {keys['agents']}"}, timeout=60) as http:
        for _ in range(2 * PER_MINUTE):
            r = http.get(f"{d.base_url}/models")
            answers.append((r.status_code, r.headers[REPLICA_HEADER], r))
    by = Counter((status, replica) for status, replica, _ in answers)
    served = by[(200, "a")] + by[(200, "b")]
    # A minute's worth (10), plus one more for every 6 s the 20 requests took; per-replica
    # buckets would have served all 20.
    assert PER_MINUTE <= served < 2 * PER_MINUTE - 2, by
    assert by[(429, "a")] and by[(429, "b")], by  # each replica refuses: it saw the other's
    assert set(by) <= {(200, "a"), (200, "b"), (429, "a"), (429, "b")}, by
    for status, _, r in answers:
        if status == 429:
            error = r.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1

    # Another key has its own budget on both replicas.
    with httpx.Client(headers={"authorization": f"Bearer {keys['other']}"}, timeout=60) as http:
        other = [http.get(f"{d.base_url}/models") for _ in range(4)]
    assert [r.status_code for r in other] == [200] * 4
    assert {r.headers[REPLICA_HEADER] for r in other} == {"a", "b"}


def test_with_redis_gone_both_replicas_serve_and_count_the_failure(
    keyed: tuple[Deployment, dict[str, str]], redis: tuple[str, subprocess.Popen[bytes]]
) -> None:
    d, keys = keyed
    redis[1].kill()
    redis[1].wait()
    with httpx.Client(headers={"authorization": f"Bearer {keys['later']}"}, timeout=60) as http:
        answers = [http.get(f"{d.base_url}/models") for _ in range(PER_MINUTE)]
    # Fail open to each replica's own bucket: 10 requests, about 5 on each, all served.
    assert [r.status_code for r in answers] == [200] * PER_MINUTE
    assert {r.headers[REPLICA_HEADER] for r in answers} == {"a", "b"}
    for replica in d.replicas.values():
        metrics = httpx.get(f"{replica.url}/metrics", timeout=30).text
        found = re.search(r"^rlproxy_caller_limit_redis_errors_total (\S+)$", metrics, re.M)
        assert found and float(found.group(1)) >= 1, replica.name
