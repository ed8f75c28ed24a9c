"""Scoring ready groups: claim one, ask RULER, store the scores. Never crashes the caller.

    scorer = Scorer(store, judge, ScoringConfig())
    await scorer.score_next()        # the oldest ready group, scored or marked failed
    await scorer.run(interval_s=5)   # score what is ready, forever (a background task of
                                     #   `rlproxy serve`)

Groups are formed by `trainer.scoring.grouping.Grouping` (serving's grouping task, scoring on or
off, and `rlproxy score`); the scorer only judges groups that are ready.

A group whose members all carry explicit rewards from the environment is marked scored without a
judge call unless `judge_explicit_groups` is set; RULER's scores and explicit rewards are stored
side by side, and the reward policy (`trainer.scoring.rewards`) picks which one training uses.
The judge itself (`trainer.scoring.ruler`) knows nothing of the database; the SQL is `storage`'s.

Replicas share the database: a claimed group is leased to this scorer's store for
`ScoringConfig.lease_s`, renewed every third of that while the judge works. Renewing rather than
sizing the lease to the judge's timeout keeps the lease short (a dead replica's group is taken
back within `lease_s`) whatever the judge takes: the local judge queues behind serving and has no
timeout of its own. A scorer that lost its claim (its lease ran out, another took the group)
stops judging and never overwrites the other's result.

Judging costs (the local judge takes the serving engine's time, a paid judge money), so `run`
judges only when it can help, and ready groups wait otherwise (unscored, never lost):

- nothing uses the scores (`wanted` says why: serving with no trainer anywhere and no telemetry
  receiving scores): no group is judged until that changes;
- the judge failed its checks: the gate fails it, or its canaries cannot reach the pass rate even
  at their 95 % upper bound (after `EARLY_CANARIES`), under every rubric it was decided on and
  passes none; or its last `FAILURES_IN_A_ROW` groups failed (the judge is down, or its replies
  never parse): one group is judged every `retry_s`, the others wait. That try gets every check
  that is on; after `RECOVERY_TRIES` tries in a row whose canary passes (the next try comes a
  tenth of `retry_s` after a passing one), or any group judged after failures, the judge judges
  at full rate again, its checks counted from then on (the gate, over its whole window, still
  decides whether the scores train).

`status()` says which, with the judge calls and judge time of the last hour.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from storage.group_ops import DEFAULT_LEASE_S
from storage.records import GroupDetail, JudgeCheckRecord, JudgeOutcome, ScoreRecord
from storage.stats import JudgeWork
from storage.store import Store
from trainer.scoring.judge_checks import (
    JudgeChecker,
    JudgeChecksConfig,
    agreement_figures,
    canary_figures,
    gate_decision,
)
from trainer.scoring.rewards import read_group
from trainer.scoring.ruler import (
    DEFAULT_RUBRIC,
    Judge,
    JudgeGroup,
    JudgeMember,
    ScoreGroup,
    rubric_hash,
    score_group,
)
from trainer.scoring.turns import DEFAULT_TURN_RUBRIC, DEFAULT_VOTES, TurnScoring

logger = logging.getLogger(__name__)

EARLY_CANARIES = 5
"""Canary checks after which a judge whose 95 % upper bound lies below the pass rate it must
reach backs off, before the gate has `min_checks` to decide (0 of 5 passed: bound 0.43)."""

RECOVERY_TRIES = 3
"""Tries in a row whose checks pass before a backing-off judge judges at full rate again (a
coin-flip judge passes one canary in two, three in a row one time in eight)."""

FAILURES_IN_A_ROW = 3
"""Groups whose judging failed in a row after which the judge backs off."""

HOUR_S = 3600.0

ScoresWanted = Callable[[], Awaitable[str | None]]
"""Why nothing would use scores now (the scorer then waits), or None to judge."""

ScoredListener = Callable[[GroupDetail, JudgeOutcome], None]
"""Told of each group whose scores (or failure) this scorer stored, right after the commit
(serving's telemetry: judge metrics, scores sent to Langfuse). Must be quick; its errors are
logged, never the scorer's."""


@dataclass
class ScoringConfig:
    rubric: str = DEFAULT_RUBRIC
    """The rubric for every group without one of its own (with mode "turns" the default is
    `DEFAULT_TURN_RUBRIC`: RULER's speaks of comparing trajectories)."""
    mode: Literal["group", "turns"] = "group"
    """How the judge scores a group: "group", RULER (one call compares the members); "turns",
    each assistant turn from what came next (`trainer.scoring.turns`)."""
    votes: int = DEFAULT_VOTES
    """Judge calls per turn in mode "turns"; the turn's verdict is their majority."""
    rubrics: dict[str, str] = field(default_factory=dict)
    """Per explicit group key, or per agent as `agent:<system prompt text>`."""
    judge_explicit_groups: bool = False
    """Call the judge even when every member has an explicit reward."""
    reward_policy: str = "explicit"
    lease_s: float = DEFAULT_LEASE_S
    """How long a claim on a group holds without renewal (renewed every third of it)."""
    checks: JudgeChecksConfig | None = None
    """Canaries, self-agreement and the gate (`trainer.scoring.judge_checks`); None: off."""
    retry_s: float = 900.0
    """A judge that failed its checks judges one group this often (module docstring)."""

    def __post_init__(self) -> None:
        if self.votes < 1:
            raise ValueError(f"votes must be at least 1 (judge calls per turn), not {self.votes}")
        if self.retry_s <= 0:
            raise ValueError(
                f"retry_s must be positive (seconds between tries), not {self.retry_s}"
            )
        if self.mode == "turns" and self.rubric == DEFAULT_RUBRIC:
            self.rubric = DEFAULT_TURN_RUBRIC

    def score_group(self) -> ScoreGroup:
        """How this configuration judges a group."""
        return TurnScoring(votes=self.votes) if self.mode == "turns" else score_group


class Scorer:
    def __init__(
        self,
        store: Store,
        judge: Judge,
        config: ScoringConfig | None = None,
        *,
        on_scored: ScoredListener | None = None,
        wanted: ScoresWanted | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.judge = judge
        self.config = config or ScoringConfig()
        self.on_scored = on_scored
        self.wanted = wanted
        self.clock = clock
        self.checker = None if self.config.checks is None else JudgeChecker(self.config.checks)
        self.state: Literal["idle", "judging", "waiting", "backing off"] = "idle"
        self.reason: str | None = None  # why it waits or backs off
        self.retry_at: float | None = None  # backing off: when it judges its next group
        self._gates: dict[str, tuple[bool, str | None]] = {}  # rubric hash -> failing, why
        self._since: dict[str, float] = {}  # rubric hash -> its checks count from then (a fix)
        self._try_due = False  # backing off: the next group claimed is the try
        self._passed_tries = 0  # tries passed in a row
        self._failed_in_a_row: list[str] = []  # why the latest groups' judging failed
        self._judged: deque[tuple[float, float, int]] = deque()  # (at, seconds, calls), 1 h

    async def score_next(self) -> GroupDetail | None:
        """Score the oldest ready group; None when none is ready."""
        group_id = await self.store.claim_group(lease_s=self.config.lease_s)
        return None if group_id is None else await self._score_claimed(group_id)

    async def score(self, group_id: str) -> GroupDetail | None:
        """Score one group now, whatever its status (rescoring a scored or failed one).

        None when the group does not exist, has fewer than two members, or is being scored.
        """
        claimed = await self.store.claim_group(group_id, lease_s=self.config.lease_s)
        return None if claimed is None else await self._score_claimed(claimed)

    async def run(self, interval_s: float) -> None:
        """Score every ready group, then sleep; forever, surviving any error. Groups are formed
        by the grouping task (`trainer.scoring.grouping`), which runs with or without a judge.

        Groups left "scoring" by a scorer that died are taken back once their lease expires
        (`claim_group` takes them); a live replica's group is never taken."""
        while True:
            try:
                await self.release_recovered()
                while await self._may_judge() and await self.score_next() is not None:
                    pass
                if self.state == "judging":
                    self.state, self.reason = "idle", None
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the scoring pass failed; trying again in %.0f s", interval_s)
            await asyncio.sleep(interval_s)

    async def _may_judge(self) -> bool:
        """Whether `run` judges its next group now (module docstring); sets `state`."""
        why = await self.wanted() if self.wanted is not None else None
        if why is not None:
            if self.state != "waiting":
                logger.info("ready groups wait unscored: %s", why)
            self.state, self.reason = "waiting", why  # a back-off's next try stays where it was
            return False
        failing = self.failing()
        if failing is None:
            self.state, self.reason, self.retry_at = "judging", None, None
            return True
        now = self.clock()
        if self.retry_at is None:  # it failed on the group just judged: wait from now
            self.retry_at = now + self.config.retry_s
            logger.warning(
                "judge %s failed its checks (%s): it judges one group every %.0f s until it "
                "passes; ready groups wait unscored",
                self.judge.model,
                failing,
                self.config.retry_s,
            )
        if now < self.retry_at:
            self.state, self.reason = "backing off", failing
            return False
        self._try_due = True  # the next group claimed is the try (none may be ready yet)
        self.state, self.reason = "judging", f"one try while backing off: {failing}"
        return True

    def failing(self) -> str | None:
        """Why this judge backs off: it failed its checks under every rubric it was decided on
        and passes none (a judge that fails one rubric and passes another keeps judging);
        None when it does not."""
        failed = self._failed_in_a_row
        if len(failed) >= FAILURES_IN_A_ROW:
            return f"its last {len(failed)} groups failed to be judged ({failed[-1]})"
        if not self._gates or not all(bad for bad, _ in self._gates.values()):
            return None
        return "; ".join(sorted({why for _, why in self._gates.values() if why}))

    def _take_try(self) -> bool:
        """Whether the group being judged now is a backing-off judge's try (and count it)."""
        if not self._try_due:
            return False
        self._try_due = False
        if self.failing() is None:
            return False
        self.retry_at = self.clock() + self.config.retry_s
        return True

    def _note_gate(
        self,
        rubric: str | None,
        check: JudgeCheckRecord,
        stored: list[JudgeCheckRecord],
        trying: bool,
    ) -> None:
        """Whether the judge fails under `rubric`, from `check` and the `stored` checks made
        since its last recovery (`_note_try`: from then on only newer checks count)."""
        assert self.checker is not None
        config = self.checker.config
        key = rubric or ""
        if trying:
            self._note_try(key, check)
        since = self._since.get(key)
        recent = [check, *(c for c in stored if since is None or c.created_at >= since)]
        canary = canary_figures(recent, config)
        agreement = agreement_figures(recent, config)
        early = (
            canary.verdict == "undecided"
            and canary.checks >= EARLY_CANARIES
            and canary.high < config.min_canary_pass
        )
        failed = canary.verdict == "fail" or agreement.verdict == "fail" or early
        why = gate_decision(recent, config).reason
        if early:
            why = (
                f"canaries {canary.passed}/{canary.checks} passed: even their 95% upper bound "
                f"{canary.high:.2f} is below {config.min_canary_pass:g} (the gate decides at "
                f"{config.min_checks} checks)"
            )
        self._gates[key] = (failed, why if failed else None)

    def _note_try(self, key: str, check: JudgeCheckRecord) -> None:
        """A backing-off judge's try: `RECOVERY_TRIES` passed in a row (each soon after the
        last) and its checks count afresh from now; one that fails waits `retry_s` again."""
        assert self.checker is not None
        passed = check.canary_passed
        if passed is None:  # canaries off: the re-ordered judging decides
            tau = check.position_tau
            passed = tau is not None and tau >= self.checker.config.min_self_tau
        if not passed:
            self._passed_tries = 0
            return
        self._passed_tries += 1
        if self._passed_tries < RECOVERY_TRIES:
            self.retry_at = self.clock() + self.config.retry_s / 10
            return
        self._passed_tries = 0
        self._since[key] = self.clock()
        logger.info(
            "judge %s passed %d tries in a row: judging at full rate again, its checks counted "
            "from now",
            self.judge.model,
            RECOVERY_TRIES,
        )

    def work_last_hour(self) -> JudgeWork:
        """The groups this scorer judged in the last hour, their judge calls and time."""
        now = self.clock()
        while self._judged and self._judged[0][0] < now - HOUR_S:
            self._judged.popleft()
        return JudgeWork(
            since=now - HOUR_S,
            groups=len(self._judged),
            calls=sum(calls for _, _, calls in self._judged),
            seconds=round(sum(s for _, s, _ in self._judged), 1),
        )

    def status(self) -> dict[str, Any]:
        """What background judging is doing and what it cost in the last hour."""
        work = self.work_last_hour()
        recent = [j for j in self._judged if j[0] >= self.clock() - 600]
        return {
            "state": self.state,
            "reason": self.reason,
            "retry_at": self.retry_at,
            "retry_s": self.config.retry_s,
            "groups_last_hour": work.groups,
            "judge_calls_last_hour": work.calls,
            "judge_calls_per_minute": round(sum(calls for _, _, calls in recent) / 10, 2),
            "judge_seconds_last_hour": work.seconds,
        }

    async def _score_claimed(self, group_id: str) -> GroupDetail | None:
        try:
            outcome = await self._judge_holding_claim(group_id)
        except asyncio.CancelledError:
            await asyncio.shield(self.store.release_scoring(group_id))
            raise
        except Exception as exc:
            logger.exception("scoring group %s failed", group_id)
            outcome = JudgeOutcome(
                status="failed",
                scores=[],
                judge_model=self.judge.model,
                failure=f"{type(exc).__name__}: {exc}",
            )
        if outcome is not None and outcome.judge_model != "explicit":
            self._judged.append((self.clock(), outcome.latency_s or 0.0, outcome.attempts or 0))
            if outcome.status == "failed":
                self._failed_in_a_row = [*self._failed_in_a_row, outcome.failure or "?"][-10:]
            else:
                self._failed_in_a_row = []
        stored = outcome is not None and await self.store.finish_scoring(group_id, outcome)
        if outcome is None or not stored:
            logger.warning(
                "group %s: another scorer took it over (this one's lease ran out); its result "
                "stands and this one is dropped",
                group_id,
            )
        elif outcome.status == "failed":
            logger.warning("group %s: judging failed: %s", group_id, outcome.failure)
        elif outcome.hold_reason is not None:
            logger.warning(
                "group %s scored by %s, scores HELD (not trained on): %s",
                group_id,
                outcome.judge_model,
                outcome.hold_reason,
            )
        else:
            logger.info("group %s scored by %s", group_id, outcome.judge_model)
        if stored and outcome is not None and outcome.check is not None:
            await self._watch_drift()
        detail = await read_group(self.store, group_id, self.config.reward_policy)
        if stored and outcome is not None and detail is not None:
            self._tell(detail, outcome)
        return detail

    def _tell(self, detail: GroupDetail, outcome: JudgeOutcome) -> None:
        if self.on_scored is None:
            return
        try:
            self.on_scored(detail, outcome)
        except Exception:
            logger.exception("the listener of scored groups failed on group %s", detail.id)

    async def _judge_holding_claim(self, group_id: str) -> JudgeOutcome | None:
        """Judge the group, renewing the claim meanwhile; None when the claim was lost."""
        judging = asyncio.ensure_future(self._judge(group_id))
        try:
            while True:
                done, _ = await asyncio.wait({judging}, timeout=self.config.lease_s / 3)
                if done:
                    return judging.result()
                try:
                    held = await self.store.renew_claim(group_id, lease_s=self.config.lease_s)
                except Exception:
                    # The lease may run out; finishing will tell whether the claim survived.
                    logger.exception("renewing the claim on group %s failed", group_id)
                    continue
                if not held:
                    return None
        finally:
            if not judging.done():
                judging.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await judging

    async def _judge(self, group_id: str) -> JudgeOutcome:
        group = await self.store.get_group(group_id)
        if group is None:
            raise LookupError(f"group {group_id} vanished while being scored")
        members = group.members
        if not self.config.judge_explicit_groups and all(
            m.explicit_reward is not None for m in members
        ):
            return JudgeOutcome(status="scored", scores=[], judge_model="explicit")
        rubric = self.rubric_for(group)
        trying = self._take_try()
        judge_group = JudgeGroup(
            group_id=group.id,
            members=[JudgeMember(m.member_id, m.messages, m.tools) for m in members],
            tools=members[0].tools if members else None,
            rubric=rubric,
        )
        check = hold_reason = None
        score = self.config.score_group()
        if self.checker is None:
            result = await score(judge_group, self.judge)
        else:
            # One read of this judge and rubric's checks serves front-loading and the gate.
            stored = await self.store.checks_of_judge(
                self.judge.model, rubric_hash(rubric), limit=self.checker.config.window
            )
            result, check = await self.checker.judge(
                judge_group,
                self.judge,
                group,
                self.config.reward_policy,
                score=score,
                stored=stored,
                every_check=trying,
            )
            if check is not None:
                gate = await self.checker.decide(self.store, check, stored)
                hold_reason = gate.reason if gate.decision == "held" else None
                self._note_gate(check.rubric_hash, check, list(stored), trying)
        per_member = len(members) or 1
        return JudgeOutcome(
            status=result.status,
            scores=[
                ScoreRecord(
                    member_id=s.member_id,
                    score=s.score,
                    explanation=s.explanation,
                    judge_model=result.judge_model,
                    rubric_hash=result.rubric_hash,
                    latency_s=result.latency_s,
                    prompt_tokens=_share(result.prompt_tokens, per_member),
                    completion_tokens=_share(result.completion_tokens, per_member),
                    cost_usd=None if result.cost_usd is None else result.cost_usd / per_member,
                )
                for s in result.scores
            ],
            judge_model=result.judge_model,
            rubric_hash=result.rubric_hash,
            latency_s=result.latency_s,
            attempts=result.attempts,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cost_usd=result.cost_usd,
            failure=result.failure,
            check=check,
            hold_reason=hold_reason,
        )

    async def release_recovered(self) -> list[str]:
        """Groups held from this judge go back to be judged again once its gate no longer holds
        (`JudgeChecker.release_recovered`); [] when checks are off."""
        if self.checker is None:
            return []
        rubrics = [self.config.rubric, *self.config.rubrics.values()]
        return await self.checker.release_recovered(self.store, self.judge.model, rubrics)

    async def _watch_drift(self) -> None:
        if self.checker is None:
            return
        try:
            await self.checker.watch_drift(self.store)
        except Exception:
            logger.exception("the drift alarm could not read the judge checks")

    def rubric_for(self, group: GroupDetail) -> str:
        rubrics = self.config.rubrics
        if group.summary.source == "explicit" and group.summary.key in rubrics:
            return rubrics[group.summary.key]
        for m in group.members[:1]:
            for message in m.messages:
                if message.get("role") == "system" and isinstance(message.get("content"), str):
                    key = f"agent:{message['content']}"
                    if key in rubrics:
                        return rubrics[key]
        return self.config.rubric


def _share(total: int | None, members: int) -> int | None:
    """A member's share of the group's judge tokens (the judge sees the group in one call)."""
    return None if total is None else round(total / members)
