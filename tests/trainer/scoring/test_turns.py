"""Per-turn judging (`trainer.scoring.turns`): each assistant turn judged from what came next.

The prompt, the reply's validation, the vote majority, the mapping of verdicts to a member's
score, retries, and one group through the scorer and the store with a scripted judge that reads
the turn it is shown (it honours `trainer.scoring.ruler.Judge`: one reply per call, in the
documented `{"explanation", "score"}` JSON).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from trainer.scoring.judge_checks import JudgeChecksConfig
from trainer.scoring.ruler import (
    DEFAULT_RUBRIC,
    JudgeError,
    JudgeGroup,
    JudgeMember,
    JudgeReply,
    JudgeReplyInvalid,
    rubric_hash,
)
from trainer.scoring.scoring import Scorer, ScoringConfig
from trainer.scoring.turns import (
    DEFAULT_TURN_RUBRIC,
    DEFAULT_VOTES,
    TurnScoring,
    build_turn_messages,
    majority,
    parse_turn_reply,
    score_of_verdicts,
    turn_positions,
    turn_response_format,
)

SYSTEM = {"role": "system", "content": "You answer with the tools find and get."}
TASK = {"role": "user", "content": "What is the number of the code of lime?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool (unique description).",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
    for name in ("find", "get")
]


def call(call_id: str, name: str, word: str) -> dict[str, Any]:
    arguments = json.dumps({"word": word})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }


def result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def episode() -> list[dict[str, Any]]:
    """find(lime) -> pink, get(pink) -> 17, then the final answer."""
    return [
        SYSTEM,
        TASK,
        call("c1", "find", "lime"),
        result("c1", "pink (code of lime)"),
        call("c2", "get", "pink"),
        result("c2", "17 (number of pink)"),
        said("The number is 17 (final answer)."),
    ]


def verdict(score: int, why: str = "scripted") -> str:
    return json.dumps({"explanation": why, "score": score})


# ----------------------------------------------------------------------------- prompt


def test_turns_are_the_assistant_messages() -> None:
    assert turn_positions(episode()) == [2, 4, 6]
    assert turn_positions([SYSTEM, TASK]) == []


def test_a_turn_is_shown_with_its_task_what_came_before_and_what_came_next() -> None:
    member = JudgeMember("t", episode())
    system, prompt = build_turn_messages(member, 4, TOOLS, DEFAULT_TURN_RUBRIC)
    text = prompt["content"]
    assert system["role"] == "system" and prompt["role"] == "user"
    assert DEFAULT_TURN_RUBRIC in system["content"]
    for part in ("<tools>", "<task>", "<before>", "<turn>", "<what_came_next>"):
        assert text.count(part) == 1, part
    order = [
        text.index(s)
        for s in (
            "unique description",  # the tools
            SYSTEM["content"],
            TASK["content"],
            'find({"word": "lime"})',
            "pink (code of lime)",
            "<turn>",
            'get({"word": "pink"})',
            "<what_came_next>",
            "17 (number of pink)",
        )
    ]
    assert order == sorted(order)
    assert "turn 2 of 3" in text
    turn = text[text.index("<turn>") : text.index("</turn>")]
    assert 'get({"word": "pink"})' in turn and "find(" not in turn
    assert "(final answer)" not in text  # nothing after what came next: no hindsight


def test_the_first_turn_has_nothing_before_it_but_its_task() -> None:
    text = build_turn_messages(JudgeMember("t", episode()), 2, None, DEFAULT_TURN_RUBRIC)[1][
        "content"
    ]
    assert "<before>" not in text and "<tools>" not in text
    after = text[text.index("<what_came_next>") :]
    assert "pink (code of lime)" in after and "17" not in after


def test_the_last_turn_is_judged_on_the_final_state() -> None:
    text = build_turn_messages(JudgeMember("t", episode()), 6, TOOLS, DEFAULT_TURN_RUBRIC)[1][
        "content"
    ]
    turn = text[text.index("<turn>") : text.index("</turn>")]
    assert "(final answer)" in turn and "turn 3 of 3" in text
    after = text[text.index("<what_came_next>") : text.index("</what_came_next>")]
    assert "last message" in after and "final state" in after
    assert "17 (number of pink)" in text[: text.index("<turn>")]


def test_the_reply_format_is_a_strict_verdict_schema() -> None:
    fmt = turn_response_format()
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    schema = fmt["json_schema"]["schema"]
    jsonschema.Draft202012Validator.check_schema(schema)
    for score in (1, 0, -1):
        jsonschema.validate(json.loads(verdict(score)), schema)
    for bad in ('{"explanation": "x", "score": 2}', '{"score": 1}', '{"explanation": "x"}'):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(bad), schema)


# ----------------------------------------------------------------------------- reply


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (verdict(1, "good call"), (1, "good call")),
        (verdict(-1), (-1, "scripted")),
        ('```json\n{"explanation": "ok", "score": 0}\n```', (0, "ok")),
        ('{"explanation": "ok", "score": -1.0}', (-1, "ok")),
    ],
)
def test_parse_reads_a_verdict(content: str, expected: tuple[int, str]) -> None:
    assert parse_turn_reply(content) == expected


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "the reply is empty"),
        ("good", "not valid JSON"),
        ("[1]", 'not a JSON object with a "score"'),
        ('{"explanation": "x", "score": 0.5}', "the score is 0.5, not one of 1, 0, -1"),
        ('{"explanation": "x", "score": true}', "the score is True, not one of 1, 0, -1"),
        ('{"explanation": "x", "score": "1"}', "the score is '1', not one of 1, 0, -1"),
        ('{"explanation": 3, "score": 1}', "the explanation is not a string"),
        ('{"score": 1}', "the explanation is not a string"),
    ],
)
def test_parse_rejects_an_invalid_verdict_saying_why(content: str, reason: str) -> None:
    with pytest.raises(JudgeReplyInvalid, match=re.escape(reason)):
        parse_turn_reply(content)


# ----------------------------------------------------------------------------- votes and scores


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([1, 1, 0], 1),
        ([-1, -1, 1], -1),
        ([0, 0, 1], 0),
        ([1, 1, 1], 1),
        ([1, -1, 0], 0),  # no majority: neutral
        ([1, -1], 0),
        ([1, 1, -1, -1, 0], 0),
        ([-1], -1),
    ],
)
def test_a_turns_verdict_is_the_majority_of_its_votes(votes: list[int], expected: int) -> None:
    assert majority(votes) == expected


def test_a_members_score_is_its_mean_verdict_mapped_to_0_1() -> None:
    assert score_of_verdicts([1, 1]) == 1.0
    assert score_of_verdicts([-1]) == 0.0
    assert score_of_verdicts([1, -1]) == 0.5
    assert score_of_verdicts([0]) == 0.5
    assert score_of_verdicts([1, 0, 0, 1]) == 0.75
    assert score_of_verdicts([1, -1, -1]) == pytest.approx(1 / 3)
    assert score_of_verdicts([]) == 0.5  # no turn to judge: neutral


def test_votes_must_be_at_least_one() -> None:
    assert DEFAULT_VOTES == 3 and TurnScoring().votes == 3
    with pytest.raises(ValueError, match="votes"):
        TurnScoring(votes=0)


# ----------------------------------------------------------------------------- scoring


class TurnJudge:
    """Answers each per-turn call with `rule(prompt text) -> content | exception`; records
    every call."""

    model = "turn-judge"

    def __init__(self, rule: Callable[[str], str | BaseException]) -> None:
        self.rule = rule
        self.calls: list[list[dict[str, Any]]] = []

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply:
        self.calls.append(messages)
        assert response_format == turn_response_format()
        step = self.rule("\n".join(str(m["content"]) for m in messages))
        if isinstance(step, BaseException):
            raise step
        return JudgeReply(step, prompt_tokens=50, completion_tokens=5, cost_usd=0.01)


def turn_of(text: str) -> str:
    return text[text.index("<turn>") : text.index("</turn>")]


def right_answers(text: str) -> str:
    """A judge that knows the answer is 17 by pink: find(lime), get(pink) and "17" are good."""
    turn = turn_of(text)
    good = any(s in turn for s in ('find({"word": "lime"})', 'get({"word": "pink"})', " 17 "))
    return verdict(1 if good else -1, f"turn {'ok' if good else 'wrong'}")


def two_members() -> JudgeGroup:
    wrong = [
        SYSTEM,
        TASK,
        call("c1", "find", "lime"),
        result("c1", "pink (code of lime)"),
        call("c2", "get", "oak"),
        result("c2", "3 (number of oak)"),
        said("The number is 3 (final answer)."),
    ]
    return JudgeGroup("g1", [JudgeMember("right", episode()), JudgeMember("wrong", wrong)], TOOLS)


async def test_every_turn_gets_its_votes_and_each_member_its_mean_verdict() -> None:
    judge = TurnJudge(right_answers)
    result = await TurnScoring(votes=3)(two_members(), judge)
    assert result.status == "scored" and result.failure is None
    right, wrong = result.scores
    assert (right.member_id, right.score) == ("right", 1.0)
    assert (wrong.member_id, wrong.score) == ("wrong", pytest.approx(1 / 3))  # +1, -1, -1
    assert len(judge.calls) == result.attempts == 2 * 3 * 3  # members x turns x votes
    assert result.prompt_tokens == 50 * 18 and result.completion_tokens == 5 * 18
    assert result.cost_usd == pytest.approx(0.18)
    assert result.judge_model == "turn-judge"
    assert result.rubric_hash == rubric_hash(DEFAULT_RUBRIC)  # the group's rubric, as given
    lines = wrong.explanation.splitlines()
    assert "3 votes a turn" in lines[0] and "0.33" in lines[0]
    assert lines[1].startswith("turn 1 (find): good (+1 +1 +1)")
    assert lines[2].startswith("turn 2 (get): bad (-1 -1 -1)")
    assert lines[3].startswith("turn 3 (answer, the last: judged on the final state): bad")
    assert "turn wrong" in lines[3]


async def test_a_split_vote_is_neutral() -> None:
    votes = iter([1, -1, 0] * 3)
    judge = TurnJudge(lambda text: verdict(next(votes)))
    group = JudgeGroup("g", [JudgeMember("only", episode())], None)
    result = await TurnScoring(votes=3, concurrency=1)(group, judge)
    assert result.status == "scored" and result.scores[0].score == 0.5
    assert "neutral (+1 -1 0)" in result.scores[0].explanation


async def test_an_invalid_vote_is_retried_once_with_the_error_stated() -> None:
    replies = iter(["not json", verdict(1)])
    judge = TurnJudge(lambda text: next(replies))
    group = JudgeGroup("g", [JudgeMember("m", [TASK, said("17")])], None)
    result = await TurnScoring(votes=1)(group, judge)
    assert result.status == "scored" and result.scores[0].score == 1.0 and result.attempts == 2
    retry = judge.calls[1]
    assert retry[:2] == judge.calls[0]
    assert retry[2] == {"role": "assistant", "content": "not json"}
    assert "not valid JSON" in retry[3]["content"] and '"score"' in retry[3]["content"]


async def test_a_vote_that_fails_twice_is_dropped_and_the_others_decide() -> None:
    replies = iter(["bad", "still bad", verdict(-1), verdict(-1)])
    judge = TurnJudge(lambda text: next(replies))
    group = JudgeGroup("g", [JudgeMember("m", [TASK, said("42")])], None)
    result = await TurnScoring(votes=3, concurrency=1)(group, judge)
    assert result.status == "scored" and result.scores[0].score == 0.0
    assert "bad (-1 -1; 1 vote failed)" in result.scores[0].explanation
    assert result.attempts == 4


async def test_a_turn_whose_every_vote_fails_fails_the_group_with_the_reason() -> None:
    judge = TurnJudge(lambda text: JudgeError("HTTP 503") if "42" in text else verdict(1))
    group = JudgeGroup(
        "g", [JudgeMember("ok", [TASK, said("17")]), JudgeMember("down", [TASK, said("42")])], None
    )
    result = await TurnScoring(votes=2)(group, judge)
    assert result.status == "failed" and result.scores == []
    assert result.failure == (
        "trajectory 2, turn 1: every vote failed: judge call failed twice: HTTP 503"
    )


async def test_a_backend_bug_fails_the_group_without_retry() -> None:
    judge = TurnJudge(lambda text: RuntimeError("backend bug"))
    group = JudgeGroup("g", [JudgeMember("m", [TASK, said("17")])], None)
    result = await TurnScoring(votes=1)(group, judge)
    assert result.status == "failed" and result.attempts == 1
    assert result.failure == "trajectory 1, turn 1: judge raised RuntimeError: backend bug"


async def test_an_empty_group_fails_without_calling_the_judge() -> None:
    judge = TurnJudge(lambda text: verdict(1))
    result = await TurnScoring()(JudgeGroup("g", [], None), judge)
    assert result.status == "failed" and result.attempts == 0 and judge.calls == []


async def test_cancellation_is_not_swallowed() -> None:
    judge = TurnJudge(lambda text: asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await TurnScoring()(JudgeGroup("g", [JudgeMember("m", episode())], None), judge)


# ----------------------------------------------------------------------------- the scorer


def test_turns_mode_takes_the_turn_rubric_unless_one_is_given() -> None:
    assert ScoringConfig().rubric == DEFAULT_RUBRIC
    assert ScoringConfig(mode="turns").rubric == DEFAULT_TURN_RUBRIC
    assert ScoringConfig(mode="turns", rubric="Mine.").rubric == "Mine."
    with pytest.raises(ValueError, match="votes"):
        ScoringConfig(mode="turns", votes=0)


async def _ready_group(store: Store) -> str:
    """Two runs of one task, stored turn by turn as an agent sends them: the right episode and
    one that calls get with the wrong code."""
    wrong = two_members().members[1].messages
    for n, messages in enumerate((episode(), wrong)):
        trajectory = None
        for position in turn_positions(messages):
            now = time.time()
            record = CallRecord(
                id=f"call-{n}-{position}",
                created_at=now,
                finished_at=now,
                model_requested="rlproxy",
                engine="local",
                request_messages=messages[:position],
                tools=TOOLS,
                choices=[ChoiceRecord(0, messages[position], "stop")],
            )
            trajectory = await store.record_call(record)
        assert trajectory is not None
        await store.end_trajectory(trajectory)
    (gid,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    return gid


@pytest.mark.asyncio(loop_scope="session")
async def test_the_scorer_judges_turns_and_stores_scores_with_the_verdicts(store: Store) -> None:
    judge = TurnJudge(right_answers)
    scorer = Scorer(store, judge, ScoringConfig(mode="turns"))
    gid = await _ready_group(store)
    detail = await scorer.score(gid)
    assert detail is not None and detail.summary.status == "scored"
    assert len(judge.calls) == 2 * 3 * DEFAULT_VOTES
    by_score = sorted(detail.members, key=lambda m: m.ruler.score if m.ruler else -1)
    wrong, right = by_score
    assert right.ruler is not None and right.ruler.score == 1.0
    assert wrong.ruler is not None and wrong.ruler.score == pytest.approx(1 / 3)
    assert wrong.ruler.explanation is not None
    assert "turn 2 (get): bad (-1 -1 -1)" in wrong.ruler.explanation
    assert detail.summary.rubric_hash == rubric_hash(DEFAULT_TURN_RUBRIC)
    assert detail.summary.judge_attempts == 18


@pytest.mark.asyncio(loop_scope="session")
async def test_turns_mode_runs_under_the_judge_checks(store: Store) -> None:
    """A canary (here an empty final answer) is judged turn by turn with the members and kept
    out of the stored scores."""
    judge = TurnJudge(
        lambda text: verdict(-1) if "[assistant]\n(empty)" in turn_of(text) else right_answers(text)
    )
    # hold_unchecked off: one group cannot make a judge proven (test_judge_checks.py tests that)
    # the empty-answer kind (the default, `declined`, answers at the first user message: one turn)
    checks = JudgeChecksConfig(
        seed=3,
        canary_share=1.0,
        position_share=0.0,
        hold_unchecked=False,
        canary_kinds=("empty",),
    )
    config = ScoringConfig(mode="turns", votes=1, checks=checks)
    scorer = Scorer(store, judge, config)
    gid = await _ready_group(store)
    detail = await scorer.score(gid)
    assert detail is not None and detail.summary.status == "scored"
    assert len(judge.calls) == 3 * 3  # two members and the canary, three turns each
    assert sorted(m.ruler.score for m in detail.members if m.ruler) == [pytest.approx(1 / 3), 1.0]
    (row,) = await store.checks_of_judge("turn-judge", rubric_hash(DEFAULT_TURN_RUBRIC))
    assert row.canary_kind == "empty" and row.canary_score is not None
    assert row.canary_member_id not in {m.member_id for m in detail.members}
