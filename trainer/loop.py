"""The background training loop: scored groups in, adapter versions out.

    loop = TrainingLoop(store, PeftTrainer(model_dir, config), checkpoints_root, policy="rlproxy")
    await loop.resume()      # pick up where a previous run stopped
    await loop.run()         # forever: take scored groups, one GRPO step, write version N

One step: the oldest scored groups not yet used (`groups_per_step` of them) give each member an
advantage over the rewards chosen by the reward policy (`trainer.grpo.group_advantages` for
runs of one task, `leave_one_out_advantages` for a cohort of different tasks);
zero-variance groups are skipped and counted. Every assistant turn of a member becomes a
`TrainingExample` from the token ids stored when it was sampled (never re-rendered text). The
trainer makes one optimizer step, the checkpoint is written atomically as version N
(`trainer.checkpoints`), recorded in the database, and the groups are marked used with step N.
Serving notices the new folder, loads it and flips the policy name (`proxy.adapters.publisher`).

Restart: the newest complete checkpoint restores weights, optimizer state and the step; the
group ids it lists are marked used again, in case the process died between writing the
checkpoint and marking them. A checkpoint is complete only once renamed into place, so a killed
step leaves nothing that serving or a restart would load.

Groups marked with `trained_step = 0` were looked at and skipped (zero variance, no reward, no
stored token ids, or too stale); they never contributed a gradient.

Staleness: every example carries the adapter version that sampled it; an example more than
`max_staleness` versions behind the weights the step starts from is left out or down-weighted
(`trainer.staleness`, `stale_policy`), after the group's advantages were taken over all its
members; a group all of whose examples are left out is dropped. Each step's metrics count the
groups dropped and down-weighted and the examples left out since the previous step and, over the
whole run (carried from checkpoint to checkpoint), the groups trained on, dropped and
down-weighted and the examples left out; serving reads them from the adapter record (`/metrics`,
`/rl/stats`, the dashboard).

Lineage: each checkpoint's trainer state records `parent`, the version whose weights the step
started from (0: fresh LoRA weights). When serving rolls a version back after its canary
(`proxy.adapters.rollout`, the adapters table's rollout state "rolled_back"), the next step
first leaves those weights: it loads the newest version on disk whose lineage holds no
rolled-back version (weights and optimizer state; fresh weights when there is none) and keeps
counting versions from where it was, so the next version descends from accepted weights.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from storage.records import AdapterRecord, GroupDetail
from storage.store import Store
from trainer import checkpoints
from trainer.distributed import OutOfStep
from trainer.grpo import TrainingExample, group_advantages, leave_one_out_advantages
from trainer.packing import pack_turns, turns_in
from trainer.peft_backend import PeftTrainer
from trainer.scoring import read_group
from trainer.staleness import lineage, samples_behind, staleness_weight, versions_behind

logger = logging.getLogger(__name__)

SKIPPED = 0
"""`trained_step` of a group looked at and skipped."""


@dataclass
class StepReport:
    version: int
    path: Path
    group_ids: list[str]
    skipped_group_ids: list[str]
    mean_reward: float
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Collected:
    """What `_collect` found for one step."""

    chosen: list[tuple[GroupDetail, list[TrainingExample]]]
    skipped: list[str]
    """Groups that cannot be trained on (no variance, no reward, no token ids)."""
    rewards: list[float]
    stale_dropped: list[str]
    """Usable groups dropped for staleness (every sample past the bound)."""
    downweighted: int = 0
    """Among `chosen`: groups with a sample past the bound that trains with a weight below 1."""
    staleness: list[int] = field(default_factory=list)
    """Versions behind of each chosen group's stalest sample that trains."""
    samples_dropped: int = 0
    """Among `chosen`: samples past the bound left out of the loss (the rest of the group
    trains)."""


