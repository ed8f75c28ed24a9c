"""The reward policy, decided in the scoring room only: a member trains on the environment's
reward or the judge's score, read from a real SQLite store that returns both side by side."""

from __future__ import annotations

import time

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome, PairedMember, ScoreRecord
from trainer.scoring import pick_reward, read_group, version_rewards


def test_each_policy_prefers_its_source_and_falls_back_to_the_other() -> None:
    assert pick_reward("explicit", 1.0, 0.4) == (1.0, "explicit")
    assert pick_reward("explicit", None, 0.4) == (0.4, "ruler")
    assert pick_reward("ruler", 1.0, 0.4) == (0.4, "ruler")
    assert pick_reward("ruler", 1.0, None) == (1.0, "explicit")
    assert pick_reward("ruler", None, None) == (None, None)
    assert pick_reward("explicit", 0.0, 0.9) == (0.0, "explicit")  # a zero reward is a reward


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'judge'"):
        pick_reward("judge", 1.0, 0.5)


def test_a_canary_comparison_takes_each_versions_rewards_by_the_policy() -> None:
    members = [
        PairedMember(version=1, explicit=0.0, judged=0.9),
        PairedMember(version=2, explicit=1.0, judged=0.1),
        PairedMember(version=2, explicit=None, judged=0.3),
        PairedMember(version=2, explicit=None, judged=None),  # neither: left out
    ]
    assert version_rewards(members, 1, 2, "explicit") == ([0.0], [1.0, 0.3])
    assert version_rewards(members, 1, 2, "ruler") == ([0.9], [0.1, 0.3])


async def _run(store: Store, i: int) -> str:
    now = time.time()
    return await store.record_call(
        CallRecord(
            id=f"call-{i}",
            created_at=now,
            finished_at=now + 0.1,
            model_requested="rlproxy",
            engine="local",
            request_messages=[{"role": "user", "content": f"run {i}"}],
            params={"rlproxy_group_key": "task"},
            prompt_token_ids=[1, 2, 3],
            choices=[
                ChoiceRecord(
                    index=0,
                    message={"role": "assistant", "content": "7"},
                    finish_reason="stop",
                    completion_token_ids=[9, 2],
                    completion_logprobs=[-1.0, -0.5],
                )
            ],
            explicit_group_key="task",
        )
    )


@pytest.mark.asyncio(loop_scope="session")
async def test_read_group_sets_each_members_training_reward(store: Store) -> None:
    a, b = await _run(store, 0), await _run(store, 1)
    for tid in (a, b):
        await store.end_trajectory(tid)
    await store.add_reward(b, 1.0, "env")
    (gid,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert await store.claim_group(gid) == gid
    raw = await store.get_group(gid)
    assert raw is not None
    by_tid = {a: 0.9, b: 0.2}
    scores = [ScoreRecord(m.member_id, by_tid[m.trajectory_id], "", "judge") for m in raw.members]
    assert await store.finish_scoring(gid, JudgeOutcome("scored", scores, "judge"))

    explicit = await read_group(store, gid, "explicit")
    ruler = await read_group(store, gid, "ruler")
    assert explicit is not None and ruler is not None
    chosen = {m.trajectory_id: (m.reward, m.reward_source) for m in explicit.members}
    assert chosen == {a: (pytest.approx(0.9), "ruler"), b: (1.0, "explicit")}
    chosen = {m.trajectory_id: (m.reward, m.reward_source) for m in ruler.members}
    assert chosen == {a: (pytest.approx(0.9), "ruler"), b: (pytest.approx(0.2), "ruler")}
    assert await read_group(store, "no-such-group", "explicit") is None
