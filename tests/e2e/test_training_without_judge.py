"""A team with its own rewards and no LLM judge: `RLPROXY_SCORING=false`, explicit groups, every
run rewarded. Groups must still form, be scored from the rewards (no judge call) and train.

Issue 24 found the opposite: group formation ran only inside the scorer's loop, so with scoring
off the trajectories closed and nothing was ever grouped or trained, silently. This is that
user's run, smaller: 16 calls in 4 explicit groups through a real `rlproxy serve` with its
trainer child and publishing on, the scorer off.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, own_server, wait_for

GROUPS, RUNS = 4, 4


@pytest.fixture(scope="module")
def nserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        "RLPROXY_SCORING": "false",
        "RLPROXY_SCORING_INTERVAL_S": "1",
        "RLPROXY_TRAIN": "true",
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_TRAIN_POLL_S": "1",
        "RLPROXY_ADAPTER_POLL_S": "1",
        "RLPROXY_GROUP_MIN_SIZE": str(RUNS),
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": GROUPS, "micro_batch_size": 4}),
    }
    with own_server(tmp_path_factory.mktemp("no-judge-data"), model_data_dir, env) as server:
        yield server


def test_explicit_groups_form_score_and_train_with_scoring_off(nserver: Server) -> None:
    run = uuid.uuid4().hex[:6]
    keys = [f"team-{run}-{g}" for g in range(GROUPS)]
    with OpenAI(base_url=nserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        for g, key in enumerate(keys):
            messages = [
                {"role": "system", "content": "Reply with one word."},
                {"role": "user", "content": f"Name a planet, please ({g})."},
            ]
            for reward in (0.0, 0.25, 0.75, 1.0):
                answer = c.chat.completions.create(
                    model="rlproxy",
                    messages=messages,
                    max_tokens=6,
                    temperature=1.0,
                    extra_headers={"X-RLProxy-Group": key},
                )
                r = httpx.post(
                    f"{nserver.url}/rl/trajectories/{answer.id}/reward",
                    json={"reward": reward, "source": "env"},
                    timeout=30,
                )
                assert r.status_code == 200, r.text

        def scored() -> list[dict[str, Any]] | None:
            r = httpx.get(f"{nserver.url}/rl/groups", params={"source": "explicit"}, timeout=30)
            mine = [g for g in r.json()["data"] if g["key"] in keys]
            done = [g for g in mine if g["status"] == "scored"]
            return done if len(done) == GROUPS else None

        # Grouping runs whatever scoring says; rewarded groups need no judge.
        groups = wait_for(scored, 60, f"{GROUPS} explicit groups scored with scoring off")
        assert all(g["member_count"] == RUNS and g["judge_model"] == "explicit" for g in groups)

        def published() -> bool:
            return "rlproxy@1" in [m.id for m in c.models.list().data]

        wait_for(published, 300, "rlproxy@1 in /v1/models (see trainer.log)")

    rows = db_rows(
        nserver.data_dir,
        "SELECT key, status, trained_step FROM groups WHERE source = 'explicit'",
    )
    assert sorted((r["key"], r["status"], r["trained_step"]) for r in rows) == [
        (key, "scored", 1) for key in sorted(keys)
    ]
