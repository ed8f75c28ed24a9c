"""The scorer keeps its lease while the judge works, and gives up when another replica took the
group: two stores on one SQLite file play two replicas, and a judge that answers only when told
(it honours `trainer.scoring.ruler.Judge`: one RULER reply in the documented JSON shape) holds
the scorer mid-judging as long as the test needs. The lease rules themselves are tested on both
backends in tests/storage/test_scoring_lease.py.

Nothing waits for a fixed time: the tests wait for the states they need.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from trainer.scoring.ruler import JudgeReply
from trainer.scoring.scoring import Scorer, ScoringConfig

pytestmark = pytest.mark.asyncio(loop_scope="session")


class HeldJudge:
    """Answers each member with a score once `release` is set; notes being called and cancelled."""

    model = "held-judge"

    def __init__(self) -> None:
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply:
        self.called.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        schema = response_format["json_schema"]["schema"]
        ids = schema["properties"]["scores"]["items"]["properties"]["trajectory_id"]["enum"]
        scores = [{"trajectory_id": i, "explanation": "fine", "score": 0.5} for i in ids]
        return JudgeReply(json.dumps({"scores": scores}))


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[tuple[Store, Store, str]]:
    """Two stores on one database with one ready group of two runs: (a, b, group id)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}"
    a, b = await Store.open(url), await Store.open(url)
    try:
        for i in range(2):
            now = time.time()
            record = CallRecord(
                id=f"call-{i}",
                created_at=now,
                finished_at=now,
                model_requested="rlproxy",
                engine="local",
                request_messages=[{"role": "user", "content": "Name a color."}],
                choices=[ChoiceRecord(0, {"role": "assistant", "content": f"color {i}"}, "stop")],
            )
            await a.end_trajectory(await a.record_call(record))
        (gid,) = (await a.form_groups(SignatureGrouper(min_size=2))).ready
        yield a, b, gid
    finally:
        await a.close()
        await b.close()


def _lease(tmp_path: Path, gid: str) -> tuple[str | None, float | None]:
    with closing(sqlite3.connect(tmp_path / "rlproxy.db")) as conn:
        row = conn.execute("SELECT claimed_by, lease_until FROM groups WHERE id = ?", (gid,))
        claimed_by, lease_until = row.fetchone()
    return claimed_by, lease_until


async def test_the_lease_is_renewed_while_the_judge_works(
    replicas: tuple[Store, Store, str], tmp_path: Path
) -> None:
    a, _, gid = replicas
    judge = HeldJudge()
    scorer = Scorer(a, judge, ScoringConfig(lease_s=0.3))
    scoring = asyncio.create_task(scorer.score(gid))
    await judge.called.wait()
    owner, first = _lease(tmp_path, gid)
    assert owner == a.instance_id and first is not None

    async def renewed() -> None:
        while (lease := _lease(tmp_path, gid)[1]) is not None and lease <= first:
            await asyncio.sleep(0.02)  # renewed every lease_s / 3

    await asyncio.wait_for(renewed(), timeout=60)  # fails, rather than hangs, if never renewed
    judge.release.set()
    detail = await scoring
    assert detail is not None and detail.summary.status == "scored"
    assert _lease(tmp_path, gid) == (None, None)


async def test_a_scorer_that_lost_its_claim_stops_and_writes_nothing(
    replicas: tuple[Store, Store, str], tmp_path: Path
) -> None:
    a, b, gid = replicas
    judge = HeldJudge()
    scorer = Scorer(a, judge, ScoringConfig(lease_s=0.3))
    scoring = asyncio.create_task(scorer.score(gid))
    await judge.called.wait()
    # Replica B decides A's lease ran out (as it would after A stalled) and takes the group.
    _, lease = _lease(tmp_path, gid)
    assert lease is not None
    assert await b.claim_group(gid, lease_s=600, now=lease + 1) == gid
    await scoring  # A's next renewal finds the claim gone: it stops judging
    assert judge.cancelled
    owner, _ = _lease(tmp_path, gid)
    group = await b.get_group(gid)
    assert group is not None and group.summary.status == "scoring" and owner == b.instance_id
    assert all(m.ruler is None for m in group.members)  # A wrote no score
