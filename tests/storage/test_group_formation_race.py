"""Several replicas on one database form groups at the same moment: every trajectory still
joins exactly one group. Without that, two replicas each put the same closed trajectories in a
group of their own, and the trainer trains on those samples twice (seen once in the two-replica
test: versions 1 and 2 from the same two groups)."""

from __future__ import annotations

import asyncio

import pytest

from storage.grouping import SignatureGrouper
from tests.storage.conftest import Database, make_call

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_two_replicas_forming_at_once_put_each_trajectory_in_one_group(
    db: Database,
) -> None:
    replicas = [await db.open() for _ in range(2)]
    grouper = SignatureGrouper(min_size=2, max_size=8)
    trajectories: list[str] = []
    for attempt in range(6):
        for i in range(4):
            tid = await replicas[0].record_call(
                make_call(
                    [{"role": "user", "content": f"task {attempt}"}],
                    explicit_trajectory_id=f"a{attempt}-{i}",
                    explicit_group_key=f"task-{attempt}",
                )
            )
            await replicas[0].add_reward(tid, float(i), "env")
            trajectories.append(tid)
        await asyncio.gather(*(r.form_groups(grouper) for r in replicas))
    memberships = {t: await replicas[1].group_ids_of_trajectory(t) for t in trajectories}
    assert {t: len(g) for t, g in memberships.items() if len(g) != 1} == {}
