"""RULER end to end with the local engine as judge, and the background scorer of `rlproxy serve`.

No judge model is configured, so the served model's base weights judge (a placeholder judge:
the test checks the loop and the contract, not the quality of the scores). Two runs of one task
are ended, the background scorer groups them, judges the group and stores a score in [0, 1] and
an explanation for each member.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, own_server


@pytest.fixture(scope="module")
def lserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "1",
        "RLPROXY_GROUP_MIN_SIZE": "2",
    }
    with own_server(tmp_path_factory.mktemp("ruler-local"), model_data_dir, env) as server:
        yield server


def test_local_judge_scores_a_group_in_the_background(lserver: Server) -> None:
    question = f"What is 2 + 2? ({uuid.uuid4().hex[:4]})"
    with OpenAI(base_url=lserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        runs = []
        for _ in range(2):
            raw = c.chat.completions.with_raw_response.create(
                model="rlproxy",
                messages=[
                    {"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": question},
                ],
                max_tokens=8,
                temperature=1.0,
            )
            rid = raw.headers["x-request-id"]
            (row,) = db_rows(
                lserver.data_dir, "SELECT trajectory_id FROM calls WHERE request_id = ?", (rid,)
            )
            runs.append(row["trajectory_id"])
            assert httpx.post(f"{lserver.url}/rl/trajectories/{runs[-1]}/end").status_code == 200

    deadline = time.monotonic() + 400
    group = None
    while time.monotonic() < deadline:
        groups = httpx.get(f"{lserver.url}/rl/groups", params={"source": "task"}).json()["data"]
        if groups and groups[0]["status"] in ("scored", "failed"):
            group = httpx.get(f"{lserver.url}/rl/groups/{groups[0]['id']}").json()
            break
        time.sleep(2)
    assert group is not None, "the background scorer did not finish the group in time"
    assert group["status"] == "scored", group.get("failure")
    assert group["judge_model"] == "local:rlproxy@base"
    assert sorted(m["trajectory_id"] for m in group["members"]) == sorted(runs)
    for member in group["members"]:
        assert 0.0 <= member["ruler"]["score"] <= 1.0
        assert isinstance(member["ruler"]["explanation"], str)
        assert member["ruler"]["explanation"].strip()
        assert member["reward"] == member["ruler"]["score"]
    # Judge calls are not stored as calls: only the two runs are.
    assert db_rows(lserver.data_dir, "SELECT COUNT(*) AS n FROM calls")[0]["n"] == 2
    log = lserver.log.read_text()
    assert "placeholder" in log
