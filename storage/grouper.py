"""The interface between the store and a grouping policy.

The store owns the SQL: it finds closed trajectories that are in no trajectory group yet, asks the
grouper which group each belongs to (`assign`), adds it to that group's forming part (a new part
once a part holds `max_size` members, so large groups are split), then asks which forming groups
are ready (`is_ready`) and, for groups that stayed too small, where their members go instead
(`fallback`, e.g. a cohort). The policy itself lives in `trainer.grouping`; storage never imports
it. Shadow groups (several samples at one turn) are formed when their call is recorded and are
ready at once; they never pass through a grouper.
"""

from __future__ import annotations

from typing import Protocol

from storage.records import GroupCandidate, GroupKey, GroupState


class Grouper(Protocol):
    max_size: int
    """A forming group never holds more members than this; the next member starts a new part."""

    def assign(self, candidate: GroupCandidate) -> GroupKey | None:
        """The group `candidate` joins, or None to leave it ungrouped for now; pure, no I/O."""
        ...

    def is_ready(self, group: GroupState, now: float) -> bool:
        """Whether a forming group can be scored now."""
        ...

    def fallback(self, group: GroupState, candidate: GroupCandidate, now: float) -> GroupKey | None:
        """Where a member of a forming group that will not fill goes instead, or None to stay."""
        ...
