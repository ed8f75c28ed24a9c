"""Judge checks: canaries, the gate and the drift alarm on hand-made check rows, then the scorer
with scripted in-process judges on a real SQLite file (each honours
`trainer.scoring.ruler.Judge`: one RULER reply in the documented JSON shape). The end-to-end
test through a real server and a judge on loopback is tests/e2e/test_judge_gate.py.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from storage import CallRecord, ChoiceRecord, JudgeCheckRecord, Store
from storage.grouping import SignatureGrouper
from trainer.config import TrainerConfig
from trainer.loop import TrainingLoop
from trainer.scoring.canaries import REFUSAL, insert_canary, make_canary
from trainer.scoring.judge_checks import (
    JudgeChecksConfig,
    agreement_figures,
    drift_report,
    front_loaded,
    gate_decision,
    judge_canary,
)
from trainer.scoring.ruler import JudgeMember, JudgeReply
from trainer.scoring.scoring import Scorer, ScoringConfig

TASK = [{"role": "user", "content": "What is 17 + 25?"}]


def member(text: str, n: int = 0) -> JudgeMember:
    return JudgeMember(f"m{n}", [*TASK, {"role": "assistant", "content": text}])


def check(**fields: Any) -> JudgeCheckRecord:
    return JudgeCheckRecord(
        group_id="g", judge_model="j", rubric_hash="r", member_count=3, **fields
    )


CONFIG = JudgeChecksConfig(
    min_checks=20,
    min_canary_pass=0.8,
    min_self_tau=0.5,
    hold_unchecked=False,
    hold_undecided=False,
    max_checks=200,
)
"""Thresholds of the earlier rule, holding nothing for want of checks or evidence and never
deciding by the point estimate: the tests of one kind's verdict by its bounds."""


# ----------------------------------------------------------------------------- canaries


def test_each_canary_kind_replaces_only_the_final_answer() -> None:
    rng = random.Random(1)
    members = [member("The answer is 42, since 17 + 25 = 42.")]
    empty = make_canary(members, "empty", rng)
    refusal = make_canary(members, "refusal", rng)
    copied = make_canary(members, "copied", rng, other_answer="Paris is the capital.")
    cut = make_canary(members, "truncated", rng)
    assert empty and refusal and copied and cut
    assert [c.messages[-1]["content"] for c in (empty, refusal, copied)] == [
        "",
        REFUSAL,
        "Paris is the capital.",
    ]
    assert cut.messages[-1]["content"] == "The answer is 42, "[:19]
    assert all(c.messages[:-1] == TASK for c in (empty, refusal, copied, cut))
    assert members[0].messages[-1]["content"].startswith("The answer is 42")  # untouched
    # An id like any member's: 32 hex digits, different each time.
    assert re.fullmatch(r"[0-9a-f]{32}", empty.member_id) and empty.member_id != cut.member_id


def test_a_kind_that_cannot_be_made_gives_way_to_the_next() -> None:
    rng = random.Random(2)
    members = [member("42", 0), member("41", 1)]
    assert make_canary(members, "copied", rng) is None  # no other task seen yet
    assert make_canary(members, "truncated", rng) is None  # too short to cut
    canary = insert_canary(members, ["copied", "truncated", "refusal"], rng)
    assert canary is not None and canary.kind == "refusal"
    assert 0 <= canary.position <= len(members)


# ----------------------------------------------------------------------------- the gate


def test_too_few_canaries_cannot_decide() -> None:
    gate = gate_decision([check(canary_passed=False, canary_kind="empty")] * 19, CONFIG)
    assert gate.canary.verdict == "undecided" and gate.decision == "train"
    assert gate.reason is not None and "canaries: 19 of 20 checks, pass rate 0.00" in gate.reason


