"""Groups without a judge: closed trajectories into groups, and rewarded groups scored.

    grouping = Grouping(store, grouper)
    await grouping.step()             # one pass: form groups, then settle the rewarded ones
    await grouping.run(interval_s=5)  # forever: a background task of `rlproxy serve`

Neither half needs a judge, so neither waits for one: `rlproxy serve` runs this task whether
`RLPROXY_SCORING` is on or off, and the scorer (`scoring.py`) only judges what is ready: a team
with its own rewards and no judge still sees its trajectories grouped and trained on. `rlproxy
score` forms groups through this class too; nothing else forms them.

"Settled" groups are the ready ones whose every member is a trajectory the environment rewarded:
they are marked scored from those rewards (judge model "explicit"), as the scorer does when it
meets one. With `settle_explicit=False` (RLPROXY_JUDGE_EXPLICIT_GROUPS with scoring on) they are
left to the judge. Which group a trajectory joins is `storage.grouping`; the SQL is the store's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from storage.group_ops import FormResult
from storage.grouping import SignatureGrouper
from storage.store import Store

logger = logging.getLogger(__name__)


@dataclass
class GroupingPass:
    """What one `Grouping.step` did."""

    formed: FormResult
    settled: list[str] = field(default_factory=list)
    """Groups scored from their explicit rewards, with no judge call."""


class Grouping:
    def __init__(
        self, store: Store, grouper: SignatureGrouper, *, settle_explicit: bool = True
    ) -> None:
        self.store = store
        self.grouper = grouper
        self.settle_explicit = settle_explicit

    async def step(self) -> GroupingPass:
        formed = await self.store.form_groups(self.grouper)
        result = GroupingPass(formed)
        if self.settle_explicit:
            while batch := await self.store.settle_explicit_groups():
                result.settled += batch
        if formed.ready or result.settled:
            logger.info(
                "%d groups ready, %d scored from their explicit rewards (no judge)",
                len(formed.ready),
                len(result.settled),
            )
        return result

    async def run(self, interval_s: float) -> None:
        """`step`, then sleep; forever, surviving any error."""
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the grouping pass failed; trying again in %.0f s", interval_s)
            await asyncio.sleep(interval_s)
