"""Packing a trajectory's turns into one training row (trainer.packing): which turns fold into
the row before them, and the training loop handing the trainer one row per stored agent episode
whose turns continue each other exactly, on a real SQLite store (a recording stand-in for the
model: what is checked is the rows it is given; test_peft_backend checks that a packed row
trains exactly like its turns)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome
from tests.trainer.test_staleness import RecordingTrainer
from trainer.config import TrainerConfig
from trainer.grpo import TrainingExample
from trainer.loop import TrainingLoop
from trainer.packing import pack_turns, turns_in

SYSTEM = [1, 2, 3, 4]
ANSWER_1 = [10, 11, 12]  # a tool call
BETWEEN = [20, 21]  # the tool's result and the template's next assistant header
ANSWER_2 = [13, 14]


def turn(prompt: list[int], completion: list[int], **changes: Any) -> TrainingExample:
    logprobs = [-float(t) / 10 for t in completion]
    return dataclasses.replace(TrainingExample("s", prompt, completion, logprobs, 0.5), **changes)


def two_turns(**second: Any) -> list[TrainingExample]:
    return [turn(SYSTEM, ANSWER_1), turn(SYSTEM + ANSWER_1 + BETWEEN, ANSWER_2, **second)]


def test_a_turn_that_continues_the_last_one_folds_into_its_row() -> None:
    (row,) = pack_turns(two_turns(), max_len=100)
    assert row.prompt_ids == SYSTEM
    assert row.completion_ids == ANSWER_1 + BETWEEN + ANSWER_2
    assert row.completion_mask == (True,) * 3 + (False,) * 2 + (True,) * 2
    # the stored logprobs of both turns where they were sampled, a placeholder between
    assert row.old_logprobs == [-1.0, -1.1, -1.2, 0.0, 0.0, -1.3, -1.4]
    assert (row.sample_id, row.advantage) == ("s", 0.5)
    assert turns_in(row) == 2

    third = turn(SYSTEM + ANSWER_1 + BETWEEN + ANSWER_2 + [22], [15])
    (row,) = pack_turns([*two_turns(), third], max_len=100)
    assert row.completion_ids == ANSWER_1 + BETWEEN + ANSWER_2 + [22, 15]
    assert turns_in(row) == 3


def test_a_turn_rendered_with_other_tokens_keeps_its_own_row() -> None:
    # the template wrote the first answer back with another tokenization of the same text
    retokenized = turn([*SYSTEM, 10, 99, *BETWEEN], ANSWER_2)
    rows = pack_turns([two_turns()[0], retokenized], max_len=100)
    assert rows == [two_turns()[0], retokenized]
    assert [turns_in(r) for r in rows] == [1, 1]
    # a prompt that stops short of the last answer does not continue it either
    short = turn(SYSTEM + ANSWER_1[:2], ANSWER_2)
    assert len(pack_turns([two_turns()[0], short], max_len=100)) == 2


def test_a_tool_call_the_client_rewrote_keeps_its_own_row() -> None:
    """OpenCode resends a tool call cut by max_tokens as a call of its `invalid` tool under the
    same id: the trajectory goes on (storage.linking links it by the call's id), but the next
    prompt holds the rewritten call where the sampled tokens were, so the next turn is not
    packed onto the cut one: each is trained on the prompt it was sampled from."""
    cut = [10, 11, 12]  # `<tool_call>{"name": "read_file", "arguments": {"file`, cut
    rewritten = [10, 40, 41, 42, 43]  # the same opening, then `invalid` and its arguments
    error = [20, 21]  # the tool's error and the next assistant header
    first, second = turn(SYSTEM, cut), turn(SYSTEM + rewritten + error, ANSWER_2)
    assert pack_turns([first, second], max_len=100) == [first, second]
    # A resend that keeps every sampled token and only adds after them still folds in: the
    # sampled tokens are the context the next turn was sampled in.
    completed = turn([*SYSTEM, *cut, 44, 45, *error], ANSWER_2)
    (row,) = pack_turns([first, completed], max_len=100)
    assert row.completion_ids == [*cut, 44, 45, *error, *ANSWER_2]
    assert row.completion_mask == (True,) * 3 + (False,) * 4 + (True,) * 2


def test_a_rewritten_history_starts_a_row_of_its_own() -> None:
    """A coding agent's compaction: the session goes on in the same trajectory (storage.linking
    links it by its session lane, `history_rewritten`), but the turn's prompt is the summary and
    the new message, not the earlier turns' tokens, so it starts a row; the turns after it fold
    into that new row as usual."""
    first, second = two_turns()
    summary = [*SYSTEM, 50, 51, 52]  # the summary, re-read files, the new message
    rewritten = turn(summary, [16, 17])
    after = turn([*summary, 16, 17, 23], [18])
    rows = pack_turns([first, second, rewritten, after], max_len=100)
    assert len(rows) == 2
    assert rows[0].completion_ids == ANSWER_1 + BETWEEN + ANSWER_2
    assert rows[1].prompt_ids == summary and rows[1].completion_ids == [16, 17, 23, 18]
    assert [turns_in(r) for r in rows] == [2, 2]
    assert {r.advantage for r in rows} == {0.5}  # one episode, one reward, one advantage


@pytest.mark.parametrize(
    "second",
    [
        {"sample_id": "other"},
        {"advantage": -0.5},
        {"weight": 0.5},
        {"behaviour_version": 3},  # a hot-swap between the turns
        {"logprobs_masked": True},
    ],
)
def test_turns_that_the_loss_reads_differently_are_not_packed(second: dict[str, Any]) -> None:
    assert len(pack_turns(two_turns(**second), max_len=100)) == 2


def test_a_row_is_not_packed_past_max_len() -> None:
    full = len(SYSTEM + ANSWER_1 + BETWEEN + ANSWER_2)
    assert len(pack_turns(two_turns(), max_len=full)) == 1
    assert len(pack_turns(two_turns(), max_len=full - 1)) == 2


# ----------------------------------------------------------------- the loop's rows


async def _episode(store: Store, key: str, i: int, second_prompt: list[int]) -> None:
    """One stored agent episode of two calls in one trajectory, rewarded i."""
    now = time.time()
    prompts = [SYSTEM, second_prompt]
    answers = [ANSWER_1, ANSWER_2]
    for n in range(2):
        tid = await store.record_call(
            CallRecord(
                id=f"{key}-{i}-{n}",
                created_at=now + n,
                finished_at=now + n + 0.1,
                model_requested="rlproxy",
                engine="local",
                request_messages=[{"role": "user", "content": key}],
                params={},
                prompt_token_ids=prompts[n],
                explicit_trajectory_id=f"{key}-t{i}",
                explicit_group_key=key,
                choices=[
                    ChoiceRecord(
                        index=0,
                        message={"role": "assistant", "content": "x"},
                        finish_reason="stop",
                        completion_token_ids=answers[n],
                        completion_logprobs=[-1.0] * len(answers[n]),
                    )
                ],
            )
        )
    await store.add_reward(tid, float(i), "env")


async def _rows(store: Store, root: Path, second_prompt: list[int], **config: Any) -> list[Any]:
    for i in range(2):
        await _episode(store, "task", i, second_prompt)
    (group_id,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert await store.claim_group(group_id) == group_id
    await store.finish_scoring(
        group_id, JudgeOutcome(status="scored", scores=[], judge_model="explicit")
    )
    trainer = RecordingTrainer(TrainerConfig(groups_per_step=1, **config))
    loop = TrainingLoop(store, trainer, root, policy="rlproxy")  # type: ignore[arg-type]
    assert await loop.step_once() is not None
    (examples,) = trainer.seen
    return examples


@pytest.mark.asyncio(loop_scope="session")
async def test_the_loop_trains_each_episode_as_one_row(store: Store, tmp_path: Path) -> None:
    rows = await _rows(store, tmp_path, SYSTEM + ANSWER_1 + BETWEEN)
    assert len(rows) == 2  # one per episode, not one per call
    for row in rows:
        assert row.prompt_ids == SYSTEM
        assert row.completion_ids == ANSWER_1 + BETWEEN + ANSWER_2
        assert turns_in(row) == 2
    assert sorted(r.advantage for r in rows) == pytest.approx([-1.0, 1.0], abs=1e-5)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_loop_keeps_a_row_per_turn_when_told_or_when_tokens_differ(
    store: Store, tmp_path: Path
) -> None:
    rows = await _rows(store, tmp_path / "a", SYSTEM + ANSWER_1 + BETWEEN, pack_turns=False)
    assert len(rows) == 4 and all(r.completion_mask is None for r in rows)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_loop_keeps_a_row_per_turn_when_the_answer_was_rendered_again(
    store: Store, tmp_path: Path
) -> None:
    rows = await _rows(store, tmp_path, [*SYSTEM, 10, 99, *BETWEEN])
    assert len(rows) == 4 and all(turns_in(r) == 1 for r in rows)


async def _compacted_session(store: Store, session: str, reward: float) -> None:
    """A coding agent's session in one trajectory, linked without explicit ids: two turns by
    the chain, then a rewritten history (compaction) by its session lane."""
    now = time.time()
    system = {"role": "system", "content": "You are a coding agent."}
    ask = {"role": "user", "content": "fix the test"}
    turns = [
        ([system, ask], SYSTEM, ANSWER_1),
        (
            [system, ask, {"role": "assistant", "content": "a"}, {"role": "user", "content": "go"}],
            SYSTEM + ANSWER_1 + BETWEEN,
            ANSWER_2,
        ),
        (
            [system, {"role": "user", "content": "Summary: half done. Go on."}],
            [*SYSTEM, 50, 51],
            [16, 17],
        ),
    ]
    for n, (messages, prompt, answer) in enumerate(turns):
        tid = await store.record_call(
            CallRecord(
                id=f"{session}-{n}",
                created_at=now + n,
                finished_at=now + n + 0.1,
                model_requested="rlproxy",
                engine="local",
                request_messages=messages,
                params={},
                prompt_token_ids=prompt,
                explicit_group_key="task",
                session_lane=session,
                choices=[
                    ChoiceRecord(
                        index=0,
                        message={"role": "assistant", "content": "a"},
                        finish_reason="stop",
                        completion_token_ids=answer,
                        completion_logprobs=[-1.0] * len(answer),
                    )
                ],
            )
        )
    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert [t.history_rewritten for t in detail.turns] == [False, False, True]
    await store.add_reward(tid, reward, "env")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_compacted_session_is_one_episode_in_two_rows(store: Store, tmp_path: Path) -> None:
    """One reward for the whole session: every row of it carries the same advantage."""
    for i, session in enumerate(("sess-a", "sess-b")):
        await _compacted_session(store, session, float(i))
    (group_id,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert await store.claim_group(group_id) == group_id
    await store.finish_scoring(
        group_id, JudgeOutcome(status="scored", scores=[], judge_model="explicit")
    )
    trainer = RecordingTrainer(TrainerConfig(groups_per_step=1))
    loop = TrainingLoop(store, trainer, tmp_path, policy="rlproxy")  # type: ignore[arg-type]
    assert await loop.step_once() is not None
    (rows,) = trainer.seen
    assert len(rows) == 4  # per session: the turns before the rewrite, and the rewritten one
    by_sample: dict[str, list[Any]] = {}
    for row in rows:
        by_sample.setdefault(row.sample_id, []).append(row)
    assert len(by_sample) == 2
    for sample_rows in by_sample.values():
        assert [turns_in(r) for r in sample_rows] == [2, 1]
        assert sample_rows[1].prompt_ids == [*SYSTEM, 50, 51]
        assert len({r.advantage for r in sample_rows}) == 1
    assert sorted({r.advantage for r in rows}) == pytest.approx([-1.0, 1.0], abs=1e-5)
