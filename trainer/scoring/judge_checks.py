"""Keeping the judge honest: canaries, self-agreement, agreement with the environment, a gate.

Every group the judge scores gets one `JudgeCheckRecord`, stored with its scores:

- canary (a share of groups, `canary_share`): one synthetic member made from a real one, its
  source, and no better than it (`trainer.scoring.canaries`; by default `declined`: the source's
  task answered with a refusal and nothing else) is judged with the group, never stored as a
  member. The check is pairwise: it passes when the judge scores the canary at or below its
  source ("below" or "tie") and fails when above it ("above"), or when the judge gave every
  member and the canary one same score ("flat": it ordered nothing, so it told nothing apart;
  the 135M base judge does this). A tie with the source passes because the premise is "no
  better", not "worse": a task whose reward ignores the final words (the lookup agent's) scores
  a refusal as its source. A judge right on a share p of pairs passes about p of these checks,
  a coin flip half. The check's reference score is stored in `canary_median` (the column's
  older meaning, the real members' median, holds for checks stored before the pairwise rule).
- position (a share of groups, `position_share`): the group is judged a second time with its
  members in reverse order; Kendall's tau-b between the two scorings is kept. The first scoring
  is the one stored; the second call's tokens and cost are added to the group's.
- environment: where members carry both an explicit reward and a judge score, Spearman's rho and
  Kendall's tau-b between the two (per group; `/rl/judge` aggregates them per rubric and day).
- mean reward and completion lengths of the group, for the drift alarm.

Checks are front-loaded: while a kind of check has not decided for a judge and rubric (fewer
than `min_checks`, or its bounds straddle the threshold, up to `max_checks` checks of the kind in
its newest `window`), every group it judges gets that kind, whatever the share; from then on the
shares apply. Front-loading stops for good once a judge and rubric has
`FRONT_LOAD_LIMIT` x `max_checks` checks stored.

The gate, per judge model and rubric, reads each kind over its own newest `window` checks of
that kind (95 % bounds), however many groups came after them: a kind drawn for a share of groups
keeps the evidence that decided it, so once it has `max_checks` checks it stays decided (pass or
fail, as newer checks say) and does not fall back to "undecided" as older checks leave a window
of groups. Each kind decides alone, with a bounded number of checks:

- canary pass rate: with at least `min_checks` canaries, the kind FAILS when the upper Wilson
  bound of its pass rate is below `min_canary_pass` and PASSES when the lower bound is at or
  above it; at `max_checks` canaries it decides by the rate itself (at or above: pass). Below
  `min_checks`, or in between, it is UNDECIDED;
- self-agreement: the same with mean Kendall's tau-b ± 1.96 standard errors against
  `min_self_tau` (at `max_checks` re-orderings, the mean decides). For a judge whose two
  scorings err independently, tau is about (2p - 1)^2 at pair accuracy p: 0.64 at p = 0.9, 0
  for a coin flip; 0.25 is p = 0.75;
- a kind whose share is 0 is off: it never decides and never holds;
- scores are held (the group becomes "held", never trained on) when either fails; while either
  has fewer than `min_checks` checks and `hold_unchecked` is set; and while either is undecided
  with more and `hold_undecided` is set (both the defaults: a judge trains once both pass, and
  a coin-flip judge is held from its first group). Otherwise they train.
  bench/judge_gate_sim.py measures this rule's error rates and checks to a decision.

The decision is taken for each group as it is scored, counting that group's own check. Held scores
stay stored and visible. When the gate of a judge and rubric no longer holds (the judge has
recovered: later checks outweigh the failing ones), the groups it held are put back to "ready" and
judged again (`release_recovered`), a batch per scoring pass; the held scores are never trained
on. Groups held by a judge that is no longer configured stay held (score one again with
`POST /rl/groups/{id}/score`).

Drift alarm (`drift_report`): over the newest 2 x `drift_window` checks of any judge, the recent
half against the earlier one: mean reward up by at least `drift_reward_rise` while the canary
pass rate falls by at least `drift_canary_drop`, or the completion lengths collapse (median of
the groups' mean lengths, or their mean within-group spread, down to `drift_length_ratio` of what
it was). Flagged in `/rl/judge` and logged once when it starts.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from storage.records import GroupDetail, JudgeCheckRecord
from storage.store import Store
from trainer.scoring import judge_stats as st
from trainer.scoring.canaries import DEFAULT_KINDS, KINDS, CanaryKind, final_text, insert_canary
from trainer.scoring.rewards import pick_reward
from trainer.scoring.ruler import (
    Judge,
    JudgeGroup,
    JudgeResult,
    ScoreGroup,
    rubric_hash,
    score_group,
)

logger = logging.getLogger(__name__)

MIN_DRIFT_CANARIES = 5
"""Canary checks each half of the drift window needs before a fall in pass rate counts."""

FRONT_LOAD_LIMIT = 2
"""Front-loading ends once a judge and rubric has this many times `max_checks` checks stored, so a
judge whose re-orderings never give a tau (it scores every member alike) does not pay two calls
a group for ever."""

CanaryOutcome = Literal["below", "tie", "above", "flat"]
"""A canary against its source: at or below it passes, above it or one score for all fails."""


@dataclass
class JudgeChecksConfig:
    canary_share: float = 0.2
    """Share of judged groups that get one canary member."""
    canary_kinds: tuple[CanaryKind, ...] = DEFAULT_KINDS
    """The canary kinds drawn, in rotation (`trainer.scoring.canaries`)."""
    position_share: float = 0.1
    """Share of judged groups judged a second time, members in reverse order."""
    gate: bool = True
    """Hold (never train on) scores from a judge that fails its checks."""
    min_checks: int = 20
    """Checks of a kind (canaries, position checks) before that kind can decide."""
    max_checks: int = 60
    """Checks of a kind at which it decides by its point estimate if its bounds have not."""
    min_canary_pass: float = 0.7
    """The canary pass rate a judge must reach (a judge right on a share p of pairs passes
    about p of its canaries; a coin flip half)."""
    min_self_tau: float = 0.25
    """The mean Kendall's tau between a group's two orderings a judge must reach (about
    (2p - 1)^2 for pair accuracy p: 0.25 is p = 0.75)."""
    window: int = 200
    """Newest checks of each kind (canaries, re-orderings) per judge model and rubric that the
    gate and the figures read; the agreement with environment rewards reads the newest this
    many groups."""
    hold_unchecked: bool = True
    """Hold scores while a kind (share above 0) has fewer than `min_checks` checks: a judge's
    scores train only once its checks can decide. Front-loading makes that its first
    `min_checks` judged groups; the groups held then are judged again once the gate lets the
    judge train (`release_recovered`)."""
    hold_undecided: bool = True
    """Also hold scores while a kind with `min_checks` checks or more has too little evidence to
    decide (its 95 % bounds straddle the threshold); it decides by `max_checks` at the latest."""
    drift_window: int = 50
    """Groups in each half of the drift alarm's comparison."""
    drift_reward_rise: float = 0.1
    """Rise of the mean reward (recent half minus earlier half) that counts as climbing."""
    drift_canary_drop: float = 0.2
    """Fall of the canary pass rate that counts as a collapse."""
    drift_length_ratio: float = 0.5
    """Completion lengths (median or spread) at or below this share of before: a collapse."""
    requeue_batch: int = 50
    """Held groups put back to be judged again per scoring pass once their judge recovers."""
    seed: int | None = None
    """Seed of the draws (which groups get a canary, its kind's member, its position)."""

    def __post_init__(self) -> None:
        for name in ("canary_share", "position_share", "min_canary_pass", "drift_length_ratio"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must lie in [0, 1], not {value}")
        if not -1 <= self.min_self_tau <= 1:
            raise ValueError(f"min_self_tau is a Kendall's tau in [-1, 1], not {self.min_self_tau}")
        for name in ("min_checks", "window", "drift_window", "requeue_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.max_checks < self.min_checks:
            raise ValueError(
                f"max_checks ({self.max_checks}) must be at least min_checks ({self.min_checks})"
            )
        if self.window < self.max_checks:
            raise ValueError(
                f"window ({self.window}) must hold at least max_checks ({self.max_checks}) checks"
            )
        if not self.canary_kinds or not set(self.canary_kinds) <= set(KINDS):
            raise ValueError(
                f"canary_kinds must be one or more of {', '.join(KINDS)}, not {self.canary_kinds}"
            )


# ----------------------------------------------------------------------------- figures

Verdict = Literal["pass", "fail", "undecided", "off"]
"""A kind's verdict; "off" when its share is 0 (it never decides, never holds)."""


@dataclass
class CanaryFigures:
    checks: int
    passed: int
    pass_rate: float | None
    low: float  # 95 % Wilson bounds
    high: float
    verdict: Verdict
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> checks, passed
    outcomes: dict[str, int] = field(default_factory=dict)
    """Checks per outcome of the canary's score against its source's: "below" or "tie" (passed),
    "above" or "flat" (failed)."""


@dataclass
class AgreementFigures:
    checks: int
    mean_tau: float | None
    low: float | None  # mean ± 1.96 standard errors
    high: float | None
    verdict: Verdict


@dataclass
class EnvironmentFigures:
    groups: int  # groups with at least two members carrying both rewards
    spearman: float | None  # mean over those groups
    kendall: float | None
    by_day: list[dict[str, Any]] = field(default_factory=list)  # oldest first


@dataclass
class GateDecision:
    decision: Literal["train", "held"]
    reason: str | None  # why held; or, when training, why it could not decide yet
    canary: CanaryFigures
    self_agreement: AgreementFigures
    environment: EnvironmentFigures
    checks: int


def canary_figures(checks: Sequence[JudgeCheckRecord], config: JudgeChecksConfig) -> CanaryFigures:
    done = [c for c in checks if c.canary_passed is not None][: config.window]
    passed = sum(1 for c in done if c.canary_passed)
    low, high = st.wilson_interval(passed, len(done))
    verdict: Verdict = "off" if config.canary_share == 0 else "undecided"
    if verdict != "off":
        rate = passed / len(done) if done else None
        verdict = _verdict(len(done), rate, low, high, config.min_canary_pass, config)
    by_kind: dict[str, dict[str, int]] = {}
    for c in done:
        entry = by_kind.setdefault(c.canary_kind or "?", {"checks": 0, "passed": 0})
        entry["checks"] += 1
        entry["passed"] += int(bool(c.canary_passed))
    outcomes = {"below": 0, "tie": 0, "above": 0, "flat": 0}
    for c in done:
        if outcome := canary_outcome(c.canary_score, c.canary_median, c.canary_passed):
            outcomes[outcome] += 1
    return CanaryFigures(
        checks=len(done),
        passed=passed,
        pass_rate=passed / len(done) if done else None,
        low=low,
        high=high,
        verdict=verdict,
        by_kind=by_kind,
        outcomes=outcomes,
    )


def _verdict(
    n: int,
    estimate: float | None,
    low: float,
    high: float,
    threshold: float,
    config: JudgeChecksConfig,
) -> Verdict:
    """One kind's verdict from its `n` checks, its estimate and 95 % bounds (module docstring)."""
    if n < config.min_checks or estimate is None:
        return "undecided"
    if high < threshold:
        return "fail"
    if low >= threshold:
        return "pass"
    if n >= config.max_checks:
        return "pass" if estimate >= threshold else "fail"
    return "undecided"


def judge_canary(
    canary_score: float, source_score: float, scores: Sequence[float]
) -> CanaryOutcome:
    """The pairwise canary check: where the judge put the canary against the real member it was
    made from. `scores`: every score of that judging, the canary's included. "flat" when they are
    all one score (the judge ordered nothing); else "below", "tie" (both pass) or "above"."""
    if len(set(scores)) <= 1:
        return "flat"
    if canary_score < source_score:
        return "below"
    return "tie" if canary_score == source_score else "above"


def canary_outcome(
    score: float | None, reference: float | None, passed: bool | None = None
) -> CanaryOutcome | None:
    """A stored check's outcome from its canary score, its reference score (the source's) and
    whether it passed: an equal score that failed was "flat". None when a score is unknown."""
    if score is None or reference is None:
        return None
    if score == reference:
        return "flat" if passed is False else "tie"
    return "below" if score < reference else "above"


def agreement_figures(
    checks: Sequence[JudgeCheckRecord], config: JudgeChecksConfig
) -> AgreementFigures:
    taus = [c.position_tau for c in checks if c.position_tau is not None][: config.window]
    interval = st.mean_interval(taus)
    verdict: Verdict = "off" if config.position_share == 0 else "undecided"
    if verdict != "off" and interval is not None:
        verdict = _verdict(len(taus), *interval, config.min_self_tau, config)
    if interval is None:
        return AgreementFigures(len(taus), taus[0] if taus else None, None, None, verdict)
    return AgreementFigures(len(taus), interval[0], interval[1], interval[2], verdict)


def environment_figures(checks: Sequence[JudgeCheckRecord]) -> EnvironmentFigures:
    rows = [c for c in checks if c.env_members is not None and c.env_members >= 2]
    days: dict[int, list[JudgeCheckRecord]] = {}
    for c in rows:
        days.setdefault(int(c.created_at // 86400), []).append(c)
    return EnvironmentFigures(
        groups=len(rows),
        spearman=_mean([c.env_spearman for c in rows]),
        kendall=_mean([c.env_kendall for c in rows]),
        by_day=[
            {
                "day_start": day * 86400,
                "groups": len(cs),
                "spearman": _mean([c.env_spearman for c in cs]),
                "kendall": _mean([c.env_kendall for c in cs]),
            }
            for day, cs in sorted(days.items())
        ],
    )


def gate_decision(checks: Sequence[JudgeCheckRecord], config: JudgeChecksConfig) -> GateDecision:
    """The gate over one judge and rubric's checks, newest first (`Store.checks_of_judge`): each
    kind over its own newest `config.window` checks, the environment's agreement over the newest
    `config.window` groups; see the module docstring for the rule."""
    newest = list(checks)[: config.window]
    canary = canary_figures(checks, config)
    agreement = agreement_figures(checks, config)
    environment = environment_figures(newest)
    failing: list[str] = []
    unchecked: list[str] = []
    undecided: list[str] = []
    if canary.verdict == "fail":
        failing.append(
            f"canary pass rate {canary.passed}/{canary.checks} = {canary.pass_rate:.2f} "
            f"[{canary.low:.2f}, {canary.high:.2f}] is below {config.min_canary_pass:g}"
        )
    elif canary.verdict == "undecided":
        (unchecked if canary.checks < config.min_checks else undecided).append(
            _canary_progress(canary, config)
        )
    if agreement.verdict == "fail":
        failing.append(
            f"self-agreement mean tau {agreement.mean_tau:.2f} over {agreement.checks} "
            f"re-orderings{_bounds(agreement.low, agreement.high)} is below "
            f"{config.min_self_tau:g}"
        )
    elif agreement.verdict == "undecided":
        (unchecked if agreement.checks < config.min_checks else undecided).append(
            _agreement_progress(agreement, config)
        )
    decision: Literal["train", "held"] = "train"
    reason = None
    if failing:
        decision = "held" if config.gate else "train"
        reason = "judge failed its checks: " + "; ".join(failing)
        if not config.gate:
            reason = "gate off; " + reason
    elif unchecked or undecided:
        held = config.gate and (
            (bool(unchecked) and config.hold_unchecked)
            or (bool(undecided) and config.hold_undecided)
        )
        decision = "held" if held else "train"
        reason = ("judge not proven yet, being proven: " if held else "undecided: ") + "; ".join(
            unchecked + undecided
        )
    return GateDecision(decision, reason, canary, agreement, environment, len(newest))


def _bounds(low: float | None, high: float | None) -> str:
    return "" if low is None or high is None else f" [{low:.2f}, {high:.2f}]"


def _canary_progress(canary: CanaryFigures, config: JudgeChecksConfig) -> str:
    """E.g. "canaries: 12 of 20 checks, pass rate 0.83 [0.55, 0.95] (needs a bound clear of
    0.7; decides by 60 at the latest)"."""
    rate = "-" if canary.pass_rate is None else f"{canary.pass_rate:.2f}"
    return (
        f"canaries: {canary.checks} of {config.min_checks} checks, pass rate {rate}"
        f"{_bounds(canary.low, canary.high) if canary.checks else ''} (needs a 95% bound clear "
        f"of {config.min_canary_pass:g}; decides by {config.max_checks} at the latest)"
    )


def _agreement_progress(agreement: AgreementFigures, config: JudgeChecksConfig) -> str:
    tau = "-" if agreement.mean_tau is None else f"{agreement.mean_tau:.2f}"
    return (
        f"self-agreement: {agreement.checks} of {config.min_checks} re-orderings, mean tau {tau}"
        f"{_bounds(agreement.low, agreement.high)} (needs a 95% bound clear of "
        f"{config.min_self_tau:g}; decides by {config.max_checks} at the latest)"
    )


@dataclass
class DriftReport:
    alarm: bool
    reason: str | None
    recent: dict[str, Any]
    earlier: dict[str, Any]


def _half(checks: Sequence[JudgeCheckRecord]) -> dict[str, Any]:
    canaries = [c.canary_passed for c in checks if c.canary_passed is not None]
    lengths = [c.completion_tokens_mean for c in checks if c.completion_tokens_mean is not None]
    spreads = [c.completion_tokens_std for c in checks if c.completion_tokens_std is not None]
    return {
        "groups": len(checks),
        "mean_reward": _mean([c.mean_reward for c in checks]),
        "canary_checks": len(canaries),
        "canary_pass_rate": sum(canaries) / len(canaries) if canaries else None,
        "completion_tokens_median": st.median(lengths) if lengths else None,
        "completion_tokens_spread": _mean(spreads),
    }


def drift_report(
    checks_newest_first: Sequence[JudgeCheckRecord], config: JudgeChecksConfig
) -> DriftReport:
    """Mean reward climbing while canaries or completion lengths collapse (module docstring)."""
    w = config.drift_window
    recent = _half(checks_newest_first[:w])
    earlier = _half(checks_newest_first[w : 2 * w])
    if len(checks_newest_first) < 2 * w:
        return DriftReport(False, None, recent, earlier)
    rise = _delta(recent["mean_reward"], earlier["mean_reward"])
    if rise is None or rise < config.drift_reward_rise:
        return DriftReport(False, None, recent, earlier)
    collapses = []
    if recent["canary_checks"] >= MIN_DRIFT_CANARIES <= earlier["canary_checks"]:
        drop = earlier["canary_pass_rate"] - recent["canary_pass_rate"]
        if drop >= config.drift_canary_drop:
            collapses.append(
                f"canary pass rate {earlier['canary_pass_rate']:.2f} -> "
                f"{recent['canary_pass_rate']:.2f}"
            )
    for key, what in (
        ("completion_tokens_median", "median completion length"),
        ("completion_tokens_spread", "completion length spread"),
    ):
        before, now = earlier[key], recent[key]
        if before and now is not None and now <= config.drift_length_ratio * before:
            collapses.append(f"{what} {before:.1f} -> {now:.1f} tokens")
    if not collapses:
        return DriftReport(False, None, recent, earlier)
    reason = (
        f"mean reward climbed {earlier['mean_reward']:.3f} -> {recent['mean_reward']:.3f} over the "
        f"last {w} groups while " + " and ".join(collapses)
    )
    return DriftReport(True, reason, recent, earlier)


def front_loaded(
    stored: Sequence[JudgeCheckRecord], config: JudgeChecksConfig
) -> tuple[bool, bool]:
    """Whether the next group gets a canary and a re-ordering whatever the shares: while that
    kind has not decided over `stored` (this judge and rubric's newest checks) and has fewer than
    `max_checks` checks. Front-loading stops for good at `FRONT_LOAD_LIMIT` x `max_checks`
    checks stored, so a judge whose re-orderings never give a tau (it scores every member
    alike) does not pay two calls a group for ever."""
    if len(stored) >= FRONT_LOAD_LIMIT * config.max_checks:
        return False, False
    canary = canary_figures(stored, config)
    agreement = agreement_figures(stored, config)
    return (
        canary.verdict == "undecided" and canary.checks < config.max_checks,
        agreement.verdict == "undecided" and agreement.checks < config.max_checks,
    )


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# ----------------------------------------------------------------------------- judging


class JudgeChecker:
    """Runs the checks around RULER's judging of one group and applies the gate.

    Holds what the checks need between groups: the draws, the canary kind whose turn it is, the
    final answers of recent groups (for "copied" canaries), the last gate decision per judge and
    rubric and whether the drift alarm is on (so changes are logged once)."""

    def __init__(self, config: JudgeChecksConfig | None = None) -> None:
        self.config = config or JudgeChecksConfig()
        self._rng = random.Random(self.config.seed)
        self._next_kind = 0
        self._answers: deque[tuple[str, str]] = deque(maxlen=32)  # (group id, final answer)
        self._decisions: dict[tuple[str, str], str] = {}
        self.drift_alarm = False

    async def judge(
        self,
        group: JudgeGroup,
        judge: Judge,
        detail: GroupDetail,
        reward_policy: str,
        *,
        score: ScoreGroup = score_group,
        stored: Sequence[JudgeCheckRecord] | None = None,
        every_check: bool = False,
    ) -> tuple[JudgeResult, JudgeCheckRecord | None]:
        """Judge `group` with its checks (`score`: RULER, or per-turn judging). The result holds
        the real members' scores only (the canary's is removed) with the tokens, cost, attempts
        and time of every call summed; the check is None when judging failed. With `stored` (this
        judge and rubric's newest checks, `Store.checks_of_judge`), the checks are front-loaded
        (module docstring): a kind it has fewer than `min_checks` of is drawn for every group.
        `every_check`: every kind that is on is drawn (a backing-off judge's try)."""
        config = self.config
        canary_share, position_share = config.canary_share, config.position_share
        if every_check:
            canary_share = 1.0 if canary_share > 0 else 0.0
            position_share = 1.0 if position_share > 0 else 0.0
        if stored is not None:
            canaries, positions = front_loaded(stored, config)
            if canary_share > 0 and canaries:
                canary_share = 1.0
            if position_share > 0 and positions:
                position_share = 1.0
        members = list(group.members)
        canary = None
        if self._rng.random() < canary_share:
            rotation = config.canary_kinds
            n = len(rotation)
            kinds = [rotation[(self._next_kind + i) % n] for i in range(n)]
            canary = insert_canary(members, kinds, self._rng, self._other_answer(group))
            if canary is not None:
                self._next_kind = (rotation.index(canary.kind) + 1) % n
                members.insert(canary.position, canary.member)
        reorder = len(members) >= 2 and self._rng.random() < position_share
        self._remember(group)
        judged = dataclasses.replace(group, members=members)
        first = await score(judged, judge)
        if first.status != "scored":
            return _without(first, canary.member.member_id if canary else None, []), None
        second = None
        if reorder:
            second = await score(dataclasses.replace(group, members=list(reversed(members))), judge)
        result = _without(first, canary.member.member_id if canary else None, [second])
        check = JudgeCheckRecord(
            group_id=group.group_id,
            judge_model=first.judge_model,
            rubric_hash=first.rubric_hash,
            member_count=len(group.members),
        )
        real = {s.member_id: s.score for s in result.scores}
        if canary is not None:
            canary_score = next(
                s.score for s in first.scores if s.member_id == canary.member.member_id
            )
            source_score = real[canary.source_id]
            outcome = judge_canary(canary_score, source_score, [s.score for s in first.scores])
            check.canary_kind = canary.kind
            check.canary_member_id = canary.member.member_id
            check.canary_score = canary_score
            check.canary_median = source_score  # the reference: the source's score
            check.canary_passed = outcome in ("below", "tie")
        if second is not None and second.status == "scored":
            again = {s.member_id: s.score for s in second.scores}
            ids = [s.member_id for s in first.scores]
            check.position_tau = st.kendall_tau_b(
                [next(s.score for s in first.scores if s.member_id == i) for i in ids],
                [again[i] for i in ids],
            )
        self._environment(check, detail, real)
        self._rewards_and_lengths(check, detail, real, reward_policy)
        return result, check

    async def decide(
        self,
        store: Store,
        check: JudgeCheckRecord,
        stored: Sequence[JudgeCheckRecord] | None = None,
    ) -> GateDecision:
        """The gate for the judge and rubric of `check`, counting `check` itself and `stored`
        (read from `store` when not given); sets the check's decision and reason, and logs when
        the decision changes."""
        if stored is None:
            stored = await store.checks_of_judge(
                check.judge_model, check.rubric_hash, limit=self.config.window
            )
        gate = gate_decision([check, *stored], self.config)
        check.decision, check.reason = gate.decision, gate.reason
        key = (check.judge_model, check.rubric_hash)
        if self._decisions.get(key) != gate.decision:
            log = logger.warning if gate.decision == "held" else logger.info
            log(
                "judge gate for %s (rubric %s): %s%s",
                check.judge_model,
                check.rubric_hash,
                "scores HELD, not trained on" if gate.decision == "held" else "scores train",
                f" ({gate.reason})" if gate.reason else "",
            )
            self._decisions[key] = gate.decision
        return gate

    async def release_recovered(
        self, store: Store, judge_model: str, rubrics: Sequence[str]
    ) -> list[str]:
        """Put groups held from this judge back to be judged again, for each rubric whose gate no
        longer holds; return their ids."""
        released: list[str] = []
        for h in sorted({rubric_hash(r) for r in rubrics}):
            if not await store.held_count(judge_model=judge_model, rubric_hash=h):
                continue
            checks = await store.checks_of_judge(judge_model, h, limit=self.config.window)
            gate = gate_decision(checks, self.config)
            if gate.decision == "held":
                continue
            ids = await store.requeue_held(judge_model, h, limit=self.config.requeue_batch)
            if ids:
                logger.info(
                    "judge %s (rubric %s) no longer held (%s): %d held groups will be judged "
                    "again; their held scores are never trained on",
                    judge_model,
                    h,
                    gate.reason or "its checks pass",
                    len(ids),
                )
            released += ids
        return released

    async def watch_drift(self, store: Store) -> DriftReport:
        """The drift report over the newest checks; logs once when the alarm starts or ends."""
        checks = await store.newest_judge_checks(limit=2 * self.config.drift_window)
        report = drift_report(checks, self.config)
        if report.alarm and not self.drift_alarm:
            logger.warning("training drift alarm: %s", report.reason)
        elif self.drift_alarm and not report.alarm:
            logger.info("training drift alarm cleared")
        self.drift_alarm = report.alarm
        return report

    def _other_answer(self, group: JudgeGroup) -> str | None:
        own = {final_text(m.messages).strip() for m in group.members}
        for group_id, text in reversed(self._answers):
            if group_id != group.group_id and text.strip() and text.strip() not in own:
                return text
        return None

    def _remember(self, group: JudgeGroup) -> None:
        for m in group.members[:1]:
            text = final_text(m.messages)
            if text.strip():
                self._answers.append((group.group_id, text))

    @staticmethod
    def _environment(check: JudgeCheckRecord, detail: GroupDetail, real: dict[str, float]) -> None:
        pairs = [
            (m.explicit_reward, real[m.member_id])
            for m in detail.members
            if m.explicit_reward is not None and m.member_id in real
        ]
        if len(pairs) < 2:
            return
        env, ruler = [p[0] for p in pairs], [p[1] for p in pairs]
        check.env_members = len(pairs)
        check.env_spearman = st.spearman_rho(env, ruler)
        check.env_kendall = st.kendall_tau_b(env, ruler)

    @staticmethod
    def _rewards_and_lengths(
        check: JudgeCheckRecord, detail: GroupDetail, real: dict[str, float], policy: str
    ) -> None:
        rewards = [
            r
            for m in detail.members
            if (r := pick_reward(policy, m.explicit_reward, real.get(m.member_id))[0]) is not None
        ]
        check.mean_reward = _mean(rewards)
        lengths = [
            float(sum(len(t.completion_token_ids or []) for t in m.turns))
            for m in detail.members
            if any(t.completion_token_ids for t in m.turns)
        ]
        if lengths:
            check.completion_tokens_mean = sum(lengths) / len(lengths)
            check.completion_tokens_std = st.std(lengths)


def _without(
    result: JudgeResult, canary_id: str | None, others: list[JudgeResult | None]
) -> JudgeResult:
    """`result` without the canary's score, with the other calls' tokens, cost and time added."""
    calls = [result, *(o for o in others if o is not None)]

    def total(values: list[Any]) -> Any:
        present = [v for v in values if v is not None]
        return sum(present) if present else None

    return dataclasses.replace(
        result,
        scores=[s for s in result.scores if s.member_id != canary_id],
        latency_s=sum(c.latency_s for c in calls),
        attempts=sum(c.attempts for c in calls),
        prompt_tokens=total([c.prompt_tokens for c in calls]),
        completion_tokens=total([c.completion_tokens for c in calls]),
        cost_usd=total([c.cost_usd for c in calls]),
    )
