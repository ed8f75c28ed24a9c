"""Live traffic through the training loop: tasks asked once form a cohort on a real SQLite
store, and the trainer takes the cohort's advantages against a leave-one-out baseline (the
members are different tasks), while runs of one task keep GRPO's group rule."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome
from tests.trainer.test_staleness import RecordingTrainer
from trainer.config import TrainerConfig
from trainer.grpo import group_advantages
from trainer.loop import TrainingLoop
from trainer.scoring import read_group

REWARDS = [1.0, 0.0, 0.1, 0.0]


async def _once(store: Store, question: str, reward: float) -> None:
    """One task asked once, answered and rewarded by the environment."""
    now = time.time()
    tid = await store.record_call(
        CallRecord(
            id=f"call-{question}",
            created_at=now,
            finished_at=now + 0.1,
            model_requested="rlproxy",
            engine="local",
            request_messages=[
                {"role": "system", "content": "Answer with the number."},
                {"role": "user", "content": question},
            ],
            params={},
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
        )
    )
    await store.add_reward(tid, reward, "env")


async def _advantages(
    store: Store, tmp_path: Path, **config: str
) -> tuple[str, list[float], list[float]]:
    """(the group's source, its members' rewards, their advantages), in member order."""
    for i, reward in enumerate(REWARDS):
        await _once(store, f"What is {i} + {i}?", reward)
    grouper = SignatureGrouper()  # serve's defaults: cohort on, 60 s alone
    await store.form_groups(grouper)
    await store.form_groups(grouper, now=time.time() + 61)
    (group_id,) = (await store.form_groups(grouper, now=time.time() + 62)).ready
    group = await read_group(store, group_id, "explicit")
    assert group is not None
    assert await store.claim_group(group_id) == group_id
    await store.finish_scoring(
        group_id, JudgeOutcome(status="scored", scores=[], judge_model="explicit")
    )
    trainer = RecordingTrainer(TrainerConfig(groups_per_step=1, **config))  # type: ignore[arg-type]
    loop = TrainingLoop(store, trainer, tmp_path, policy="rlproxy")  # type: ignore[arg-type]
    assert await loop.step_once() is not None
    (examples,) = trainer.seen
    by_member = {e.sample_id: e.advantage for e in examples}
    rewards = [float(m.reward) for m in group.members if m.reward is not None]
    return group.summary.source, rewards, [by_member[m.member_id] for m in group.members]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_cohort_of_tasks_asked_once_trains_on_leave_one_out_advantages(
    store: Store, tmp_path: Path
) -> None:
    source, rewards, advantages = await _advantages(store, tmp_path)
    assert source == "cohort" and sorted(rewards) == sorted(REWARDS)
    others = [(sum(rewards) - r) / 3 for r in rewards]
    assert advantages == pytest.approx([r - o for r, o in zip(rewards, others, strict=True)])


@pytest.mark.asyncio(loop_scope="session")
async def test_the_group_rule_for_cohorts_is_a_setting(store: Store, tmp_path: Path) -> None:
    _, rewards, advantages = await _advantages(store, tmp_path, cohort_advantage="group")
    assert advantages == pytest.approx(group_advantages(rewards))


def test_an_unknown_cohort_rule_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="cohort_advantage must be one of"):
        TrainerConfig(cohort_advantage="mean")