RUN_TOTALS = (
    "groups_trained_total",
    "stale_dropped_total",
    "stale_downweighted_total",
    "stale_samples_dropped_total",
    "too_long_total",
)
"""Step metrics counted over the whole run (restored from the newest checkpoint on resume)."""


class TrainingLoop:
    def __init__(
        self,
        store: Store,
        trainer: PeftTrainer,
        checkpoints_root: Path,
        *,
        policy: str,
        reward_policy: str = "explicit",
        poll_s: float = 5.0,
        step_hooks: Sequence[Callable[[StepReport], None]] = (),
    ) -> None:
        self.store = store
        self.trainer = trainer
        self.root = Path(checkpoints_root)
        self.policy = policy
        self.reward_policy = reward_policy
        self.poll_s = poll_s
        self.config = trainer.config
        self.step_hooks = list(step_hooks)
        """Called with each written step's report (metrics logging, e.g. `trainer.wandb_log`);
        a hook that raises is logged and never stops training."""
        self.weights_version = 0
        """The version whose weights the trainer holds (0: fresh), the next step's parent."""
        self.totals = dict.fromkeys(RUN_TOTALS, 0)
        self._stale_since_step = 0
        """Groups dropped for staleness since the last step (reported with the next one)."""
        self._parents: dict[int, int] = {}
        self._waiting_since: float | None = None
        """When the current wait for serving began (`max_ahead_of_serving`); None: not waiting."""
        self._waited_out = False
        """The current wait ran past `max_wait_for_serving_s` (said once)."""

    async def resume(self) -> int:
        """Load the newest complete checkpoint, if any; return the step it restored (0: none)."""
        await asyncio.to_thread(checkpoints.remove_incomplete, self.root)
        latest = await asyncio.to_thread(checkpoints.latest_checkpoint, self.root)
        if latest is None:
            return 0
        state = await asyncio.to_thread(self.trainer.load, latest)
        step = self.trainer.step
        self.weights_version = step
        report = state.get("step_report") or {}
        self.totals = {k: int(report.get(k) or 0) for k in RUN_TOTALS}
        await self.store.mark_trained(list(state.get("group_ids") or []), step)
        await self.store.mark_trained(list(state.get("skipped_group_ids") or []), SKIPPED)
        known = {a.version for a in await self.store.list_adapters(self.policy)}
        if step not in known:
            await self._record(step, latest, state.get("step_report") or {})
        logger.info("training resumes after step %d (%s)", step, latest)
        return step

    async def run(self) -> None:
        """Train whenever enough scored groups are waiting; a failed step is tried again, except
        one that left the ranks of a data-parallel trainer out of step (`OutOfStep`: the process
        exits, torchrun stops the other ranks, the supervisor starts them all again)."""
        while True:
            try:
                report = await self.step_once()
            except (asyncio.CancelledError, OutOfStep):
                raise
            except Exception:
                logger.exception("training step failed; trying again in %.0f s", self.poll_s)
                report = None
            if report is None:
                await asyncio.sleep(self.poll_s)

    async def step_once(self, *, min_groups: int | None = None) -> StepReport | None:
        """One step if at least `min_groups` (default: groups_per_step) usable groups wait."""
        need = self.config.groups_per_step if min_groups is None else min_groups
        await self.leave_rolled_back()  # first: staleness is counted from the weights stepped
        serving, ahead, pending = await self.serving_lag()
        if self._wait_for_serving(serving, ahead, pending):
            return None
        found = await self._collect(self.config.groups_per_step)
        chosen, skipped, rewards = found.chosen, found.skipped, found.rewards
        await self._drop_stale(found.stale_dropped)
        if len(chosen) < max(need, 1):
            if skipped:
                await self.store.mark_trained(skipped, SKIPPED)
            return None
        parent = self.weights_version
        examples = [e for _, exs in chosen for e in exs]
        logger.info(
            "step %d: training on %d groups (%d turns in %d rows)",
            self.trainer.step + 1,
            len(chosen),
            sum(turns_in(e) for e in examples),
            len(examples),
        )
        started = time.perf_counter()
        group_ids = [g.id for g, _ in chosen]
        mean_reward = math.fsum(r / len(rewards) for r in rewards) if rewards else 0.0
        try:
            metrics = await asyncio.to_thread(self.trainer.train_step, examples)
        except (ValueError, FloatingPointError) as exc:
            # The trainer refused these examples (bad ids, a non-finite step) and changed
            # nothing: skip the groups rather than retry them forever.
            logger.error("step refused, skipping groups %s: %s", group_ids, exc)
            await self.store.mark_trained(group_ids + skipped, SKIPPED)
            return None
        self.totals["groups_trained_total"] += len(group_ids)
        self.totals["stale_downweighted_total"] += found.downweighted
        self.totals["stale_samples_dropped_total"] += found.samples_dropped
        self.totals["too_long_total"] += metrics.too_long
        report = StepReport(
            version=self.trainer.step,
            path=checkpoints.version_dir(self.root, self.trainer.step),
            group_ids=group_ids,
            skipped_group_ids=skipped,
            mean_reward=mean_reward,
            metrics={
                **metrics.to_dict(),
                "groups": len(group_ids),
                "skipped_groups": len(skipped),
                "mean_reward": mean_reward,
                "step_seconds": time.perf_counter() - started,
                "stale_dropped": self._stale_since_step,
                "stale_downweighted": found.downweighted,
                "stale_samples_dropped": found.samples_dropped,
                "staleness_max": max(found.staleness, default=0),
                "staleness_mean": sum(found.staleness) / max(len(found.staleness), 1),
                "serving_version": serving,
                "ahead_of_serving": ahead,
                **self.totals,
            },
        )
        self._stale_since_step = 0
        state = {
            "group_ids": group_ids,
            "skipped_group_ids": skipped,
            "policy": self.policy,
            "step_report": report.metrics,
            "parent": parent,
        }
        try:
            path = await asyncio.to_thread(self.trainer.save, self.root, state)
        except BaseException:
            # The step advanced the trainer but no version was written: go back to the last
            # written one so the next version number is not skipped.
            await self._rewind()
            raise
        report.path = path
        self.weights_version = report.version
        await self._record(report.version, path, report.metrics)
        await self.store.mark_trained(group_ids, report.version)
        if skipped:
            await self.store.mark_trained(skipped, SKIPPED)
        logger.info(
            "step %d: %d groups (%d skipped, %d turns too long), mean reward %.3f, loss %.4f, "
            "%.0f tokens/s -> %s",
            report.version,
            len(group_ids),
            len(skipped),
            metrics.too_long,
            report.mean_reward,
            metrics.loss,
            metrics.tokens_per_s,
            path,
        )
        for hook in self.step_hooks:
            try:
                await asyncio.to_thread(hook, report)
            except Exception:
                logger.exception("step hook %r failed on step %d", hook, report.version)
        return report

    async def serving_lag(self) -> tuple[int | None, int | None, bool]:
        """The version serving the policy name (from the policy state every replica follows),
        how many versions the trainer's weights are ahead of it (counted along the lineage, as
        staleness is), and whether serving still has a newer version to decide on: a canary on
        trial, or the newest version written and not yet loaded. (None, None, False) when the
        database holds no policy state (no server publishes this policy's versions)."""
        state = await self.store.get_policy_state(self.policy)
        if state is None:
            return None, None, False
        serving = state.active_version
        ahead = versions_behind(serving, lineage(self.weights_version, self._parent), self._parent)
        newest = await self.store.latest_adapter(self.policy)
        pending = state.canary_version is not None or (
            newest is not None and newest.version > serving and newest.status == "written"
        )
        return serving, ahead, pending

    def _wait_for_serving(self, serving: int | None, ahead: int | None, pending: bool) -> bool:
        """Whether to skip this step and wait (`max_ahead_of_serving`): the weights are that far
        ahead of what serves and serving has a newer version to decide on. With nothing pending
        (versions rejected, none written) it never waits, so it cannot stall; a stretch of
        waiting ends after `max_wait_for_serving_s`, and training then goes on until serving
        catches up."""
        limit = self.config.max_ahead_of_serving
        if limit is None or ahead is None or ahead < limit:
            if self._waiting_since is not None:
                logger.info("serving caught up (v%s serves); training goes on", serving)
            self._waiting_since, self._waited_out = None, False
            return False
        if not pending:
            return False
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
            logger.info(
                "waiting for serving: the weights (v%d) are %d versions ahead of v%s, which "
                "serves, and serving has a newer version to decide on (max_ahead_of_serving %d)",
                self.weights_version,
                ahead,
                serving,
                limit,
            )
        if now - self._waiting_since < self.config.max_wait_for_serving_s:
            return True
        if not self._waited_out:
            self._waited_out = True
            logger.warning(
                "waited %.0f s for serving to catch up (max_wait_for_serving_s); training on",
                now - self._waiting_since,
            )
        return False

    async def _drop_stale(self, group_ids: list[str]) -> None:
        """Mark groups dropped for staleness as skipped at once (a failed step must not count
        them twice) and count them for the next step's report."""
        if not group_ids:
            return
        await self.store.mark_trained(group_ids, SKIPPED)
        self._stale_since_step += len(group_ids)
        self.totals["stale_dropped_total"] += len(group_ids)
        logger.warning(
            "dropped %d groups generated more than %s versions behind version %d "
            "(max_staleness): %s",
            len(group_ids),
            self.config.max_staleness,
            self.weights_version,
            group_ids,
        )

    async def _collect(self, wanted: int) -> Collected:
        """Up to `wanted` usable scored groups (oldest first), within the staleness bound or
        weighted by it, and the ids of the others."""
        chosen: list[tuple[GroupDetail, list[TrainingExample]]] = []
        skipped: list[str] = []
        rewards: list[float] = []
        stale: list[str] = []
        staleness: list[int] = []
        downweighted = samples_dropped = 0
        ancestors = await asyncio.to_thread(lineage, self.weights_version, self._parent)
        cursor: str | None = None
        while len(chosen) < wanted:
            page = await self.store.list_groups(
                status="scored", untrained=True, oldest_first=True, limit=50, cursor=cursor
            )
            for summary in page.items:
                group = await read_group(self.store, summary.id, self.reward_policy)
                try:
                    examples = None if group is None else self.examples(group)
                except ValueError as exc:  # the group's own data (its rewards): skip it alone
                    logger.error("group %s cannot be trained on, skipping it: %s", summary.id, exc)
                    examples = None
                if group is None or not examples:
                    skipped.append(summary.id)
                    continue
                behind = await asyncio.to_thread(
                    samples_behind,
                    [e.behaviour_version for e in examples],
                    ancestors,
                    self._parent,
                )
                weights = [
                    staleness_weight(
                        b,
                        max_staleness=self.config.max_staleness,
                        policy=self.config.stale_policy,
                        stale_weight=self.config.stale_weight,
                    )
                    for b in behind
                ]
                # each sample alone: the advantages were taken over the whole group already
                kept = [
                    (replace(e, weight=e.weight * w) if w < 1.0 else e, b)
                    for e, w, b in zip(examples, weights, behind, strict=True)
                    if w > 0.0
                ]
                if not kept:
                    stale.append(summary.id)
                    continue
                samples_dropped += len(examples) - len(kept)
                downweighted += any(0.0 < w < 1.0 for w in weights)
                staleness.append(max(b for _, b in kept))
                examples = [e for e, _ in kept]
                chosen.append((group, examples))
                rewards += [m.reward for m in group.members if m.reward is not None]
                if len(chosen) == wanted:
                    break
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        return Collected(chosen, skipped, rewards, stale, downweighted, staleness, samples_dropped)

    def _parent(self, version: int) -> int:
        """The version `version` was trained from (its checkpoint's lineage), remembered once
        its folder exists: a written version's parent never changes."""
        if version in self._parents:
            return self._parents[version]
        parent = checkpoints.parent_version(self.root, version)
        if checkpoints.version_dir(self.root, version).is_dir():
            self._parents[version] = parent
        return parent

    def examples(self, group: GroupDetail) -> list[TrainingExample]:
        """The group's training examples; [] when it cannot be trained on."""
        rewards = [m.reward for m in group.members]
        if any(r is None for r in rewards):
            return []
        values = [float(r) for r in rewards if r is not None]
        if group.summary.source == "cohort" and self.config.cohort_advantage == "leave_one_out":
            advantages = leave_one_out_advantages(values)  # different tasks: trainer.grpo
        else:
            advantages = group_advantages(values, scale_by_std=self.config.scale_advantages_by_std)
        if advantages is None:
            return []  # zero variance: nothing to learn from this group
        out: list[TrainingExample] = []
        for member, advantage in zip(group.members, advantages, strict=True):
            turns: list[TrainingExample] = []
            for turn in member.turns:
                ids, logprobs = turn.completion_token_ids, turn.completion_logprobs
                if not turn.prompt_token_ids or not ids or not logprobs:
                    continue  # no token ids stored (upstream engine, failed call)
                turns.append(
                    TrainingExample(
                        sample_id=member.member_id,
                        prompt_ids=list(turn.prompt_token_ids),
                        completion_ids=list(ids),
                        old_logprobs=[float(x) for x in logprobs],
                        advantage=advantage,
                        behaviour_version=turn.adapter_version or 0,
                        logprobs_masked=turn.logprobs_after_grammar,
                    )
                )
            if self.config.pack_turns:
                turns = pack_turns(turns, self.trainer.max_seq_len)
            out += turns
        return out

    async def leave_rolled_back(self) -> None:
        """If the weights held descend from a rolled-back version, go back to the newest version
        whose lineage is clean (fresh weights if none); the step counter stays."""
        records = await self.store.list_adapters(self.policy)
        rolled = {a.version for a in records if (a.rollout or {}).get("state") == "rolled_back"}
        if not rolled:
            return
        trusted = {a.version for a in records if a.activated_at is not None}
        trusted -= rolled
        bad = checkpoints.rolled_back_ancestor(self.root, self.weights_version, rolled, trusted)
        if bad is None:
            return
        rejected = {a.version for a in records if a.status == "rejected"}
        step = self.trainer.step
        for version in sorted(checkpoints.list_versions(self.root), reverse=True):
            if version in rejected or checkpoints.rolled_back_ancestor(
                self.root, version, rolled, trusted
            ):
                continue
            await asyncio.to_thread(self.trainer.load, checkpoints.version_dir(self.root, version))
            self.weights_version = version
            break
        else:
            self.trainer.reset_adapter()
            self.weights_version = 0
        self.trainer.step = step
        logger.warning(
            "version %d was rolled back: training continues from %s (next version %d)",
            bad,
            f"version {self.weights_version}" if self.weights_version else "fresh weights",
            step + 1,
        )

    async def _rewind(self) -> None:
        latest = await asyncio.to_thread(checkpoints.latest_checkpoint, self.root)
        if latest is not None:
            await asyncio.to_thread(self.trainer.load, latest)
        else:
            self.trainer.step = 0
        logger.warning("checkpoint not written; trainer back at step %d", self.trainer.step)

    async def _record(self, version: int, path: Path, metrics: dict[str, Any]) -> None:
        now = time.time()
        await self.store.record_adapter(
            AdapterRecord(
                policy=self.policy,
                version=version,
                path=str(path),
                status="written",
                created_at=now,
                updated_at=now,
                metrics=metrics,
            )
        )
