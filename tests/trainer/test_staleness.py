"""The staleness bound: how many versions behind each sample was generated (along the checkpoint
lineage), the weight the rule gives it, and a training step that drops or down-weights stale
samples (a group only when all its samples are) as configured and reports the counts in the
adapter record serving reads. The loop runs
on a real SQLite store with a recording stand-in for the model (the rule needs no weights)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome
from trainer import checkpoints
from trainer.config import TrainerConfig
from trainer.grpo import TrainingExample
from trainer.loop import SKIPPED, TrainingLoop
from trainer.peft_backend import StepMetrics
from trainer.staleness import lineage, samples_behind, staleness_weight, versions_behind

# ----------------------------------------------------------------- versions behind


def straight(v: int) -> int:
    return v - 1


def test_versions_behind_a_straight_lineage_is_the_difference() -> None:
    ancestors = lineage(5, straight)
    assert ancestors == {5: 0, 4: 1, 3: 2, 2: 3, 1: 4, 0: 5}
    assert versions_behind(5, ancestors, straight) == 0
    assert versions_behind(2, ancestors, straight) == 3
    assert versions_behind(None, ancestors, straight) == 5  # the base model is version 0
    assert versions_behind(0, lineage(0, straight), straight) == 0  # fresh weights = the base


def test_a_rolled_back_branch_counts_through_the_common_ancestor() -> None:
    # 1 <- 2 <- 3 <- 4 <- 5 (5 lost its canary; the trainer went back to 3) and 3 <- 6 <- 7.
    parents = {1: 0, 2: 1, 3: 2, 4: 3, 5: 4, 6: 3, 7: 6}
    ancestors = lineage(7, parents.__getitem__)
    assert versions_behind(6, ancestors, parents.__getitem__) == 1
    assert versions_behind(3, ancestors, parents.__getitem__) == 2
    # 5 -> 4 -> 3, then 3 -> 6 -> 7: four steps apart, though 7 - 5 = 2
    assert versions_behind(5, ancestors, parents.__getitem__) == 4


def test_each_turn_is_as_stale_as_the_version_that_served_it() -> None:
    ancestors = lineage(6, straight)
    assert samples_behind([6, 5, 2, 6], ancestors, straight) == [0, 1, 4, 0]
    assert samples_behind([None, 6], ancestors, straight) == [6, 0]
    assert samples_behind([], ancestors, straight) == []


def test_a_lineage_whose_parent_is_not_older_is_refused() -> None:
    with pytest.raises(ValueError, match="parents come before"):
        lineage(3, lambda v: v)


# ----------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("behind", "bound", "policy", "weight"),
    [
        (0, 4, "drop", 1.0),
        (4, 4, "drop", 1.0),  # at the bound: kept
        (5, 4, "drop", 0.0),
        (5, 4, "downweight", 0.5),
        (7, 4, "downweight", 0.125),  # 0.5 per version past the bound
        (1, 0, "drop", 0.0),  # 0: only what the current weights generated
        (0, 0, "drop", 1.0),
        (1000, None, "drop", 1.0),  # no bound
    ],
)
def test_staleness_weight(behind: int, bound: int | None, policy: str, weight: float) -> None:
    got = staleness_weight(behind, max_staleness=bound, policy=policy, stale_weight=0.5)
    assert got == pytest.approx(weight)


def test_an_unknown_stale_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="stale policy"):
        staleness_weight(9, max_staleness=1, policy="hold", stale_weight=0.5)


# ----------------------------------------------------------------- a step


class RecordingTrainer:
    """Stands in for `PeftTrainer`: keeps the examples of each step and writes a version folder
    with its lineage (the loop reads parents from there)."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.max_seq_len = config.max_seq_len or 8192  # the embedded model's context
        self.step = 0
        self.seen: list[list[TrainingExample]] = []

    def train_step(self, examples: Sequence[TrainingExample]) -> StepMetrics:
        self.seen.append(list(examples))
        self.step += 1
        # counted as PeftTrainer counts them (tests/trainer/test_peft_backend.py checks that)
        too_long = sum(
            len(e.prompt_ids) + len(e.completion_ids) > self.max_seq_len for e in examples
        )
        return StepMetrics(
            self.step, 0.1, 2, len(examples), 2, 10, 10, 0.1, 100.0, 1.0, 0, 1, 0, too_long
        )

    def save(self, root: Path, state: dict[str, Any]) -> Path:
        path = checkpoints.version_dir(root, self.step)
        path.mkdir(parents=True)
        (path / checkpoints.TRAINER_STATE).write_text(json.dumps({**state, "step": self.step}))
        return path


