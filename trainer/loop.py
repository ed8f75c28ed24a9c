"""The background training loop: scored groups in, adapter versions out.

    loop = TrainingLoop(store, PeftTrainer(model_dir, config), checkpoints_root, policy="rlproxy")
    await loop.resume()      # pick up where a previous run stopped
    await loop.run()         # forever: take scored groups, one GRPO step, write version N

One step: the oldest scored groups not yet used (`groups_per_step` of them) give each member an
advantage (`trainer.grpo.group_advantages` over the rewards chosen by the reward policy);
zero-variance groups are skipped and counted. Every assistant turn of a member becomes a
`TrainingExample` from the token ids stored when it was sampled (never re-rendered text). The
trainer makes one optimizer step, the checkpoint is written atomically as version N
(`trainer.checkpoints`), recorded in the database, and the groups are marked used with step N.
Serving notices the new folder, loads it and flips the policy name (`proxy.adapters.publisher`).

Restart: the newest complete checkpoint restores weights, optimizer state and the step; the
group ids it lists are marked used again, in case the process died between writing the
checkpoint and marking them. A checkpoint is complete only once renamed into place, so a killed
step leaves nothing that serving or a restart would load.

Groups marked with `trained_step = 0` were looked at and skipped (zero variance, no reward, or
no stored token ids); they never contributed a gradient.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.records import AdapterRecord, GroupDetail
from storage.store import Store
from trainer import checkpoints
from trainer.grpo import TrainingExample, group_advantages
from trainer.peft_backend import PeftTrainer

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

    async def resume(self) -> int:
        """Load the newest complete checkpoint, if any; return the step it restored (0: none)."""
        await asyncio.to_thread(checkpoints.remove_incomplete, self.root)
        latest = await asyncio.to_thread(checkpoints.latest_checkpoint, self.root)
        if latest is None:
            return 0
        state = await asyncio.to_thread(self.trainer.load, latest)
        step = self.trainer.step
        self.weights_version = step
        await self.store.mark_trained(list(state.get("group_ids") or []), step)
        await self.store.mark_trained(list(state.get("skipped_group_ids") or []), SKIPPED)
        known = {a.version for a in await self.store.list_adapters(self.policy)}
        if step not in known:
            await self._record(step, latest, state.get("step_report") or {})
        logger.info("training resumes after step %d (%s)", step, latest)
        return step

    async def run(self) -> None:
        """Train whenever enough scored groups are waiting; never stops on a bad step."""
        while True:
            try:
                report = await self.step_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("training step failed; trying again in %.0f s", self.poll_s)
                report = None
            if report is None:
                await asyncio.sleep(self.poll_s)

    async def step_once(self, *, min_groups: int | None = None) -> StepReport | None:
        """One step if at least `min_groups` (default: groups_per_step) usable groups wait."""
        need = self.config.groups_per_step if min_groups is None else min_groups
        chosen, skipped, rewards = await self._collect(self.config.groups_per_step)
        if len(chosen) < max(need, 1):
            if skipped:
                await self.store.mark_trained(skipped, SKIPPED)
            return None
        await self.leave_rolled_back()
        parent = self.weights_version
        examples = [e for _, exs in chosen for e in exs]
        logger.info(
            "step %d: training on %d groups (%d turns)",
            self.trainer.step + 1,
            len(chosen),
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
            },
        )
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
            "step %d: %d groups (%d skipped), mean reward %.3f, loss %.4f, %.0f tokens/s -> %s",
            report.version,
            len(group_ids),
            len(skipped),
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

    async def _collect(
        self, wanted: int
    ) -> tuple[list[tuple[GroupDetail, list[TrainingExample]]], list[str], list[float]]:
        """Up to `wanted` usable scored groups (oldest first) and the ids of unusable ones."""
        chosen: list[tuple[GroupDetail, list[TrainingExample]]] = []
        skipped: list[str] = []
        rewards: list[float] = []
        cursor: str | None = None
        while len(chosen) < wanted:
            page = await self.store.list_groups(
                status="scored", untrained=True, oldest_first=True, limit=50, cursor=cursor
            )
            for summary in page.items:
                group = await self.store.get_group(summary.id, reward_policy=self.reward_policy)
                try:
                    examples = None if group is None else self.examples(group)
                except ValueError as exc:  # the group's own data (its rewards): skip it alone
                    logger.error("group %s cannot be trained on, skipping it: %s", summary.id, exc)
                    examples = None
                if group is None or not examples:
                    skipped.append(summary.id)
                    continue
                chosen.append((group, examples))
                rewards += [m.reward for m in group.members if m.reward is not None]
                if len(chosen) == wanted:
                    break
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        return chosen, skipped, rewards

    def examples(self, group: GroupDetail) -> list[TrainingExample]:
        """The group's training examples; [] when it cannot be trained on."""
        rewards = [m.reward for m in group.members]
        if any(r is None for r in rewards):
            return []
        advantages = group_advantages(
            [float(r) for r in rewards if r is not None],
            scale_by_std=self.config.scale_advantages_by_std,
        )
        if advantages is None:
            return []  # zero variance: nothing to learn from this group
        out = []
        for member, advantage in zip(group.members, advantages, strict=True):
            for turn in member.turns:
                ids, logprobs = turn.completion_token_ids, turn.completion_logprobs
                if not turn.prompt_token_ids or not ids or not logprobs:
                    continue  # no token ids stored (upstream engine, failed call)
                out.append(
                    TrainingExample(
                        sample_id=member.member_id,
                        prompt_ids=list(turn.prompt_token_ids),
                        completion_ids=list(ids),
                        old_logprobs=[float(x) for x in logprobs],
                        advantage=advantage,
                    )
                )
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
