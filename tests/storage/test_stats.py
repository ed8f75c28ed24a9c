"""The dashboard's figures on both backends: calls per minute, reward per adapter version
(mean ± standard error), the group pipeline, and the whole-table totals of `rlproxy status`."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from storage import Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome, ScoreRecord

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def _rewarded(store: Store, make_call: Any, text: str, version: int | None, reward: float):
    tid = await store.record_call(make_call(_ask(text), adapter_version=version))
    await store.add_reward(tid, reward, "env")
    return tid


async def test_calls_per_minute_counts_every_minute_of_the_window(
    store: Store, make_call: Any
) -> None:
    now = time.time()
    await store.record_call(make_call(_ask("a"), created_at=now - 30))
    await store.record_call(make_call(_ask("b"), None, created_at=now - 20))  # an error
    await store.record_call(make_call(_ask("c"), created_at=now - 90, api_key_id="k1"))
    await store.record_call(make_call(_ask("d"), created_at=now - 3700))  # before the window

    minutes = await store.calls_per_minute(minutes=60, now=now)
    assert len(minutes) == 60
    assert [m.start for m in minutes] == pytest.approx([now - 3600 + 60 * i for i in range(60)])
    assert (minutes[-1].calls, minutes[-1].errors) == (2, 1)
    assert (minutes[-2].calls, minutes[-2].errors) == (1, 0)
    assert sum(m.calls for m in minutes) == 3

    mine = await store.calls_per_minute(minutes=60, now=now, owner="k1")
    assert [m.calls for m in mine if m.calls] == [1] and mine[-2].calls == 1


async def test_reward_per_version_is_mean_and_standard_error_of_the_latest_rewards(
    store: Store, make_call: Any
) -> None:
    first = await _rewarded(store, make_call, "base 1", None, 0.0)
    await store.add_reward(first, 0.2, "env")  # the latest reward of a trajectory counts
    await _rewarded(store, make_call, "base 2", None, 0.4)
    for i, reward in enumerate((0.6, 0.8, 1.0)):
        await _rewarded(store, make_call, f"v3 {i}", 3, reward)
    # A trajectory belongs to the version that served its first call.
    tid = await store.record_call(make_call(_ask("two turns"), adapter_version=5))
    await store.record_call(
        make_call(
            [*_ask("two turns"), {"role": "assistant", "content": "ok"}, *_ask("more")],
            adapter_version=6,
        )
    )
    await store.add_reward(tid, 0.5, "env")
    # A run that began on an upstream model is not the policy's: it is left out.
    upstream = await store.record_call(make_call(_ask("upstream"), engine="upstream"))
    await store.add_reward(upstream, 1.0, "env")

    by_version = {(v.version, v.source): v for v in await store.reward_by_version()}
    assert set(by_version) == {(0, "explicit"), (3, "explicit"), (5, "explicit")}
    base, v3, v5 = by_version[0, "explicit"], by_version[3, "explicit"], by_version[5, "explicit"]
    assert (base.n, v3.n, v5.n) == (2, 3, 1)
    assert base.mean == pytest.approx(0.3) and v3.mean == pytest.approx(0.8)
    assert base.stderr == pytest.approx(math.sqrt(0.02) / math.sqrt(2))
    assert v3.stderr == pytest.approx(0.2 / math.sqrt(3))
    assert v5.stderr is None  # one reward has no spread

    # Only the newest `window` rewards are read.
    newest = await store.reward_by_version(window=3)
    assert [(v.version, v.n) for v in newest] == [(3, 1), (5, 1)]


async def test_judge_scores_are_a_series_of_their_own(store: Store, make_call: Any) -> None:
    a = await store.record_call(make_call(_ask("x"), adapter_version=2, explicit_group_key="g"))
    b = await store.record_call(make_call(_ask("y"), adapter_version=2, explicit_group_key="g"))
    for tid in (a, b):
        await store.end_trajectory(tid)
    (group_id,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert await store.claim_group(group_id) == group_id
    group = await store.get_group(group_id)
    assert group is not None
    scores = [
        ScoreRecord(member_id=m.member_id, score=s, explanation="why", judge_model="j")
        for m, s in zip(group.members, (0.25, 0.75), strict=True)
    ]
    assert await store.finish_scoring(group_id, JudgeOutcome("scored", scores, "j"))

    (ruler,) = await store.reward_by_version()
    assert (ruler.version, ruler.source, ruler.n) == (2, "ruler", 2)
    assert ruler.mean == pytest.approx(0.5)
    assert ruler.stderr == pytest.approx(0.25)
    assert await store.reward_by_version(owner="someone else") == []


async def test_group_queue_and_totals(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=2)
    for key in ("ready", "ready", "scored", "scored", "failed", "failed", "forming"):
        tid = await store.record_call(make_call(_ask(key), explicit_group_key=key))
        await store.end_trajectory(tid)
    await store.form_groups(grouper)
    ids = {g.key: g.id for g in (await store.list_groups()).items}
    assert await store.claim_group(ids["scored"]) == ids["scored"]
    group = await store.get_group(ids["scored"])
    assert group is not None
    scores = [ScoreRecord(m.member_id, 0.5, None, "j") for m in group.members]
    await store.finish_scoring(ids["scored"], JudgeOutcome("scored", scores, "j"))
    assert await store.claim_group(ids["failed"]) == ids["failed"]
    await store.finish_scoring(ids["failed"], JudgeOutcome("failed", [], "j", failure="timeout"))

    queue = await store.group_queue()
    assert queue.counts == {"forming": 1, "ready": 1, "scoring": 0}
    assert queue.untrained_scored == 1
    assert queue.last_scored is not None and queue.last_scored.id == ids["scored"]
    assert queue.last_failed is not None and queue.last_failed.failure == "timeout"
    await store.mark_trained([ids["scored"]], 1)
    assert (await store.group_queue()).untrained_scored == 0
    assert (await store.group_queue(owner="someone else")).counts["ready"] == 0

    totals = await store.totals()
    assert (totals.calls, totals.calls_failed) == (7, 0)
    assert totals.trajectories == {"closed": 7}
    assert totals.groups == {"forming": 1, "ready": 1, "scored": 1, "failed": 1}
    assert (totals.rewards, totals.scores, totals.groups_trained) == (0, 2, 1)


async def test_an_empty_database_has_empty_figures(store: Store) -> None:
    minutes = await store.calls_per_minute(minutes=5)
    assert [m.calls for m in minutes] == [0] * 5
    assert await store.reward_by_version() == []
    queue = await store.group_queue()
    assert queue.counts == {"forming": 0, "ready": 0, "scoring": 0}
    assert queue.last_scored is None and queue.last_failed is None
    totals = await store.totals()
    assert (totals.calls, totals.trajectories, totals.groups) == (0, {}, {})
