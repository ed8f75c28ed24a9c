"""When the background scorer judges (`Scorer._may_judge`): a judge that fails its checks backs
off to one try every `retry_s`, recovers after `RECOVERY_TRIES` passing tries in a row, and one
whose judging keeps failing backs off too; scoring waits while nothing uses the scores.

The decisions are driven here with hand-made check records and a hand-turned clock; no judge is
called (the judge calls themselves, through a real server, are in
tests/e2e/test_serving_first.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from storage.records import JudgeCheckRecord
from trainer.scoring.judge_checks import JudgeChecksConfig
from trainer.scoring.scoring import (
    EARLY_CANARIES,
    FAILURES_IN_A_ROW,
    RECOVERY_TRIES,
    Scorer,
    ScoringConfig,
)

RETRY_S = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class NoJudge:
    model = "openai/judge"

    async def complete(self, messages: Any, response_format: Any) -> Any:
        raise AssertionError("no judge is called in these tests")


def scorer(clock: Clock, wanted: Any = None) -> Scorer:
    config = ScoringConfig(checks=JudgeChecksConfig(), retry_s=RETRY_S)
    return Scorer(None, NoJudge(), config, wanted=wanted, clock=clock)  # type: ignore[arg-type]


def check(passed: bool, at: float) -> JudgeCheckRecord:
    return JudgeCheckRecord("g", "openai/judge", "r", 2, created_at=at, canary_passed=passed)


def may(s: Scorer) -> bool:
    return asyncio.run(s._may_judge())


def judge_group(s: Scorer, clock: Clock, stored: list[JudgeCheckRecord], passed: bool) -> None:
    """What `Scorer._judge` does around one judged group: take the try, note the gate."""
    trying = s._take_try()
    new = check(passed, 0.0)  # a check is stamped when stored
    s._note_gate("r", new, stored, trying)
    new.created_at = clock.now
    stored.insert(0, new)


def test_a_judge_that_fails_its_canaries_tries_once_per_retry_and_recovers_after_passes() -> None:
    clock = Clock()
    s = scorer(clock)
    stored: list[JudgeCheckRecord] = []
    for _ in range(EARLY_CANARIES - 1):
        assert may(s)
        judge_group(s, clock, stored, passed=False)
        clock.now += 1
    assert may(s)  # 0/4 canaries: not yet decided
    judge_group(s, clock, stored, passed=False)
    assert not may(s) and s.state == "backing off"
    assert "canaries 0/5 passed" in (s.reason or "")
    assert s.retry_at == clock.now + RETRY_S
    clock.now += RETRY_S - 1
    assert not may(s)
    clock.now += 1
    assert may(s)  # the try
    judge_group(s, clock, stored, passed=False)
    assert not may(s) and s.retry_at == clock.now + RETRY_S  # failed: a whole interval again
    for k in range(RECOVERY_TRIES):
        clock.now = s.retry_at or clock.now
        assert may(s), k
        judge_group(s, clock, stored, passed=True)
        if k < RECOVERY_TRIES - 1:  # passed, not yet recovered: the next try comes sooner
            assert not may(s)
            assert s.retry_at == clock.now + RETRY_S / 10
    clock.now += 1
    assert may(s) and s.state == "judging" and s.retry_at is None
    # Its checks count from the recovery: the failures before it no longer make it back off.
    judge_group(s, clock, stored, passed=True)
    assert may(s)


def test_a_try_is_not_spent_when_no_group_is_ready() -> None:
    clock = Clock()
    s = scorer(clock)
    stored: list[JudgeCheckRecord] = []
    for _ in range(EARLY_CANARIES):
        assert may(s)
        judge_group(s, clock, stored, passed=False)
    assert not may(s)  # backing off from now
    clock.now += RETRY_S
    assert may(s)  # the try is due, but no group was ready: nothing judged
    clock.now += 50
    assert may(s)  # still due when a group comes
    judge_group(s, clock, stored, passed=False)
    assert not may(s) and s.retry_at == clock.now + RETRY_S


def test_a_judge_whose_groups_keep_failing_backs_off() -> None:
    clock = Clock()
    s = scorer(clock)
    for k in range(FAILURES_IN_A_ROW):
        assert may(s), k
        s._failed_in_a_row.append("timeout")
    assert not may(s) and s.state == "backing off"
    assert f"its last {FAILURES_IN_A_ROW} groups failed" in (s.reason or "")
    clock.now += RETRY_S
    assert may(s)
    assert s._take_try()
    s._failed_in_a_row = []  # the try was judged
    assert may(s) and s.retry_at is None


def test_scoring_waits_while_nothing_uses_the_scores_and_keeps_a_back_off() -> None:
    clock = Clock()
    why: list[str | None] = ["no trainer"]

    async def wanted() -> str | None:
        return why[0]

    s = scorer(clock, wanted)
    assert not may(s) and s.state == "waiting" and s.reason == "no trainer"
    why[0] = None
    stored: list[JudgeCheckRecord] = []
    for _ in range(EARLY_CANARIES):
        assert may(s)
        judge_group(s, clock, stored, passed=False)
    assert not may(s)
    retry_at = s.retry_at
    why[0] = "no trainer"
    assert not may(s) and s.state == "waiting"
    why[0] = None
    assert not may(s) and s.state == "backing off" and s.retry_at == retry_at
