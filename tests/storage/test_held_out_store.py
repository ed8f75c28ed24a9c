"""Held-out trajectories on both backends: never in a group, read back for the evaluation."""

from __future__ import annotations

import time
from typing import Any

import pytest

from storage import ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.held_out_runs import ServedBy

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM = {"role": "system", "content": "You solve tasks."}


def _task(text: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": text}]


async def test_a_held_out_trajectory_with_a_reward_never_enters_a_group(
    store: Store, make_call: Any
) -> None:
    """Runs of one task, two held out: the trained ones form a ready group and are settled
    from their rewards; the held-out ones, rewarded too, join no group in any pass, not even a
    cohort after their task group would have given up on them."""
    grouper = SignatureGrouper(min_size=2, window_s=1, alone_s=0)
    trained = [await store.record_call(make_call(_task("add 2 and 3"))) for _ in range(2)]
    held = [
        await store.record_call(make_call(_task("add 2 and 3"), held_out=True)) for _ in range(2)
    ]
    for i, tid in enumerate(trained + held):
        await store.add_reward(tid, 0.25 * i, "env")
    for _ in range(3):
        await store.form_groups(grouper, now=time.time() + 3600)
    await store.settle_explicit_groups()
    grouped = {tid: await store.group_ids_of_trajectory(tid) for tid in trained + held}
    assert all(grouped[t] for t in trained)
    assert grouped[held[0]] == [] and grouped[held[1]] == []
    (group,) = set(grouped[trained[0]] + grouped[trained[1]])
    detail = await store.get_group(group)
    assert detail is not None and detail.summary.status == "scored"
    marks = {t: await store.get_trajectory(t) for t in trained + held}
    assert [marks[t].summary.held_out for t in trained + held] == [False, False, True, True]  # type: ignore[union-attr]


async def test_a_held_out_call_with_shadow_samples_forms_no_shadow_group(
    store: Store, make_call: Any
) -> None:
    sample = ChoiceRecord(1, {"role": "assistant", "content": "other"}, "stop", [7], [-0.5])
    kept = await store.record_call(make_call(_task("a"), shadow_samples=[sample]))
    held = await store.record_call(make_call(_task("b"), shadow_samples=[sample], held_out=True))
    assert len(await store.group_ids_of_trajectory(kept)) == 1
    assert await store.group_ids_of_trajectory(held) == []


async def test_a_later_call_keeps_the_mark_of_the_call_that_opened_the_trajectory(
    store: Store, make_call: Any
) -> None:
    first = make_call(_task("go"), held_out=True)
    tid = await store.record_call(first)
    second = [*_task("go"), {"role": "assistant", "content": "ok"}]
    second.append({"role": "user", "content": "on"})
    assert await store.record_call(make_call(second)) == tid
    detail = await store.get_trajectory(tid)
    assert detail is not None and detail.summary.held_out and detail.summary.call_count == 2


async def test_held_out_runs_reads_versions_engines_names_and_the_latest_reward(
    store: Store, make_call: Any
) -> None:
    t0 = time.time()
    a = await store.record_call(make_call(_task("a"), held_out=True, created_at=t0))
    await store.add_reward(a, 0.2, "env")
    await store.add_reward(a, 0.9, "env")  # the latest counts
    b = await store.record_call(
        make_call(_task("b"), held_out=True, adapter_version=3, created_at=t0 + 1)
    )
    b2 = [*_task("b"), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "on"}]
    await store.record_call(
        make_call(b2, held_out=True, adapter_version=4, model_requested="policy@4")
    )
    await store.record_call(make_call(_task("c"), created_at=t0 + 2))  # not held out
    runs = await store.held_out_runs(limit=10)
    assert [r.trajectory_id for r in runs] == [a, b]  # oldest first
    assert runs[0].explicit_reward == 0.9 and runs[0].status == "closed"
    assert runs[0].served_by == (ServedBy(0, "local", "policy"),)
    assert runs[1].explicit_reward is None and runs[1].status == "open"
    assert runs[1].served_by == (ServedBy(3, "local", "policy"), ServedBy(4, "local", "policy@4"))
    assert [r.trajectory_id for r in await store.held_out_runs(limit=1)] == [b]  # the newest
