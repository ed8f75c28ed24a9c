"""Calls the policy served count as the policy's whichever engine generated them (`local` on
this machine, `vllm` on a GPU stack); calls to upstream models never do. Read by the dashboard's
reward per version and by a canary rollout's evidence, on both backends."""

from __future__ import annotations

import time
from typing import Any

import pytest

from storage import Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome, ScoreRecord

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_rewards_of_calls_served_by_vllm_count_for_their_version(
    store: Store, make_call: Any
) -> None:
    for i, (engine, reward) in enumerate((("vllm", 0.25), ("vllm", 0.75), ("upstream", 1.0))):
        ask = [{"role": "user", "content": f"task {i}"}]
        tid = await store.record_call(make_call(ask, adapter_version=7, engine=engine))
        await store.add_reward(tid, reward, "env")
    by_version = {(v.version, v.source): v for v in await store.reward_by_version()}
    served = by_version[(7, "explicit")]
    assert (served.n, served.mean) == (2, pytest.approx(0.5))


async def test_a_canary_compares_versions_that_vllm_served(store: Store, make_call: Any) -> None:
    since = time.time() - 1
    tids = []
    for i, version in enumerate((None, 4)):
        ask = [{"role": "user", "content": f"canary run {i}"}]
        call = make_call(ask, adapter_version=version, engine="vllm", explicit_group_key="c")
        tid = await store.record_call(call)
        await store.end_trajectory(tid)
        tids.append(tid)
    (group_id,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert await store.claim_group(group_id) == group_id
    group = await store.get_group(group_id)
    assert group is not None
    score = {tids[0]: 0.2, tids[1]: 0.9}
    scores = [ScoreRecord(m.member_id, score[m.trajectory_id], None, "j") for m in group.members]
    assert await store.finish_scoring(group_id, JudgeOutcome("scored", scores, "j"))

    (pair,) = await store.paired_rewards(old=0, new=4, since=since)
    versions = sorted((m.version, m.judged) for m in pair.members)
    assert versions == [(0, pytest.approx(0.2)), (4, pytest.approx(0.9))]
    ruler = {(v.version, v.source): v.mean for v in await store.reward_by_version()}
    assert ruler[(4, "ruler")] == pytest.approx(0.9)
