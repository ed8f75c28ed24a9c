"""Canary rollout: a new adapter version serves part of the traffic until it has shown it is not
worse than the version it would replace; then it is promoted, or rolled back and rejected.

What it does, in order (driven by `proxy.adapters.publisher.Publisher.check`):

1. `start(version)`: load the version, let it serve `share` of the policy name's
   conversations (the registry draws per conversation and keeps a conversation on the version
   its first turn drew: `proxy.adapters.registry.ServedModels.route`), and write its rollout
   state ("canary", the baseline it is compared with, when it began) to the adapters table.
2. `evaluate()`: read the groups scored since the canary began that hold members of both
   versions (`Store.paired_rewards`: the judge compared them side by side; explicit rewards
   count through the reward policy, `trainer.scoring.rewards`) and run the stated test
   (`proxy.adapters.rollout_stats`: a sequential test, looked at on every poll).
   - promote: the version becomes active (the registry's canary ends);
   - roll back: the canary ends, the previous version serves everything again, the version is
     marked rejected with the figures in its error and rollout state; the publisher never
     activates it again, and the trainer leaves its weights (`trainer.loop`);
   - wait: the latest figures are kept when they changed.
   Every decision is kept in the version's `rollout.decisions` with its figures (`GET
   /rl/adapters`).
3. Before any reward comes, the canary's closeness to the active version is measured on the
   newest trajectories the active version served (`proxy.adapters.closeness`: how far the two
   versions' answer distributions can be apart there, so how much worse in reward the canary
   can be). When that bound, plus the bounds of the versions promoted this way since the last
   version a reward test decided (its `drift`), is within `close_budget`, the canary is promoted
   at once; otherwise it waits for the reward test. Measured once per canary, again every
   `close_retry_s` while the active version has served too few episodes to measure on.
4. The harm a canary can do is bounded by design: it serves `share` of the conversations, and
   at most `max_calls` calls. At that budget it is paused (share 0: no new conversations; those
   on it stay) and the test goes on with the evidence of what it served; once no new evidence
   has come for `evidence_wait_s`, the test's budget rule decides (the likelier of "harmful" and
   "as good"), or, with fewer mixed groups than the test needs, it is rolled back: nothing
   showed it is not harmful. With no rewards and no trusted judge scores (the judge gate holds
   them), that is what happens to every version; but then nothing trains either.

5. The watch (`watch()`, every poll, `watch_share` > 0): a canary is compared only with the
   version it would replace, on the rewards of its hours; a burst of wrong rewards (inverted,
   a broken reward function) promotes the worse version, and each later version is compared
   with that one. So while a trained version is active the base model answers `watch_share`
   of the other conversations (`ServedModels.route`), and the same test (its own
   `watch_alpha`, no budget) compares what serves with the base on the groups holding both,
   over a stretch: the versions active since the stretch began (close promotions come every
   minute; each would otherwise start the evidence again). At `test.max_groups` groups,
   undecided, the stretch rolls back when "harmful" is the likelier and the 90 % interval lies
   below 0 (`watch_budget`). "As good" (or not shown worse at the budget) starts a fresh
   stretch with the version serving then, so evidence from hours that
   are gone (a burst over) does not outweigh the new. "Harmful" rolls back to the base:
   every replica follows, and the version with every version on its lineage that served is
   rolled back (the trainer starts again from fresh weights: which of them first went wrong is
   not known); a running canary (compared with the harmful version) is rolled back with them
   when it was trained on from the harmful weights, else abandoned. Its
   figures are in the active version's `rollout.watch`; a restart begins a fresh stretch.

Each start and decision is also written to the policy's state (`Store.set_policy_state`), which
every replica follows (`proxy.adapters.publisher`); only the replica holding the publisher lease
runs a rollout, so decisions are made once.

A manual activation through `/rl/adapters/{v}/activate` ends a canary (the comparison was
against the version that served before); it is recorded as "abandoned". Writes to the policy's
state are compare-and-set, so such an activation on another replica is never overwritten: a
start writes only the canary, and only if the active version is still the baseline it read
before loading; a promotion or rollback only if the state still names its canary (else the
trial is abandoned and the next poll follows the state).

Not here: SQL (`storage.rollout`), the statistics (`rollout_stats`), which version to try next
(`publisher`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from proxy.adapters.closeness import ClosenessCheck
from proxy.adapters.manager import AdapterManager
from proxy.adapters.rollout_stats import Comparison, RolloutTest, at_budget, compare
from storage.store import Store
from trainer import checkpoints
from trainer.scoring import version_rewards

if TYPE_CHECKING:
    from proxy.settings import RolloutSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

ROLLED_BACK = "rolled_back"
"""The rollout state of a version that lost its canary (the trainer leaves its weights)."""


@dataclass(frozen=True)
class RolloutConfig:
    share: float = 0.25
    """The share of the policy name's conversations the canary serves."""
    test: RolloutTest = field(default_factory=RolloutTest)
    reward_policy: str = "explicit"
    max_calls: int = 200
    """The most calls the canary serves on trial; then it is paused (see the module)."""
    evidence_wait_s: float = 600.0
    """Paused: decide once no new evidence has come for this long."""
    close_budget: float = 0.1
    """Promote at once when the closeness bound plus the drift stays within this (0: never)."""
    close_retry_s: float = 30.0
    watch_share: float = 0.1
    """While a trained version is active, the share of the other conversations the base model
    answers, the watch's control (0: no watch)."""
    watch_alpha: float = 0.01
    """The watch's chance, per look from a fresh start, of rolling back a version as good as
    the base."""

    def __post_init__(self) -> None:
        if not 0.0 < self.share < 1.0:
            raise ValueError("the canary share must be between 0 and 1 (exclusive)")
        if not 0.0 <= self.watch_share < 1.0:
            raise ValueError("the watch share must be at least 0 and below 1")
        if self.max_calls < 1:
            raise ValueError("the canary's call budget must be at least 1")

    @property
    def watch_test(self) -> RolloutTest:
        """The watch's test: the canary's, with its own alpha and no budget of its own (at
        `test.max_groups` groups `watch_budget` decides instead)."""
        return replace(self.test, alpha=self.watch_alpha, max_groups=10**9)