async def _scored_group(
    store: Store,
    key: str,
    version: int | None,
    *,
    engine: str = "local",
    params: Sequence[dict[str, Any]] = ({}, {}),
    versions: Sequence[int | None] | None = None,
) -> str:
    """A scored group of two answers with different rewards, both served by `version` (or each
    by its entry in `versions`; `params`: each answer's call parameters)."""
    for i in range(2):
        now = time.time()
        tid = await store.record_call(
            CallRecord(
                id=f"{key}-{i}",
                created_at=now,
                finished_at=now + 0.1,
                model_requested="rlproxy",
                engine=engine,
                request_messages=[{"role": "user", "content": key}],
                params=dict(params[i]),
                prompt_token_ids=[1, 2, 3],
                explicit_trajectory_id=f"{key}-t{i}",
                explicit_group_key=key,
                adapter_version=version if versions is None else versions[i],
                choices=[
                    ChoiceRecord(
                        index=0,
                        message={"role": "assistant", "content": "x"},
                        finish_reason="stop",
                        completion_token_ids=[4, 5],
                        completion_logprobs=[-1.0, -1.0],
                    )
                ],
            )
        )
        await store.add_reward(tid, float(i), "env")
    (group_id,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert await store.claim_group(group_id) == group_id
    await store.finish_scoring(
        group_id, JudgeOutcome(status="scored", scores=[], judge_model="explicit")
    )
    return group_id


async def _loop_at_version(
    store: Store, root: Path, version: int, **config: Any
) -> tuple[TrainingLoop, RecordingTrainer]:
    trainer = RecordingTrainer(TrainerConfig(groups_per_step=1, **config))
    loop = TrainingLoop(store, trainer, root, policy="rlproxy")  # type: ignore[arg-type]
    trainer.step = loop.weights_version = version  # versions 1..version trained straight on
    return loop, trainer


async def _trained_step(store: Store, group_id: str) -> int | None:
    group = await store.get_group(group_id)
    assert group is not None
    return group.summary.trained_step


@pytest.mark.asyncio(loop_scope="session")
async def test_a_step_drops_a_stale_group_and_trains_on_a_fresh_one(
    store: Store, tmp_path: Path
) -> None:
    stale = await _scored_group(store, "old", None)  # the base model: 5 versions behind
    fresh = await _scored_group(store, "new", 3)  # 2 behind
    loop, trainer = await _loop_at_version(store, tmp_path / "ckpt", 5, max_staleness=2)
    report = await loop.step_once()
    assert report is not None and report.group_ids == [fresh]
    (examples,) = trainer.seen
    assert {e.behaviour_version for e in examples} == {3}
    assert all(e.weight == 1.0 for e in examples)
    assert await _trained_step(store, stale) == SKIPPED  # never trained on, never taken again
    assert await _trained_step(store, fresh) == 6
    m = report.metrics
    assert (m["stale_dropped"], m["stale_downweighted"], m["staleness_max"]) == (1, 0, 2)
    assert (m["stale_dropped_total"], m["groups_trained_total"]) == (1, 1)
    # serving reads the counts from the adapter record the loop wrote
    newest = await store.latest_adapter("rlproxy")
    assert newest is not None and (newest.metrics or {})["stale_dropped_total"] == 1


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stale_member_is_left_out_and_its_fresh_neighbour_trains(
    store: Store, tmp_path: Path
) -> None:
    # the base model answered one member (the watch's control arm, an old canary's baseline):
    # 5 behind; version 4 the other, 1 behind. The stale one is left out of the loss, but its
    # reward still counts in the group's baseline, so the fresh member keeps its advantage.
    group = await _scored_group(store, "mixed", None, versions=(None, 4))
    loop, trainer = await _loop_at_version(store, tmp_path / "ckpt", 5, max_staleness=2)
    report = await loop.step_once()
    assert report is not None and report.group_ids == [group]
    (examples,) = trainer.seen
    assert [e.behaviour_version for e in examples] == [4]
    assert examples[0].advantage > 0  # reward 1 against the stale member's 0
    m = report.metrics
    assert (m["stale_dropped"], m["stale_samples_dropped"], m["staleness_max"]) == (0, 1, 1)
    assert m["stale_samples_dropped_total"] == 1
    assert await _trained_step(store, group) == 6


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stale_group_is_down_weighted_as_configured(store: Store, tmp_path: Path) -> None:
    group = await _scored_group(store, "old", 1)  # 4 behind version 5: 2 past the bound
    loop, trainer = await _loop_at_version(
        store, tmp_path / "ckpt", 5, max_staleness=2, stale_policy="downweight", stale_weight=0.5
    )
    report = await loop.step_once()
    assert report is not None and report.group_ids == [group]
    (examples,) = trainer.seen
    assert [e.weight for e in examples] == [0.25, 0.25]
    m = report.metrics
    assert (m["stale_dropped"], m["stale_downweighted"], m["stale_downweighted_total"]) == (0, 1, 1)


@pytest.mark.asyncio(loop_scope="session")
async def test_drops_while_no_step_can_run_are_reported_with_the_next_step(
    store: Store, tmp_path: Path
) -> None:
    first = await _scored_group(store, "a", 0)
    loop, trainer = await _loop_at_version(store, tmp_path / "ckpt", 3, max_staleness=1)
    assert await loop.step_once() is None  # the only group is 3 behind: dropped, no step
    assert await _trained_step(store, first) == SKIPPED and trainer.seen == []
    await _scored_group(store, "b", 3)
    report = await loop.step_once()
    assert report is not None
    assert report.metrics["stale_dropped"] == 1 and report.metrics["stale_dropped_total"] == 1
    loop.weights_version = report.version
    await _scored_group(store, "c", 4)
    report = await loop.step_once()
    assert report is not None
    assert report.metrics["stale_dropped"] == 0 and report.metrics["stale_dropped_total"] == 1
    assert report.metrics["groups_trained_total"] == 2


@pytest.mark.asyncio(loop_scope="session")
async def test_without_a_bound_every_group_trains(store: Store, tmp_path: Path) -> None:
    group = await _scored_group(store, "old", None)
    loop, _ = await _loop_at_version(store, tmp_path / "ckpt", 40, max_staleness=None)
    report = await loop.step_once()
    assert report is not None and report.group_ids == [group]
    assert report.metrics["staleness_max"] == 40 and report.metrics["stale_dropped"] == 0


@pytest.mark.asyncio(loop_scope="session")
async def test_turns_too_long_are_counted_over_the_run(store: Store, tmp_path: Path) -> None:
    loop, _ = await _loop_at_version(store, tmp_path / "ckpt", 0, max_seq_len=4)
    for version, key in ((1, "a"), (2, "b")):
        await _scored_group(store, key, version - 1)  # two turns of 3 + 2 tokens each
        report = await loop.step_once()
        assert report is not None
        assert (report.metrics["too_long"], report.metrics["too_long_total"]) == (2, 2 * version)
        loop.weights_version = report.version
    newest = await store.latest_adapter("rlproxy")  # what /metrics and the dashboard read
    assert newest is not None and (newest.metrics or {})["too_long_total"] == 4
