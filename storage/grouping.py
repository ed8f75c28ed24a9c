"""Which group a closed trajectory joins, and when a group is ready to be scored.

Sources, in order of precedence (the first that applies wins):

1. an explicit group key the client sent (header `X-RLProxy-Group`, `metadata.group_id`, or the
   body's `rlproxy.group_id`): source "explicit";
2. the task signature (hash of the system prompt, the first user message and the tool schemas),
   so an agent run several times on one task forms a group with no code change: source "task";
3. shadow samples (k answers sampled at one turn): formed by the store when the call is recorded,
   not here;
4. a cohort (same agent: same system prompt and tools), only when enabled, and only for a
   trajectory whose task group did not fill within the window: source "cohort".

Groups never mix API keys: every key above is taken per owner (`GroupKey.owner`).

A forming group is ready when it has `min_size` members, or when its window has passed and it has
at least two. A part never grows past `max_size`; the next member starts a new part. This module
is the pure rule: the store (`storage.group_ops`) does the SQL and calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

from storage.linking import agent_signature
from storage.records import GroupCandidate, GroupKey, GroupState


@dataclass
class SignatureGrouper:
    min_size: int = 4
    """A forming group with this many closed members is ready."""
    max_size: int = 8
    """Groups larger than this are split into parts of at most this many."""
    window_s: float = 600.0
    """After this long, a forming group with at least two members is ready anyway."""
    cohort: bool = False
    """Move trajectories whose task group stayed alone past the window into a cohort group."""

    def __post_init__(self) -> None:
        if self.min_size < 2:
            raise ValueError("min_size must be at least 2: a group of one cannot be compared")
        if self.max_size < self.min_size:
            raise ValueError(f"max_size ({self.max_size}) must be >= min_size ({self.min_size})")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0 seconds")

    def assign(self, candidate: GroupCandidate) -> GroupKey | None:
        if candidate.group_key:
            return GroupKey("explicit", candidate.group_key, candidate.owner_key_id)
        if candidate.task_signature:
            return GroupKey("task", candidate.task_signature, candidate.owner_key_id)
        if self.cohort:
            return self._cohort(candidate)
        return None

    def is_ready(self, group: GroupState, now: float) -> bool:
        if group.member_count >= self.min_size:
            return True
        return group.member_count >= 2 and now - group.created_at >= self.window_s

    def fallback(self, group: GroupState, candidate: GroupCandidate, now: float) -> GroupKey | None:
        if not self.cohort or group.source != "task" or group.member_count >= 2:
            return None
        if now - group.created_at < self.window_s:
            return None
        return self._cohort(candidate)

    def _cohort(self, candidate: GroupCandidate) -> GroupKey:
        signature = agent_signature(candidate.first_messages, candidate.tools)
        return GroupKey("cohort", signature, candidate.owner_key_id)