def rollout_config(settings: RolloutSettings, reward_policy: str) -> RolloutConfig | None:
    """The canary rollout's configuration from its settings (RLPROXY_ROLLOUT_*); None when it
    is off (RLPROXY_ROLLOUT)."""
    if not settings.enabled:
        return None
    return RolloutConfig(
        share=settings.share,
        test=RolloutTest(
            margin=settings.margin,
            alpha=settings.alpha,
            beta=settings.beta,
            min_groups=settings.min_groups,
            max_groups=settings.max_groups,
        ),
        reward_policy=reward_policy,
        max_calls=settings.max_calls,
        evidence_wait_s=settings.evidence_wait_s,
        close_budget=settings.close_budget,
        watch_share=settings.watch_share,
        watch_alpha=settings.watch_alpha,
    )


@dataclass
class _Trial:
    version: int
    baseline: int | None
    started_at: float
    state: dict[str, Any]
    paused_at: float | None = None
    """When the canary spent its call budget (None: it still takes new conversations)."""
    groups_seen: int = 0
    evidence_at: float = 0.0
    """When the last new mixed group came in (paused: the wait counts from here)."""
    closeness_at: float | None = None
    """When closeness was last tried (None: not yet)."""
    closeness_done: bool = False
    """Measured and not close enough: the reward test decides."""


def watch_budget(result: Comparison, groups: int) -> Comparison:
    """The watch's stretch at its budget of `groups` mixed groups, undecided: roll back when
    "harmful" is the likelier hypothesis (LLR > 0: the mean difference is below -margin/2) and
    the 90 % interval lies wholly below 0 (worse than the base, shown at that level); otherwise
    a fresh stretch ("promote": as good, or not shown worse)."""
    shown = result.reason.split(": ", 1)[-1]
    if result.llr is not None and result.llr > 0 and result.upper is not None and result.upper < 0:
        return replace(
            result,
            decision="roll_back",
            reason=f"likelier harmful and below the base at the budget of {groups} groups: {shown}",
        )
    return replace(
        result,
        decision="promote",
        reason=f"not shown worse at the budget of {groups} groups: {shown}",
    )


