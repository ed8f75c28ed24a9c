"""Which group a closed trajectory joins, and when a group is ready to be scored.

Sources, in order of precedence (the first that applies wins):

1. an explicit group key the client sent (header `X-RLProxy-Group`, `metadata.group_id`, or the
   body's `rlproxy.group_id`): source "explicit";
2. the task signature (hash of the system prompt, the first user message and the tool schemas),
   so an agent run several times on one task forms a group with no code change: source "task";
3. shadow samples (k answers sampled at one turn): formed by the store when the call is recorded,
   not here;
4. a cohort of the same agent (same owner, system prompt with its volatile parts masked, tool
   names: `storage.linking.agent_signature`) for a trajectory whose task group is still alone
   after `alone_s`: source "cohort". This is how live traffic trains, where every task is new
   and asked once; the trainer takes a cohort's advantages against a leave-one-out baseline
   (`trainer.grpo.leave_one_out_advantages`), since its members are different tasks. On by
   default; `cohort=False` leaves lone tasks waiting for a second run.

Groups never mix API keys: every key above is taken per owner (`GroupKey.owner`). A trajectory
of a task held out of training (`storage.held_out`) joins no group at all: the store never offers
it to this rule.

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
    cohort: bool = True
    """Move trajectories whose task group stayed alone for `alone_s` into a cohort group."""
    alone_s: float = 60.0
    """How long a task group of one waits for a second run of its task before its trajectory
    joins its agent's cohort. Runs of one task sent together (a practice harness, `n` retries)
    arrive within seconds; a task asked once never gets a second run."""

    def __post_init__(self) -> None:
        if self.min_size < 2:
            raise ValueError("min_size must be at least 2: a group of one cannot be compared")
        if self.max_size < self.min_size:
            raise ValueError(f"max_size ({self.max_size}) must be >= min_size ({self.min_size})")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0 seconds")
        if self.alone_s < 0:
            raise ValueError("alone_s must be >= 0 seconds")

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
        if now - group.created_at < self.alone_s:
            return None
        return self._cohort(candidate)

    def _cohort(self, candidate: GroupCandidate) -> GroupKey:
        signature = agent_signature(candidate.first_messages, candidate.tools)
        return GroupKey("cohort", signature, candidate.owner_key_id)
