"""Groups on both backends: forming by source, readiness, splitting, shadow groups, scoring."""

from __future__ import annotations

import time
from typing import Any

import pytest

from storage import ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome, ScoreRecord

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM = {"role": "system", "content": "You solve tasks."}


def _task(text: str, system: dict[str, Any] = SYSTEM) -> list[dict[str, Any]]:
    return [system, {"role": "user", "content": text}]


async def _run(store: Store, make_call: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    """One single-turn run of a task, closed with an end."""
    tid = await store.record_call(make_call(messages, **kw))
    await store.end_trajectory(tid)
    return tid


async def test_repeated_runs_of_a_task_form_a_ready_group(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=4, max_size=8, window_s=600)
    runs = [await _run(store, make_call, _task("add 2 and 3")) for _ in range(3)]
    other = await _run(store, make_call, _task("a different task"))
    result = await store.form_groups(grouper)
    assert result.assigned == 4 and result.ready == []
    page = await store.list_groups(source="task")
    assert sorted(g.member_count for g in page.items) == [1, 3]
    assert all(g.status == "forming" for g in page.items)

    runs.append(await _run(store, make_call, _task("add 2 and 3")))
    result = await store.form_groups(grouper)
    assert result.assigned == 1 and len(result.ready) == 1
    group = await store.get_group(result.ready[0])
    assert group is not None
    assert group.summary.status == "ready" and group.summary.source == "task"
    assert [m.trajectory_id for m in group.members] == runs
    assert other not in [m.trajectory_id for m in group.members]
    member = group.members[0]
    assert member.messages[-1] == {"role": "assistant", "content": "ok"}
    assert member.turns[0].completion_token_ids == [11, 22, 33]
    assert member.turns[0].prompt_token_ids == [1, 2, 3, 4]
    # A second pass adds nothing: every closed trajectory is grouped once.
    again = await store.form_groups(grouper)
    assert again.assigned == 0 and again.ready == []


async def test_open_trajectories_are_not_grouped(store: Store, make_call: Any) -> None:
    await store.record_call(make_call(_task("still running")))
    result = await store.form_groups(SignatureGrouper(min_size=2))
    assert result.assigned == 0


async def test_explicit_key_wins_over_task_signature(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=2)
    a = await _run(store, make_call, _task("one"), explicit_group_key="exp-1")
    b = await _run(store, make_call, _task("two"), explicit_group_key="exp-1")
    c = await _run(store, make_call, _task("one"))
    result = await store.form_groups(grouper)
    assert len(result.ready) == 1
    group = await store.get_group(result.ready[0])
    assert group is not None and group.summary.source == "explicit"
    assert group.summary.key == "exp-1"
    assert {m.trajectory_id for m in group.members} == {a, b}
    singles = await store.list_groups(source="task")
    assert [g.member_count for g in singles.items] == [1]
    assert c in [m.trajectory_id for m in (await store.get_group(singles.items[0].id)).members]  # type: ignore[union-attr]


async def test_window_readiness_and_split(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=4, max_size=5, window_s=60)
    for _ in range(7):
        await _run(store, make_call, _task("big task"))
    result = await store.form_groups(grouper)
    # 7 members, parts of at most 5: one ready part of 5, one forming part of 2.
    assert len(result.ready) == 1
    groups = sorted((await store.list_groups(source="task")).items, key=lambda g: -g.member_count)
    assert [(g.member_count, g.status) for g in groups] == [(5, "ready"), (2, "forming")]
    later = await store.form_groups(grouper, now=time.time() + 61)
    assert later.ready == [groups[1].id]


async def test_lonely_task_moves_to_a_cohort_when_enabled(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=2, window_s=60, cohort=True)
    a = await _run(store, make_call, _task("task a"))
    b = await _run(store, make_call, _task("task b"))
    other_agent = await _run(store, make_call, _task("task c", {"role": "system", "content": "x"}))
    await store.form_groups(grouper)
    assert (await store.list_groups(status="ready")).items == []
    result = await store.form_groups(grouper, now=time.time() + 61)
    assert result.moved == 3
    ready = (await store.list_groups(status="ready")).items
    assert len(ready) == 0  # cohort parts start their own window
    result = await store.form_groups(grouper, now=time.time() + 200)
    cohort = await store.get_group(result.ready[0])
    assert cohort is not None and cohort.summary.source == "cohort"
    assert {m.trajectory_id for m in cohort.members} == {a, b}
    assert other_agent not in {m.trajectory_id for m in cohort.members}
    expired = (await store.list_groups(status="expired")).items
    assert len(expired) == 3


async def test_tasks_asked_once_train_by_default_in_their_agents_cohort(
    store: Store, make_call: Any
) -> None:
    """Live traffic: every task new, asked once. With no setting changed each trajectory waits
    alone for `alone_s`, then joins its agent's cohort, which is ready at min_size."""
    grouper = SignatureGrouper()  # the defaults serve uses
    assert grouper.cohort and grouper.alone_s == 60.0
    tasks = [await _run(store, make_call, _task(f"question {i}")) for i in range(4)]
    other_agent = await _run(store, make_call, _task("q", {"role": "system", "content": "y"}))
    first = await store.form_groups(grouper)
    assert first.assigned == 5 and first.moved == 0 and first.ready == []
    soon = await store.form_groups(grouper, now=time.time() + 30)
    assert soon.moved == 0  # a second run of a task may still come
    later = await store.form_groups(grouper, now=time.time() + 61)
    assert later.moved == 5
    ready = await store.form_groups(grouper, now=time.time() + 62)
    assert len(ready.ready) == 1  # four members: min_size; the other agent waits alone
    cohort = await store.get_group(ready.ready[0])
    assert cohort is not None and cohort.summary.source == "cohort"
    assert {m.trajectory_id for m in cohort.members} == set(tasks)
    assert other_agent not in {m.trajectory_id for m in cohort.members}


async def test_a_task_run_again_within_the_wait_stays_a_task_group(
    store: Store, make_call: Any
) -> None:
    grouper = SignatureGrouper(min_size=2)
    first = await _run(store, make_call, _task("same task"))
    await store.form_groups(grouper)
    second = await _run(store, make_call, _task("same task"))
    result = await store.form_groups(grouper, now=time.time() + 30)
    (group,) = [await store.get_group(g) for g in result.ready]
    assert group is not None and group.summary.source == "task"
    assert [m.trajectory_id for m in group.members] == [first, second]


async def test_cohort_off_leaves_lone_tasks_waiting(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=2, cohort=False)
    await _run(store, make_call, _task("alone a"))
    await _run(store, make_call, _task("alone b"))
    await store.form_groups(grouper)
    result = await store.form_groups(grouper, now=time.time() + 3600)
    assert result.moved == 0 and result.ready == []


async def test_the_queue_says_what_waits_alone_and_since_when(store: Store, make_call: Any) -> None:
    """The figures behind "why is nothing training": lone tasks, a cohort of one, groups below
    the ready size, and ready groups that only a judge can score."""
    grouper = SignatureGrouper(min_size=3, cohort=False)
    before = time.time()
    await _run(store, make_call, _task("asked once a"))
    await _run(store, make_call, _task("asked once b"))
    await _run(store, make_call, _task("twice"))
    await _run(store, make_call, _task("twice"))
    await store.record_call(make_call(_task("still going")))
    await store.form_groups(grouper)
    waiting = (await store.group_queue()).waiting
    assert waiting.alone == 2 and waiting.small == 2 and waiting.alone_cohort == 0
    assert waiting.alone_since is not None and before <= waiting.alone_since <= time.time()
    assert waiting.open_trajectories == 1
    assert waiting.unrewarded_ready == 0 and waiting.held == 0

    ready = await store.form_groups(grouper, now=time.time() + 601)  # the pair: window passed
    assert len(ready.ready) == 1
    waiting = (await store.group_queue()).waiting
    assert waiting.small == 0 and waiting.unrewarded_ready == 1  # no rewards: a judge's job


async def test_a_lone_agents_cohort_of_one_is_counted_apart(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=2)
    await _run(store, make_call, _task("only task of this agent"))
    await store.form_groups(grouper)
    await store.form_groups(grouper, now=time.time() + 61)
    waiting = (await store.group_queue()).waiting
    assert (waiting.alone, waiting.alone_cohort) == (0, 1)


async def test_shadow_samples_form_a_ready_group(store: Store, make_call: Any) -> None:
    record = make_call(_task("shadow me"), answer="picked")
    record.shadow_samples = [
        ChoiceRecord(
            index=i,
            message={"role": "assistant", "content": f"alt {i}"},
            finish_reason="stop",
            completion_token_ids=[100 + i, 7],
            completion_logprobs=[-0.25, -0.5],
        )
        for i in (0, 1, 3)  # the returned answer was row 2 of the batched generation
    ]
    tid = await store.record_call(record)
    groups = (await store.list_groups(source="shadow")).items
    assert len(groups) == 1 and groups[0].status == "ready" and groups[0].member_count == 4
    group = await store.get_group(groups[0].id)
    assert group is not None
    assert [m.member_id for m in group.members] == [
        f"{record.id}:s0",
        f"{record.id}:s1",
        f"{record.id}:c0",
        f"{record.id}:s3",
    ]
    assert [m.returned for m in group.members] == [False, False, True, False]
    assert all(m.trajectory_id == tid for m in group.members)
    assert group.members[2].turns[0].completion_token_ids == [11, 22, 33]
    assert group.members[3].turns[0].completion_token_ids == [103, 7]
    assert group.members[3].messages[-1]["content"] == "alt 3"
    # The trajectory itself shows only what the client saw.
    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert detail.turns[0].response_messages == [{"role": "assistant", "content": "picked"}]


async def test_claim_score_and_rewards(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=2)
    a = await _run(store, make_call, _task("scored task"))
    b = await _run(store, make_call, _task("scored task"))
    (gid,) = (await store.form_groups(grouper)).ready
    assert await store.claim_group() == gid
    assert await store.claim_group() is None  # nothing else ready; no double claim
    await store.finish_scoring(
        gid,
        JudgeOutcome(
            status="scored",
            judge_model="judge-x",
            rubric_hash="abc",
            latency_s=1.5,
            attempts=1,
            prompt_tokens=10,
            completion_tokens=5,
            scores=[
                ScoreRecord(a, 0.9, "good", "judge-x", "abc", 1.5, 10, 5),
                ScoreRecord(b, 0.2, "bad", "judge-x", "abc", 1.5, 10, 5),
            ],
        ),
    )
    await store.add_reward(b, 1.0, "env")
    group = await store.get_group(gid)
    assert group is not None and group.summary.status == "scored"
    assert group.summary.judge_model == "judge-x" and group.summary.judge_attempts == 1
    first, second = group.members
    assert first.ruler is not None and first.ruler.explanation == "good"
    assert (first.explicit_reward, second.explicit_reward) == (None, 1.0)
    assert second.ruler is not None and second.ruler.score == 0.2  # both stay visible
    # Which of them trains is the reward policy's choice (trainer.scoring.rewards), not the store's.
    assert [(m.reward, m.reward_source) for m in group.members] == [(None, None)] * 2

    # A scored group can be claimed again by id (rescoring); a failure keeps its reason.
    assert await store.claim_group(gid) == gid
    await store.finish_scoring(
        gid, JudgeOutcome(status="failed", scores=[], judge_model="judge-x", failure="nope")
    )
    failed = await store.get_group(gid)
    assert failed is not None and failed.summary.status == "failed"
    assert failed.summary.failure == "nope"

    await store.mark_trained([gid], 3)
    assert (await store.list_groups(untrained=True)).items == []


async def test_only_groups_rewarded_throughout_are_scored_without_a_judge(
    store: Store, make_call: Any
) -> None:
    grouper = SignatureGrouper(min_size=2)
    rewarded = [await _run(store, make_call, _task("rewarded task")) for _ in range(2)]
    half = [await _run(store, make_call, _task("half rewarded")) for _ in range(2)]
    for tid, reward in zip(rewarded + half[:1], (0.0, 1.0, 0.5), strict=True):
        await store.add_reward(tid, reward, "env")
    shadow = make_call(_task("shadow task"))
    shadow.shadow_samples = [
        ChoiceRecord(1, {"role": "assistant", "content": "alt"}, "stop", [5], [-0.1])
    ]
    await store.add_reward(await store.record_call(shadow), 1.0, "env")
    ready = set((await store.form_groups(grouper)).ready)
    assert len(ready) == 2

    (settled,) = await store.settle_explicit_groups()
    group = await store.get_group(settled)
    assert group is not None and {m.trajectory_id for m in group.members} == set(rewarded)
    assert (group.summary.status, group.summary.judge_model) == ("scored", "explicit")
    assert [m.explicit_reward for m in group.members] == [0.0, 1.0]
    # The half-rewarded group and the shadow group (its samples carry no reward) wait for a
    # judge; a second pass finds nothing new, and the trainer's read sees the settled group.
    assert await store.settle_explicit_groups() == []
    waiting = {g.id for g in (await store.list_groups(status="ready")).items}
    assert ready - {settled} <= waiting
    assert [g.id for g in (await store.list_groups(status="scored", untrained=True)).items] == [
        settled
    ]


async def test_release_scoring_after_a_crash(store: Store, make_call: Any) -> None:
    await _run(store, make_call, _task("crash"))
    await _run(store, make_call, _task("crash"))
    (gid,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    t = time.time()
    assert await store.claim_group(lease_s=60, now=t) == gid
    assert await store.release_scoring(now=t + 30) == 0  # the lease is live: not a crash
    assert await store.release_scoring(now=t + 61) == 1  # expired: its scorer is gone
    assert await store.claim_group() == gid


async def test_release_one_claimed_group(store: Store, make_call: Any) -> None:
    for task in ("one", "one", "two", "two"):
        await _run(store, make_call, _task(task))
    ready = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert len(ready) == 2
    first, second = await store.claim_group(), await store.claim_group()
    assert {first, second} == set(ready)
    assert await store.release_scoring(first) == 1  # the other stays claimed
    assert await store.claim_group() == first
    assert await store.claim_group() is None


async def test_groups_never_mix_api_keys(store: Store, make_call: Any) -> None:
    """Two keys running the same task (or sending the same explicit group key) form one group
    each: a key sees, and RULER compares, only its own runs."""
    grouper = SignatureGrouper(min_size=2)
    alice = [
        await _run(store, make_call, _task("same task"), owner_key_id="alice") for _ in range(2)
    ]
    bob = [await _run(store, make_call, _task("same task"), owner_key_id="bob") for _ in range(2)]
    shared = [
        await _run(store, make_call, _task(t), owner_key_id=o, explicit_group_key="g")
        for t, o in (("x", "alice"), ("y", "bob"), ("z", "alice"), ("w", "bob"))
    ]
    result = await store.form_groups(grouper)
    assert len(result.ready) == 4
    members: dict[tuple[str, str | None], set[str]] = {}
    for gid in result.ready:
        group = await store.get_group(gid)
        assert group is not None
        key = (group.summary.source, group.summary.owner_key_id)
        members[key] = {m.trajectory_id for m in group.members}
    assert members[("task", "alice")] == set(alice)
    assert members[("task", "bob")] == set(bob)
    assert members[("explicit", "alice")] == {shared[0], shared[2]}
    assert members[("explicit", "bob")] == {shared[1], shared[3]}
    mine = await store.list_groups(owner="alice")
    assert {g.owner_key_id for g in mine.items} == {"alice"} and len(mine.items) == 2
    assert len((await store.list_trajectories(owner="bob")).items) == 4


async def test_deleting_a_keys_data_leaves_the_others(store: Store, make_call: Any) -> None:
    grouper = SignatureGrouper(min_size=2)
    for owner in ("alice", "bob"):
        for _ in range(2):
            tid = await _run(store, make_call, _task("t"), owner_key_id=owner)
            await store.add_reward(tid, 1.0, "env")
    ready = (await store.form_groups(grouper)).ready
    claimed = await store.claim_group(ready[0])
    assert claimed is not None
    counts = await store.delete_key_data("alice")
    assert counts["trajectories"] == 2 and counts["calls"] == 2 and counts["groups"] == 1
    assert counts["rewards"] == 2 and counts["group_members"] == 2
    assert (await store.list_trajectories(owner="alice")).items == []
    assert len((await store.list_trajectories(owner="bob")).items) == 2
    assert [g.owner_key_id for g in (await store.list_groups()).items] == ["bob"]