def test_by_default_a_judge_is_held_until_each_kind_of_check_can_decide() -> None:
    config = JudgeChecksConfig(min_checks=20)
    passing = [check(canary_passed=True, position_tau=1.0)] * 19
    gate = gate_decision(passing, config)
    assert gate.decision == "held" and (gate.reason or "").startswith("judge not proven yet")
    assert "canaries: 19 of 20 checks, pass rate 1.00" in (gate.reason or "")
    # The 20th check of each kind decides: every re-ordering agreed, canaries 20/20 pass.
    assert gate_decision([*passing, passing[0]], config).decision == "train"
    # Canaries alone are not enough while re-orderings are on and have not reached 20.
    canaries_only = [check(canary_passed=True)] * 40
    assert gate_decision(canaries_only, config).decision == "held"
    # A kind that is off (share 0) never holds.
    no_reorder = JudgeChecksConfig(min_checks=20, position_share=0.0)
    gate = gate_decision(canaries_only, no_reorder)
    assert gate.self_agreement.verdict == "off" and gate.decision == "train"
    # A failing kind holds with its own reason, whatever the other has.
    failing = [check(canary_passed=False)] * 20
    gate = gate_decision(failing, config)
    assert gate.decision == "held" and (gate.reason or "").startswith("judge failed")


def test_a_judge_whose_canary_upper_bound_is_below_the_threshold_is_held() -> None:
    # 9 of 20 passed: Wilson 95 % upper bound 0.66 < 0.8
    rows = [check(canary_passed=i < 9, canary_kind="refusal") for i in range(20)]
    gate = gate_decision(rows, CONFIG)
    assert gate.canary.verdict == "fail" and gate.decision == "held"
    assert gate.canary.high == pytest.approx(0.6579, abs=1e-3)
    assert gate.reason is not None and "9/20" in gate.reason
    assert gate.canary.by_kind == {"refusal": {"checks": 20, "passed": 9}}


def test_between_the_bounds_the_gate_trains_unless_told_to_hold_undecided() -> None:
    # 18 of 20: bounds (0.70, 0.97) straddle 0.8
    rows = [check(canary_passed=i < 18) for i in range(20)]
    assert gate_decision(rows, CONFIG).decision == "train"
    strict = JudgeChecksConfig(min_checks=20, min_canary_pass=0.8, hold_undecided=True)
    gate = gate_decision(rows, strict)
    assert gate.decision == "held" and gate.reason and gate.reason.startswith("judge not proven")


def test_a_judge_that_passes_every_canary_passes() -> None:
    gate = gate_decision([check(canary_passed=True)] * 40, CONFIG)  # lower bound 0.912
    assert gate.canary.verdict == "pass" and gate.decision == "train"


def test_a_judge_that_disagrees_with_itself_is_held() -> None:
    # taus alternate -0.2 and 0.2: mean 0, se 0.2 * sqrt(20/19) / sqrt(20); upper 0.09 < 0.5
    rows = [check(position_tau=0.2 if i % 2 else -0.2) for i in range(20)]
    gate = gate_decision(rows, CONFIG)
    assert gate.self_agreement.verdict == "fail" and gate.decision == "held"
    assert gate.self_agreement.mean_tau == pytest.approx(0.0)
    assert "self-agreement" in (gate.reason or "")
    steady = [check(position_tau=0.9 if i % 2 else 0.8) for i in range(20)]
    assert gate_decision(steady, CONFIG).self_agreement.verdict == "pass"


def test_with_the_gate_off_a_failing_judge_still_trains_and_says_so() -> None:
    rows = [check(canary_passed=False)] * 20
    gate = gate_decision(rows, JudgeChecksConfig(gate=False))
    assert gate.decision == "train" and (gate.reason or "").startswith("gate off")


def test_only_the_newest_window_counts() -> None:
    old_failures = [check(canary_passed=False)] * 30
    newer_passes = [check(canary_passed=True)] * 30
    config = JudgeChecksConfig(min_checks=20, max_checks=30, window=30, hold_unchecked=False)
    assert gate_decision([*newer_passes, *old_failures], config).decision == "train"
    assert gate_decision([*old_failures, *newer_passes], config).decision == "held"