@dataclass
class _Watch:
    """The watch's current stretch: the versions active since it (re)started, compared with
    the base on the groups scored since `since`."""

    versions: set[int]
    since: float
    looks: int = 0
    """Stretches that ended "as good" (or at the group budget) since the first version here."""
    figures: dict[str, Any] | None = None


async def _held() -> bool:
    return True


class Rollout:
    def __init__(
        self,
        adapters: AdapterManager,
        store: Store,
        config: RolloutConfig,
        note: Callable[..., Awaitable[None]],
        closeness: ClosenessCheck | None = None,
    ) -> None:
        """`note(version, **changes)` writes a version's row, creating it if the trainer has
        not recorded it yet (`Publisher._note`)."""
        self.adapters = adapters
        self.store = store
        self.config = config
        self._note = note
        self.closeness = closeness
        """Measures a canary's closeness to the active version (None or unsupported: never)."""
        self.registry = adapters.registry
        self.policy = adapters.registry.policy
        self._trial: _Trial | None = None
        self._last: dict[str, Any] | None = None
        self._watch: _Watch | None = None
        self.replica_id: str | None = None
        """Who writes the policy's state (shown as `changed_by`)."""
        self.may_write: Callable[[], bool] = lambda: True
        """Asked right before each write of the policy's state: False when this replica may no
        longer decide (its publisher lease ran out meanwhile); nothing is written then."""
        self.renew: Callable[[], Awaitable[bool]] = _held
        """Renew the publisher lease now; True while this replica holds it. Asked during and
        after a step long enough to outlast the lease's renewal (measuring closeness)."""
        self.renew_every_s: float | None = None
        """How often `renew` must run during a long step (None: no lease to keep)."""

    @property
    def watch_figures(self) -> dict[str, Any] | None:
        """The watch's latest figures on this replica (None: none yet, or it does not decide)."""
        return None if self._watch is None else self._watch.figures

    @property
    def version(self) -> int | None:
        """The version on canary, if any."""
        return self._trial.version if self._trial is not None else None

    async def start(self, version: int, previous: dict[str, Any] | None = None) -> bool:
        """Put `version` on canary against the active version. `previous`: a rollout state
        kept from before a restart, whose start time (and so its evidence) carries on. False
        when the policy's active version changed while `version` loaded (an activation on
        another replica): nothing is started, and the next poll follows that change."""
        await self.adapters.load(version)
        baseline = self.registry.active
        now = time.time()
        started_at = now
        decisions: list[dict[str, Any]] = []
        paused: dict[str, Any] = {}
        if (
            previous
            and previous.get("state") == "canary"
            and previous.get("baseline") == (baseline or 0)
        ):
            started_at = float(previous.get("started_at") or now)
            decisions = list(previous.get("decisions") or [])
            if previous.get("paused_at"):  # it spent its call budget before the restart
                paused = {k: previous.get(k) for k in ("paused_at", "paused_after_calls")}
        # Only the canary is written, and only over the baseline read above: an activation
        # made meanwhile on another replica holds.
        if not self.may_write():
            logger.warning("adapter %d not put on canary: the publisher lease ran out", version)
            return False
        if not await self.store.set_policy_state(
            self.policy,
            by=self.replica_id,
            expect={"active_version": baseline or 0},
            canary_version=version,
            canary_share=0.0 if paused else self.config.share,
        ):
            logger.info(
                "adapter %d not put on canary: the active version changed while it loaded",
                version,
            )
            return False
        state = {
            "state": "canary",
            "baseline": baseline or 0,
            "share": self.config.share,
            "started_at": started_at,
            "test": {
                **self.config.test.describe(),
                "reward_policy": self.config.reward_policy,
                "max_calls": self.config.max_calls,
                "evidence_wait_s": self.config.evidence_wait_s,
            },
            "latest": None,
            "decisions": decisions,
            **paused,
        }
        self._trial = _Trial(version, baseline, started_at, state, evidence_at=now)
        if paused:
            self._trial.paused_at = float(paused["paused_at"])
        self._last = None
        await self._write(version, status="loaded", loaded_at=now, rollout=state)
        # the split starts once the version's record says so: a listing that shows the canary
        # always finds its rollout state
        self.registry.start_canary(version, self.config.share)
        if paused:
            self.registry.pause_canary()
        logger.info(
            "adapter %d on canary: %.0f%% of %s's traffic, compared with %s",
            version,
            100 * self.config.share,
            self.policy,
            baseline or "the base model",
        )
        return True

    def forget(self) -> None:
        """This replica no longer decides (it lost the publisher lease): drop the trial; if it
        decides again it resumes from the policy's state and the version's rollout record."""
        self._trial, self._last = None, None

    async def evaluate(self) -> Comparison | None:
        """Look at the evidence; promote, roll back or wait. None when no canary runs."""
        trial = self._trial
        if trial is None:
            return None
        canary = self.registry.canary
        if canary is None or canary.version != trial.version:
            await self._finish(trial, "abandoned", None, "the active version was changed by hand")
            return None
        if await self._close_enough(trial):
            return None
        old, new = trial.baseline or 0, trial.version
        pairs = await self.store.paired_rewards(old=old, new=new, since=trial.started_at)
        evidence = [version_rewards(p.members, old, new, self.config.reward_policy) for p in pairs]
        result = compare([(o, n) for o, n in evidence if o and n], self.config.test)
        if result.decision == "wait":
            result = await self._budget(trial, result)
        figures = result.to_dict()
        if result.decision in ("promote", "roll_back"):
            promote = result.decision == "promote"
            if not self.may_write():
                logger.warning("adapter %d: no decision written, the lease ran out", trial.version)
                self.forget()
                return None
            # Written only over this trial's canary: a hand (or another replica) that changed
            # the state since is not undone, and the next poll follows it.
            if not await self._state(trial, trial.version if promote else trial.baseline or 0):
                await self._finish(
                    trial, "abandoned", result, "the policy's state was changed meanwhile"
                )
                return result
            if promote:
                await self.adapters.activate(trial.version)  # ends the registry's canary
                await self._finish(trial, "promoted", result, result.reason)
            else:
                self.registry.end_canary()
                await self._finish(trial, ROLLED_BACK, result, result.reason)
                await self.adapters.evict()
        elif figures != self._last:
            self._last = figures
            trial.state["latest"] = figures
            await self._write(trial.version, rollout=trial.state)
        return result

    async def watch(self) -> Comparison | None:
        """The watch (see the module): compare what the policy name serves with the base on the
        groups holding both; roll it back to the base when it proves harmful. None when no
        watch runs (it is off, or the base serves)."""
        active = self.registry.active
        if self.config.watch_share <= 0.0 or active is None:
            self._watch = None
            return None
        watch = self._watch
        now = time.time()
        if watch is None:
            watch = self._watch = _Watch({active}, now)
        elif active not in watch.versions:  # promoted: the stretch goes on with it
            watch.versions.add(active)
        pairs = await self.store.paired_rewards(old=0, new=watch.versions, since=watch.since)
        policy = self.config.reward_policy
        evidence = [version_rewards(p.members, 0, watch.versions, policy) for p in pairs]
        result = compare([(o, n) for o, n in evidence if o and n], self.config.watch_test)
        if result.decision == "wait" and result.groups >= self.config.test.max_groups:
            result = watch_budget(result, self.config.test.max_groups)
        if result.decision == "roll_back":
            await self._roll_back_to_base(active, watch, result)
            return result
        figures = {**result.to_dict(), "versions": sorted(watch.versions), "since": watch.since}
        if result.decision == "promote":
            # as good as the base on this stretch (or undecided at its budget): a fresh start
            # from here, with the newest version alone
            watch.versions, watch.since = {active}, now
            watch.looks += 1
            figures["looks"] = watch.looks
        if figures != watch.figures:
            watch.figures = figures
            await self._update_rollout(active, watch=figures)
        return result

    async def _roll_back_to_base(self, active: int, watch: _Watch, result: Comparison) -> None:
        """The watch found `active` harmful against the base: the base serves again (every
        replica follows), and `active` with every version on its lineage that served as active
        is rolled back, so the trainer leaves those weights and the publisher never serves them
        again. A canary on trial against `active` is rolled back with them when it was trained
        on from `active`'s weights (it holds what went wrong too, and the publisher bars it as
        a descendant), else abandoned (no decision: it was compared with the wrong version)."""
        if not self.may_write():
            logger.warning(
                "adapter %d harmful by the watch, not rolled back: the lease ran out", active
            )
            return
        if not await self.store.set_policy_state(
            self.policy,
            by=self.replica_id,
            expect={"active_version": active},
            active_version=0,
            canary_version=None,
            canary_share=None,
        ):
            return  # the state changed meanwhile: the next poll follows it, and watches again
        trial, self._trial = self._trial, None
        await self.adapters.activate(None)  # ends a canary too
        canary: _Trial | None = None  # a canary trained from `active`'s weights: rolled back too
        if trial is not None:
            found = await asyncio.to_thread(
                checkpoints.rolled_back_ancestor, self.adapters.root, trial.version, {active}
            )
            if found is not None:
                canary = trial
            else:
                await self._finish(
                    trial, "abandoned", None, f"version {active}, its baseline, was rolled back"
                )
        now = time.time()
        reason = f"the watch against the base model: {result.reason}"
        decision = {
            "decision": ROLLED_BACK,
            "by": "watch",
            "at": now,
            "reason": reason,
            "figures": result.to_dict(),
            "versions": sorted(watch.versions),
        }
        records = {a.version: a for a in await self.store.list_adapters(self.policy)}
        lineage: list[int] = []
        version = active
        while version > 0:
            record = records.get(version)
            if record is not None and record.activated_at is not None:
                lineage.append(version)
            version = await asyncio.to_thread(
                checkpoints.parent_version, self.adapters.root, version
            )
        rolled = set(lineage) | watch.versions | ({canary.version} if canary else set())
        for version in sorted(rolled):
            record = records.get(version)
            kept = canary.state if canary and version == canary.version else None  # its trial's
            state = dict(kept or (record.rollout if record else None) or {})
            state.update(state=ROLLED_BACK, decided_at=now, rolled_back_with=active)
            state["decisions"] = [*state.get("decisions", []), decision]
            await self._write(
                version,
                status="rejected",
                rollout=state,
                error=f"rolled back with version {active}: {reason}",
            )
        self._watch = None
        await self.adapters.evict()
        logger.warning(
            "adapter %d rolled back to the base model (with versions %s): %s",
            active,
            ", ".join(str(v) for v in sorted(rolled - {active})) or "no other",
            reason,
        )

    async def _update_rollout(self, version: int, **changes: Any) -> None:
        """Set keys of `version`'s rollout record, keeping the others."""
        for record in await self.store.list_adapters(self.policy):
            if record.version == version:
                await self._write(version, rollout={**(record.rollout or {}), **changes})
                return

    async def _close_enough(self, trial: _Trial) -> bool:
        """Promote the canary if it is provably close to the active version (see the module);
        True when it was promoted."""
        check, budget = self.closeness, self.config.close_budget
        if check is None or not check.supported or budget <= 0 or trial.closeness_done:
            return False
        now = time.time()
        if trial.closeness_at is not None and now - trial.closeness_at < self.config.close_retry_s:
            return False
        trial.closeness_at = now
        drift = await self._drift(trial.baseline)
        try:
            measured = await self._renewing(
                check.measure(trial.baseline, trial.version, since=now - 3600.0)
            )
        except Exception:
            logger.exception("adapter %d: closeness not measured", trial.version)
            trial.closeness_done = True
            return False
        figures = {**measured.to_dict(), "drift_before": round(drift, 6), "budget": budget}
        trial.state["closeness"] = figures
        if measured.bound is None:
            await self._write(trial.version, rollout=trial.state)
            return False  # too few episodes yet: tried again later
        trial.closeness_done = True
        if drift + measured.bound > budget:
            figures["verdict"] = "not close enough: the reward test decides"
            await self._write(trial.version, rollout=trial.state)
            return False
        figures["verdict"] = "close"
        # Measuring takes seconds to minutes on a busy CPU, while nothing renews the lease.
        if not self.may_write() and not await self.renew():
            logger.warning(
                "adapter %d measured close, not promoted: another replica decides now",
                trial.version,
            )
            self.forget()
            return True
        if not await self._state(trial, trial.version):
            await self._finish(trial, "abandoned", None, "the policy's state was changed meanwhile")
            return True
        await self.adapters.activate(trial.version)
        trial.state["drift"] = round(drift + measured.bound, 6)
        reason = (
            f"close to {trial.baseline or 'the base model'}: {measured.reason}; with the drift "
            f"since the last reward-tested version, {drift + measured.bound:.3f} <= {budget:g}"
        )
        await self._finish(trial, "promoted", None, reason)
        return True

    async def _renewing(self, work: Awaitable[T]) -> T:
        """Await `work` (a measurement that takes seconds to minutes on a busy CPU) while
        renewing the publisher lease every `renew_every_s`: the poll that runs it would otherwise
        outlast the lease, and the replica would drop the trial and start it again, forever."""
        if self.renew_every_s is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.renew_every_s)
                if task in done:
                    return task.result()
                await self.renew()
        finally:
            if not task.done():
                task.cancel()

    async def _drift(self, active: int | None) -> float:
        """How far the active version may be from the last version a reward test (or nothing:
        the base) decided: the closeness bounds of the promotions since, summed."""
        if not active:
            return 0.0
        for record in await self.store.list_adapters(self.policy):
            if record.version == active:
                return float((record.rollout or {}).get("drift") or 0.0)
        return 0.0

    async def _budget(self, trial: _Trial, result: Comparison) -> Comparison:
        """The call budget: pause the canary once it has served `max_calls` calls; paused, and
        with no new evidence for `evidence_wait_s`, decide by the test's budget rule."""
        now = time.time()
        if result.groups > trial.groups_seen:
            trial.groups_seen, trial.evidence_at = result.groups, now
        if trial.paused_at is None:
            served = await self.store.calls_served(version=trial.version, since=trial.started_at)
            if served < self.config.max_calls:
                return result
            if not self.may_write() or not await self.store.set_policy_state(
                self.policy,
                by=self.replica_id,
                expect={"canary_version": trial.version},
                canary_share=0.0,
            ):
                return result  # the next poll follows whatever changed, or tries again
            self.registry.pause_canary()
            trial.paused_at = trial.evidence_at = now
            trial.state["paused_at"] = now
            trial.state["paused_after_calls"] = served
            await self._write(trial.version, rollout=trial.state)
            logger.info(
                "adapter %d paused on canary after %d calls: waiting for their evidence",
                trial.version,
                served,
            )
            return result
        if now - trial.evidence_at < self.config.evidence_wait_s:
            return result
        return at_budget(result, self.config.test, trial.state.get("paused_after_calls"))

    async def _finish(
        self, trial: _Trial, state: str, result: Comparison | None, reason: str
    ) -> None:
        now = time.time()
        decision = {"decision": state, "at": now, "reason": reason}
        if result is not None:
            decision["figures"] = result.to_dict()
        trial.state.update(state=state, decided_at=now, latest=decision.get("figures"))
        trial.state["decisions"] = [*trial.state.get("decisions", []), decision]
        changes: dict[str, Any] = {"rollout": trial.state}
        if state == "promoted":
            changes["activated_at"] = now
        if state == ROLLED_BACK:
            changes.update(status="rejected", error=f"rolled back after its canary: {reason}")
        await self._write(trial.version, **changes)
        self._trial = None
        log = logger.warning if state == ROLLED_BACK else logger.info
        log("adapter %d %s: %s", trial.version, state.replace("_", " "), reason)

    async def _state(self, trial: _Trial, active_version: int) -> bool:
        """The decision holds on every replica: `active_version` serves, no canary; only if the
        state still names this trial's canary (False: it did not, nothing was written)."""
        return await self.store.set_policy_state(
            self.policy,
            by=self.replica_id,
            expect={"canary_version": trial.version},
            active_version=active_version,
            canary_version=None,
            canary_share=None,
        )

    async def _write(self, version: int, **changes: Any) -> None:
        await self._note(version, **changes)
