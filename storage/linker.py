"""The interface between the store and a trajectory-linking policy.

The store owns the SQL: for each call it asks the linker for hashes (`keys`), looks up the open
trajectories those hashes point at (plus the trajectory named by an explicit id), and asks the
linker which one the call joins (`choose`). It then writes the decision in the same transaction
as the call row. The policy itself (canonical messages, hashing, retry rules) lives in
`trainer.linking`; storage never imports it.

`ExplicitIdsOnly` is the fallback when no linker is given: explicit ids are honoured and every
other call opens its own trajectory. It is not what a serving proxy wants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from storage.records import CallRecord, LinkDecision, LinkKeys, TrajectoryState


class Linker(Protocol):
    def keys(self, record: CallRecord) -> LinkKeys:
        """Hashes for `record`; pure, no I/O (it runs inside the write transaction)."""
        ...

    def choose(
        self,
        record: CallRecord,
        keys: LinkKeys,
        explicit: TrajectoryState | None,
        candidates: Sequence[TrajectoryState],
    ) -> LinkDecision:
        """Pick the trajectory for `record`; pure, no I/O.

        `explicit` is the trajectory named by `record.explicit_trajectory_id` (None when the call
        has no explicit id or the id does not exist yet). `candidates` are the open trajectories
        whose `next_prefix_hash` is in `keys.prefix_hashes` or whose `last_request_hash` equals
        `keys.request_hash`.
        """
        ...


class ExplicitIdsOnly:
    """Fallback linker: explicit ids only, otherwise a new trajectory per call."""

    def keys(self, record: CallRecord) -> LinkKeys:
        return LinkKeys(prefix_hashes={}, request_hash=None, next_prefix_hash=None)

    def choose(
        self,
        record: CallRecord,
        keys: LinkKeys,
        explicit: TrajectoryState | None,
        candidates: Sequence[TrajectoryState],
    ) -> LinkDecision:
        if explicit is not None:
            return LinkDecision("append", explicit.id)
        return LinkDecision("new", record.explicit_trajectory_id)
