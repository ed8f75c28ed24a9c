"""A canary rollout's evidence (`Store.paired_rewards`) on both backends: scored groups that hold
members of both versions, each member's posted reward and judge score side by side (the reward
policy's choice between them is `trainer.scoring.rewards`, tested in tests/trainer/scoring)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from storage import Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome, ScoreRecord

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _scored_group(
    store: Store, make_call: Any, key: str, runs: list[tuple[int | None, float, float | None]]
) -> str:
    """A group of single-call runs: (version that served it, judge score, explicit reward)."""
    tids = []
    for i, (version, _, explicit) in enumerate(runs):
        tid = await store.record_call(
            make_call(
                [{"role": "user", "content": f"{key} run {i}"}],
                adapter_version=version,
                explicit_group_key=key,
            )
        )
        if explicit is not None:
            await store.add_reward(tid, explicit, "env")
        await store.end_trajectory(tid)
        tids.append(tid)
    ready = (await store.form_groups(SignatureGrouper(min_size=len(runs)))).ready
    (group_id,) = ready
    assert await store.claim_group(group_id) == group_id
    group = await store.get_group(group_id)
    assert group is not None
    by_tid = {tid: score for tid, (_, score, _) in zip(tids, runs, strict=True)}
    scores = [
        ScoreRecord(m.member_id, by_tid[m.trajectory_id], None, "judge") for m in group.members
    ]
    assert await store.finish_scoring(group_id, JudgeOutcome("scored", scores, "judge"))
    return group_id


async def test_only_groups_holding_both_versions_count(store: Store, make_call: Any) -> None:
    since = time.time() - 1
    mixed = await _scored_group(
        store, make_call, "mixed", [(None, 0.2, None), (None, 0.4, None), (3, 0.9, None)]
    )
    await _scored_group(store, make_call, "only-new", [(3, 0.1, None), (3, 0.5, None)])
    await _scored_group(store, make_call, "other", [(None, 0.1, None), (2, 0.5, None)])

    (pair,) = await store.paired_rewards(old=0, new=3, since=since)
    assert pair.group_id == mixed
    by_version = sorted((m.version, m.judged) for m in pair.members)
    assert by_version == [(0, pytest.approx(0.2)), (0, pytest.approx(0.4)), (3, pytest.approx(0.9))]
    assert await store.paired_rewards(old=0, new=3, since=time.time() + 60) == []
    assert [p.group_id for p in await store.paired_rewards(old=0, new=2, since=since)] != [mixed]


async def test_explicit_rewards_and_judge_scores_come_side_by_side(
    store: Store, make_call: Any
) -> None:
    since = time.time() - 1
    await _scored_group(store, make_call, "env", [(1, 0.9, 0.0), (2, 0.1, 1.0)])
    (pair,) = await store.paired_rewards(old=1, new=2, since=since)
    members = sorted((m.version, m.explicit, m.judged) for m in pair.members)
    assert members == [(1, 0.0, pytest.approx(0.9)), (2, 1.0, pytest.approx(0.1))]


async def test_several_new_versions_count_on_one_side(store: Store, make_call: Any) -> None:
    """The rollout's watch compares the base with the versions that served in turn."""
    since = time.time() - 1
    spanning = await _scored_group(
        store, make_call, "spanning", [(None, 0.8, None), (5, 0.3, None), (6, 0.2, None)]
    )
    later = await _scored_group(store, make_call, "later", [(None, 0.7, None), (6, 0.1, None)])
    await _scored_group(store, make_call, "no-base", [(5, 0.3, None), (6, 0.2, None)])
    pairs = await store.paired_rewards(old=0, new={5, 6}, since=since)
    assert sorted(p.group_id for p in pairs) == sorted([spanning, later])
    spanning_pair = next(p for p in pairs if p.group_id == spanning)
    assert sorted(m.version for m in spanning_pair.members) == [0, 5, 6]
    assert await store.paired_rewards(old=0, new={0, 5}, since=since) == []