def test_a_decided_kind_stays_decided_as_groups_without_it_come_after() -> None:
    """Each kind is read over its own newest `window` checks, not over the newest `window`
    groups: after front-loading a tenth of groups is re-ordered, and a window of 200 groups
    would hold about 20 re-orderings, whose bounds can straddle the threshold again (a good
    judge held once more). Here 60 re-orderings decided "pass"; then 200 groups, a tenth
    re-ordered (mean tau 0.35, spread wide), a fifth with a canary."""
    rng = random.Random(5)
    decided = [
        check(canary_passed=rng.random() < 0.9, position_tau=rng.uniform(-0.3, 1.0))
        for _ in range(60)
    ]
    later = [
        check(
            canary_passed=(rng.random() < 0.9) if n % 5 == 0 else None,
            position_tau=(1.0 if n % 20 == 0 else -0.3) if n % 10 == 0 else None,
        )
        for n in range(200)
    ]
    config = JudgeChecksConfig()
    assert gate_decision(decided, config).self_agreement.verdict == "pass"
    window_of_groups = agreement_figures(later, config)
    assert window_of_groups.checks == 20 and window_of_groups.verdict == "undecided"

    gate = gate_decision([*later, *decided], config)
    assert gate.self_agreement.checks == 80 and gate.self_agreement.verdict == "pass"
    assert gate.canary.checks == 100 and gate.canary.verdict == "pass"
    assert gate.decision == "train" and gate.reason is None
    assert gate.checks == config.window  # the newest groups, for the environment's agreement


def test_environment_agreement_is_averaged_per_day() -> None:
    day = 86400.0
    rows = [
        check(env_members=3, env_spearman=1.0, env_kendall=1.0, created_at=day * 10 + 5),
        check(env_members=3, env_spearman=0.5, env_kendall=0.0, created_at=day * 10 + 9),
        check(env_members=2, env_spearman=-1.0, env_kendall=-1.0, created_at=day * 11),
        check(env_members=None),
    ]
    env = gate_decision(rows, CONFIG).environment
    assert env.groups == 3
    assert env.spearman == pytest.approx(0.5 / 3)
    assert [d["groups"] for d in env.by_day] == [2, 1]
    assert env.by_day[0]["spearman"] == pytest.approx(0.75)
    assert env.by_day[0]["kendall"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- drift


def _halves(recent: dict[str, Any], earlier: dict[str, Any], w: int = 10) -> list[JudgeCheckRecord]:
    return [check(**recent) for _ in range(w)] + [check(**earlier) for _ in range(w)]


def test_reward_climbing_while_canaries_collapse_is_flagged() -> None:
    config = JudgeChecksConfig(drift_window=10, drift_reward_rise=0.1, drift_canary_drop=0.2)
    rows = _halves(
        {"mean_reward": 0.8, "canary_passed": False},
        {"mean_reward": 0.5, "canary_passed": True},
    )
    report = drift_report(rows, config)
    assert report.alarm and report.reason is not None
    assert "0.500 -> 0.800" in report.reason and "canary pass rate 1.00 -> 0.00" in report.reason


def test_reward_climbing_while_lengths_collapse_is_flagged() -> None:
    config = JudgeChecksConfig(drift_window=10, drift_length_ratio=0.5)
    rows = _halves(
        {"mean_reward": 0.9, "completion_tokens_mean": 12.0, "completion_tokens_std": 1.0},
        {"mean_reward": 0.4, "completion_tokens_mean": 40.0, "completion_tokens_std": 9.0},
    )
    report = drift_report(rows, config)
    assert report.alarm and "median completion length 40.0 -> 12.0" in (report.reason or "")


def test_no_alarm_when_reward_is_flat_or_nothing_collapses_or_history_is_short() -> None:
    config = JudgeChecksConfig(drift_window=10)
    flat = _halves(
        {"mean_reward": 0.5, "canary_passed": False}, {"mean_reward": 0.5, "canary_passed": True}
    )
    assert not drift_report(flat, config).alarm
    steady = _halves(
        {"mean_reward": 0.9, "canary_passed": True, "completion_tokens_mean": 30.0},
        {"mean_reward": 0.4, "canary_passed": True, "completion_tokens_mean": 32.0},
    )
    assert not drift_report(steady, config).alarm
    short = _halves({"mean_reward": 0.9, "canary_passed": False}, {"mean_reward": 0.1}, w=10)[:15]
    assert not drift_report(short, config).alarm


# ----------------------------------------------------------------------------- the scorer

Rule = Callable[[list[str], str], list[float]]


class RuleJudge:
    """Scores the answers of each judge prompt with `rule(answers, prompt) -> scores` and replies
    with RULER's documented JSON; records every prompt's answers."""

    def __init__(self, rule: Rule, model: str = "rule-judge") -> None:
        self.rule = rule
        self.model = model
        self.seen: list[list[str]] = []

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply:
        answers = re.findall(
            r'<trajectory id="\d+">\n(?:continues the shared context with:\n\n)?\[assistant\]\n'
            r"(.*?)\n</trajectory>",
            messages[1]["content"],
            re.DOTALL,
        )
        self.seen.append(answers)
        scores = self.rule(answers, messages[1]["content"])
        entries = [
            {"trajectory_id": str(i + 1), "explanation": "scripted", "score": s}
            for i, s in enumerate(scores)
        ]
        return JudgeReply(json.dumps({"scores": entries}), prompt_tokens=10, completion_tokens=5)


GOOD = ("17 + 25 = 42, so the answer is 42.", "The answer is 42 (17 + 25).", "It is 42, surely.")


def _is_bad(answer: str, answers: list[str], prompt: str) -> bool:
    """What a competent judge sees: empty, a refusal, another task's answer, a cut answer."""
    task = re.search(r"Task (\d+):", prompt)
    return (
        answer in ("", "(empty)")
        or answer == REFUSAL
        or task is None
        or not answer.endswith(f"(task {task.group(1)})")
        or any(a != answer and a.startswith(answer) for a in answers)
    )


def honest(answers: list[str], prompt: str) -> list[float]:
    return [
        0.0 if _is_bad(a, answers, prompt) else 0.5 + 0.1 * GOOD.index(a.split(" (task")[0])
        for a in answers
    ]


def prefers_canaries(answers: list[str], prompt: str) -> list[float]:
    return [
        1.0 if _is_bad(a, answers, prompt) else 0.1 + 0.1 * GOOD.index(a.split(" (task")[0])
        for a in answers
    ]


async def _ready_group(store: Store, n: int) -> str:
    """A group of three runs of task n (token ids stored, so training could use it)."""
    for i, text in enumerate(GOOD):
        now = time.time()
        record = CallRecord(
            id=f"call-{n}-{i}",
            created_at=now,
            finished_at=now,
            model_requested="rlproxy",
            engine="local",
            request_messages=[{"role": "user", "content": f"Task {n}: what is 17 + 25?"}],
            choices=[
                ChoiceRecord(
                    0,
                    {"role": "assistant", "content": f"{text} (task {n})"},
                    "stop",
                    completion_token_ids=[1, 2, 3 + i],
                    completion_logprobs=[-0.1, -0.2, -0.3],
                )
            ],
            prompt_token_ids=[7, 8, 9],
        )
        await store.end_trajectory(await store.record_call(record))
    (gid,) = (await store.form_groups(SignatureGrouper(min_size=3))).ready
    return gid


def _scorer(store: Store, judge: RuleJudge, **checks: Any) -> Scorer:
    """A scorer with checks; unless `checks` says otherwise it does not hold a judge for want of
    checks or of evidence (the tests of front-loading and the default hold say so)."""
    config = JudgeChecksConfig(
        seed=3, **{"hold_unchecked": False, "hold_undecided": False, **checks}
    )
    return Scorer(store, judge, ScoringConfig(checks=config))


async def _trainers_read(store: Store) -> list[tuple[str, list[str]]]:
    """The groups and member ids the trainer's read of scored groups returns (`_collect` of the
    real loop; its model is not needed to read)."""
    # the loop reads only its config and the longest row here (8,192: SmolLM2's context)
    backend = SimpleNamespace(config=TrainerConfig(), max_seq_len=8192)
    loop = TrainingLoop(store, backend, Path("unused"), policy="rlproxy")  # type: ignore[arg-type]
    found = await loop._collect(100)
    return [(g.id, [e.sample_id for e in examples]) for g, examples in found.chosen]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_canary_is_judged_but_never_stored_or_trained_on(store: Store) -> None:
    judge = RuleJudge(honest)
    scorer = _scorer(store, judge, canary_share=1.0, position_share=0.0)
    gid = await _ready_group(store, 0)
    detail = await scorer.score(gid)
    assert detail is not None and detail.summary.status == "scored"
    assert len(judge.seen[0]) == 4  # three members and the canary
    member_ids = {m.member_id for m in detail.members}
    assert len(member_ids) == 3 and all(m.ruler is not None for m in detail.members)
    (row,) = await store.checks_of_judge("rule-judge", detail.summary.rubric_hash or "")
    assert row.canary_kind == "declined" and row.canary_passed is True
    assert judge.seen[0].count(REFUSAL) == 1  # the task answered with a refusal
    assert row.canary_member_id not in member_ids and row.canary_score == 0.0
    # The reference is the score of the member it was made from: one of 0.5, 0.6, 0.7.
    assert row.canary_median in (0.5, 0.6, 0.7) and row.decision == "train"
    assert row.mean_reward == pytest.approx(0.6) and row.completion_tokens_mean == 3.0
    read = await _trainers_read(store)
    assert [g for g, _ in read] == [gid]
    assert set(read[0][1]) == member_ids  # the canary is not among the training examples


@pytest.mark.asyncio(loop_scope="session")
async def test_a_judge_preferring_canaries_is_held_and_released_once_it_recovers(
    store: Store,
) -> None:
    bad = RuleJudge(prefers_canaries)
    scorer = _scorer(
        store,
        bad,
        canary_share=1.0,
        canary_kinds=("empty", "refusal", "copied", "truncated"),
        position_share=0.0,
        min_checks=3,
        max_checks=3,
        min_canary_pass=0.6,
        window=3,
    )
    groups = [await _ready_group(store, n) for n in range(4)]
    details = [await scorer.score(g) for g in groups]
    statuses = [d.summary.status if d else None for d in details]
    # 0/1, 0/2: too few to decide; at 0/3 the Wilson upper bound (0.56) is below 0.6
    assert statuses == ["scored", "scored", "held", "held"]
    held = details[3]
    assert held is not None and held.summary.hold_reason is not None
    assert "canary pass rate 0/3" in held.summary.hold_reason
    kinds = [c.canary_kind for c in await store.checks_of_judge("rule-judge", "x", limit=10)]
    assert kinds == []  # another rubric has no checks
    rows = await store.checks_of_judge(bad.model, held.summary.rubric_hash or "")
    assert [r.canary_kind for r in reversed(rows)] == ["empty", "refusal", "copied", "truncated"]
    assert {g for g, _ in await _trainers_read(store)} == set(groups[:2])
    assert await store.held_count() == 2

    # While the judge still fails, nothing is released.
    assert await scorer.release_recovered() == []
    # The same judge model, now honest: three passing canaries fill the window of 3.
    honest_judge = RuleJudge(honest)
    scorer.judge = honest_judge
    recovering = [await scorer.score(await _ready_group(store, n)) for n in range(4, 7)]
    # At max_checks (3) the rate decides: 1/3 in the window fails, 2/3 and 3/3 reach 0.6.
    assert [d.summary.status if d else None for d in recovering] == ["held", "scored", "scored"]
    first = recovering[0]
    assert first is not None
    released = await scorer.release_recovered()
    assert sorted(released) == sorted([*groups[2:], first.id])
    assert await store.held_count() == 0
    while await scorer.score_next() is not None:
        pass
    again = await store.get_group(groups[3])
    assert again is not None and again.summary.status == "scored"
    assert again.summary.hold_reason is None
    assert {m.ruler.score for m in again.members if m.ruler} == {0.5, 0.6, 0.7}  # re-judged
    assert set(groups) <= {g for g, _ in await _trainers_read(store)}


@pytest.mark.asyncio(loop_scope="session")
async def test_a_judge_scoring_everything_alike_fails_its_canaries_and_is_held(
    store: Store,
) -> None:
    # Like the 135M base judge: one score for every member and the canary. It ordered nothing,
    # so it told the canary from nothing: each such check fails ("flat"), though the canary
    # ties its source.
    flat = RuleJudge(lambda answers, _: [0.0] * len(answers), "flat")
    scorer = _scorer(
        store, flat, canary_share=1.0, position_share=0.0, min_checks=3, max_checks=3, window=3
    )
    details = [await scorer.score(await _ready_group(store, n)) for n in range(3)]
    assert [d.summary.status if d else None for d in details] == ["scored", "scored", "held"]
    rows = await store.checks_of_judge("flat", details[0].summary.rubric_hash or "")  # type: ignore[union-attr]
    assert [(r.canary_score, r.canary_median, r.canary_passed) for r in rows] == [
        (0.0, 0.0, False)
    ] * 3
    gate = gate_decision(rows, JudgeChecksConfig(min_checks=3, max_checks=3, window=3))
    outcomes = {"below": 0, "tie": 0, "above": 0, "flat": 3}
    assert gate.decision == "held" and gate.canary.outcomes == outcomes
    assert gate.canary.checks == 3 and gate.canary.passed == 0


@pytest.mark.asyncio(loop_scope="session")
async def test_checks_are_front_loaded_and_a_new_judge_trains_only_once_they_decide(
    store: Store,
) -> None:
    # The default shares (a canary in 20 % of groups, a re-ordering in 10 %) and hold; 3 checks
    # of each kind decide here. An honest judge: every canary below its source, tau 1.
    judge = RuleJudge(honest)
    scorer = _scorer(store, judge, min_checks=3, max_checks=3, hold_unchecked=True)
    first = [await scorer.score(await _ready_group(store, n)) for n in range(3)]
    # Each of the first three groups got a canary (4 answers) and a second, reversed call.
    assert [len(answers) for answers in judge.seen] == [4] * 6
    assert judge.seen[1] == list(reversed(judge.seen[0]))
    # Held until the third check of each kind (its own counted) lets the gate decide.
    assert [d.summary.status if d else None for d in first] == ["held", "held", "scored"]
    assert "judge not proven yet" in (first[0].summary.hold_reason or "")  # type: ignore[union-attr]
    assert {g for g, _ in await _trainers_read(store)} == {first[2].id}  # type: ignore[union-attr]
    # From then on the shares apply: 20 more groups get far fewer than 20 canaries.
    calls = len(judge.seen)
    for n in range(3, 23):
        await scorer.score(await _ready_group(store, n))
    later = judge.seen[calls:]
    assert len(later) < 30 and sum(len(a) == 4 for a in later) < 12
    # The groups held while the judge was unproven are judged again and then train.
    released = await scorer.release_recovered()
    assert sorted(released) == sorted(d.id for d in first[:2] if d)
    while await scorer.score_next() is not None:
        pass
    assert {d.id for d in first if d} <= {g for g, _ in await _trainers_read(store)}


@pytest.mark.asyncio(loop_scope="session")
async def test_a_coin_flip_judge_never_trains_on_the_defaults(store: Store) -> None:
    rng = random.Random(5)
    coin = RuleJudge(lambda answers, _: [rng.random() for _ in answers], "coin")
    scorer = _scorer(store, coin, hold_unchecked=True, hold_undecided=True)  # the defaults
    details = [await scorer.score(await _ready_group(store, n)) for n in range(30)]
    assert {d.summary.status if d else None for d in details} == {"held"}
    reasons = [d.summary.hold_reason or "" for d in details if d]
    assert all(r.startswith("judge not proven yet") for r in reasons[:19])
    assert reasons[-1].startswith("judge failed its checks")
    assert await _trainers_read(store) == []
    assert await scorer.release_recovered() == []


@pytest.mark.asyncio(loop_scope="session")
async def test_a_canary_is_checked_against_the_member_it_was_made_from(store: Store) -> None:
    def fixed(answers: list[str], prompt: str) -> list[float]:
        """Real answers 0.5, 0.6, 0.7; the canary always 0.6."""
        return [0.6 if _is_bad(a, answers, prompt) else honest([a], prompt)[0] for a in answers]

    scorer = _scorer(store, RuleJudge(fixed, "fixed"), canary_share=1.0, position_share=0)
    details = [await scorer.score(await _ready_group(store, n)) for n in range(12)]
    rows = await store.checks_of_judge("fixed", details[0].summary.rubric_hash or "")  # type: ignore[union-attr]
    assert len(rows) == 12
    for r in rows:  # above a source of 0.5 fails; a tie with 0.6 and below 0.7 pass
        assert r.canary_score == 0.6 and r.canary_median in (0.5, 0.6, 0.7)
        assert r.canary_passed is (r.canary_median >= 0.6)
    outcomes = gate_decision(rows, CONFIG).canary.outcomes
    assert outcomes["flat"] == 0 and outcomes["below"] and outcomes["tie"] and outcomes["above"]


def test_the_pairwise_canary_check_on_hand_made_scores() -> None:
    # (canary, its source, every score of the judging): at or below passes, above fails, and one
    # score for everything is "flat" (fails), even though the canary ties its source there.
    assert judge_canary(0.1, 0.4, [0.1, 0.4, 0.9]) == "below"
    assert judge_canary(0.4, 0.4, [0.4, 0.4, 0.9]) == "tie"
    assert judge_canary(0.5, 0.4, [0.5, 0.4, 0.0]) == "above"
    assert judge_canary(0.3, 0.3, [0.3, 0.3, 0.3]) == "flat"


def test_canary_outcomes_are_counted_against_the_source() -> None:
    rows = [
        check(canary_score=0.0, canary_median=0.5, canary_passed=True),
        check(canary_score=0.5, canary_median=0.5, canary_passed=True),
        check(canary_score=0.9, canary_median=0.5, canary_passed=False),
        check(canary_score=0.0, canary_median=0.0, canary_passed=False),
    ]
    figures = gate_decision(rows, CONFIG).canary
    assert figures.outcomes == {"below": 1, "tie": 1, "above": 1, "flat": 1}
    assert (figures.checks, figures.passed) == (4, 2)


@pytest.mark.asyncio(loop_scope="session")
async def test_position_checks_keep_kendalls_tau(store: Store) -> None:
    judge = RuleJudge(honest)
    scorer = _scorer(store, judge, canary_share=0.0, position_share=1.0)
    detail = await scorer.score(await _ready_group(store, 0))
    assert detail is not None and len(judge.seen) == 2
    assert judge.seen[1] == list(reversed(judge.seen[0]))
    (row,) = await store.checks_of_judge(judge.model, detail.summary.rubric_hash or "")
    assert row.position_tau == 1.0 and row.canary_kind is None
    assert detail.summary.judge_attempts == 2 and detail.summary.judge_prompt_tokens == 20

    by_position = RuleJudge(lambda answers, _: [1.0 - 0.3 * i for i in range(len(answers))], "pos")
    scorer = _scorer(store, by_position, canary_share=0.0, position_share=1.0)
    detail = await scorer.score(await _ready_group(store, 1))
    assert detail is not None
    (row,) = await store.checks_of_judge("pos", detail.summary.rubric_hash or "")
    assert row.position_tau == -1.0


@pytest.mark.asyncio(loop_scope="session")
async def test_agreement_with_the_environment_is_kept(store: Store) -> None:
    gid = await _ready_group(store, 0)
    group = await store.get_group(gid)
    assert group is not None
    for m, reward in zip(group.members, (0.0, 1.0, 0.5), strict=True):
        await store.add_reward(m.trajectory_id, reward, "env")
    judge = RuleJudge(honest)
    scorer = Scorer(
        store,
        judge,
        ScoringConfig(
            judge_explicit_groups=True,
            checks=JudgeChecksConfig(canary_share=0.0, position_share=0.0),
        ),
    )
    detail = await scorer.score(gid)
    assert detail is not None
    (row,) = await store.checks_of_judge(judge.model, detail.summary.rubric_hash or "")
    # judge 0.5, 0.6, 0.7 against the environment's 0, 1, 0.5: ranks 1 2 3 vs 1 3 2
    assert row.env_members == 3
    assert row.env_spearman == pytest.approx(0.5)
    assert row.env_kendall == pytest.approx(1 / 3)
    assert row.mean_reward == pytest.approx(0.5)  # explicit rewards win under "explicit"


# ----------------------------------------------------------------------------- the defaults


def test_a_declined_canary_is_the_task_answered_with_a_refusal_and_nothing_else() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "find", "arguments": "{}"}}
    agent = JudgeMember(
        "a",
        [
            {"role": "system", "content": "You look things up."},
            {"role": "user", "content": "What is the number of the code of tulip?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "K7"},
            {"role": "assistant", "content": "It is 41."},
        ],
        [{"type": "function", "function": {"name": "find"}}],
    )
    canary = insert_canary([agent], ["declined"], random.Random(0))
    assert canary is not None and canary.kind == "declined" and canary.source_id == "a"
    assert canary.member.messages == [
        *agent.messages[:2],
        {"role": "assistant", "content": REFUSAL},
    ]
    assert canary.member.tools == agent.tools and canary.member.member_id != "a"


def test_on_the_defaults_a_kind_decides_within_max_checks() -> None:
    config = JudgeChecksConfig()  # 20 to 60 checks, canaries 0.7, tau 0.25, hold undecided
    assert (config.min_checks, config.max_checks) == (20, 60)
    taus = [check(position_tau=0.9 if i % 2 else 0.5) for i in range(60)]  # passes at once
    # 17 of 20 canaries: Wilson (0.64, 0.95) straddles 0.7: being proven, held, with progress.
    rows = [check(canary_passed=i % 20 < 17) for i in range(20)]
    gate = gate_decision([*rows, *taus], config)
    assert gate.canary.verdict == "undecided" and gate.decision == "held"
    assert gate.reason is not None and gate.reason.startswith("judge not proven yet")
    assert "canaries: 20 of 20 checks, pass rate 0.85 [0.64, 0.95]" in gate.reason
    # 44 of 60 (0.73): Wilson (0.61, 0.83) still straddles 0.7, but 60 checks decide by the rate.
    rows = [check(canary_passed=i < 44) for i in range(60)]
    assert gate_decision([*rows, *taus], config).canary.verdict == "pass"
    rows = [check(canary_passed=i < 41) for i in range(60)]  # 0.68
    assert gate_decision([*rows, *taus], config).canary.verdict == "fail"
    # A coin flip's 8 of 20: upper bound 0.62 < 0.7, failed at the 20th check.
    rows = [check(canary_passed=i < 8) for i in range(20)]
    gate = gate_decision([*rows, *taus], config)
    assert gate.canary.verdict == "fail" and gate.decision == "held"
    assert "canary pass rate 8/20 = 0.40 [0.22, 0.61] is below 0.7" in (gate.reason or "")


def test_self_agreement_decides_against_a_quarter() -> None:
    config = JudgeChecksConfig(canary_share=0.0)
    # A 90 % judge: two calls agree on a pair with probability 0.82, tau about 0.64.
    good = [check(position_tau=1.0 if i % 3 else 0.0) for i in range(24)]  # mean 0.67
    assert gate_decision(good, config).self_agreement.verdict == "pass"
    coin = [check(position_tau=0.3 if i % 2 else -0.3) for i in range(20)]  # mean 0
    assert gate_decision(coin, config).self_agreement.verdict == "fail"


def test_an_undecided_kind_stays_front_loaded_until_it_decides_or_reaches_max_checks() -> None:
    config = JudgeChecksConfig()
    undecided = [check(canary_passed=i % 20 < 17, position_tau=1.0) for i in range(20)]
    assert front_loaded(undecided, config) == (True, False)  # re-orderings passed at 20
    assert front_loaded([*undecided] * 3, config) == (False, False)  # 60 canaries: decided
    assert front_loaded([check()] * 120, config) == (False, False)  # stops for good at 2 x 60


def test_the_checks_configuration_refuses_a_rule_that_cannot_decide() -> None:
    with pytest.raises(ValueError, match="max_checks"):
        JudgeChecksConfig(min_checks=30, max_checks=20)
    with pytest.raises(ValueError, match="window"):
        JudgeChecksConfig(max_checks=60, window=50)
    with pytest.raises(ValueError, match="canary_kinds"):
        JudgeChecksConfig(canary_kinds=())
