"""The held-out split: which tasks never train, and which of them the base model answers.

A share of the user's tasks (`RLPROXY_EVAL_SHARE`) is kept out of training so that versions can
be measured on traffic they were not trained on (`proxy.adapters.evaluation`). A task is its
agent and its task signature (`storage.linking.agent_signature`, `task_signature`: the system
prompt, the first user message and the tool schemas), under one API key. One hash decides both
facts, so every replica, before and after a restart, decides the same for every call of a task:

    digest = blake2b(owner seed | agent signature | task signature), 16 bytes
    held out   when its first 8 bytes, read as a number in [0, 1), fall under `share`
    arm        "base" when its last 8 bytes fall under 1/2, else "policy"

The two halves are independent, so raising the share adds tasks to both arms and moves none
from one arm to the other. The owner seed is the trajectory linker's (`storage.linking`): the
same task under two keys draws twice.

- A held-out task's trajectories are stored, served and rewarded as usual, and marked
  `held_out` when they are created (from the call that opens them). Grouping never takes a
  marked trajectory, and its calls form no shadow group (`storage.group_ops`,
  `storage.write_ops`): no group holds one, so no training step, judge pass or canary rollout
  can read one.
- A client can mark a call held out itself (`X-RLProxy-Held-Out: true`, or `held_out` in
  `metadata` or the body's `rlproxy`): an evaluation run, the user's agent re-running tasks
  pinned to `NAME@base` and `NAME@N` to compare them (`proxy.adapters.evaluation`'s re-runs).
  It is held out whatever the draw, and in the arm its task draws.
- Arm "base": a call for the policy name (or an alias) is served by the base model, the
  control; arm "policy": routed as any call (the active version, or a canary's draw). The
  router applies it (`proxy.adapters.registry.ServedModels.route`); pins (`NAME@N`,
  `NAME@base`) are served as asked.

This module is the pure rule: no I/O. The proxy computes it per call (`proxy.chat.service`) and
the call record carries the answer to the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from storage.linking import _owner_seed, agent_signature, task_signature

Arm = Literal["base", "policy"]
"""Who answers a held-out task for the policy name: the base model (the control) or whatever
the policy name serves."""


def split_draws(
    owner: str | None, messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None
) -> tuple[float, float]:
    """The task's two independent draws in [0, 1): (held out?, which arm?)."""
    key = "\n".join(
        (_owner_seed(owner), agent_signature(messages, tools), task_signature(messages, tools))
    )
    digest = hashlib.blake2b(f"held-out\n{key}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64, int.from_bytes(digest[8:], "big") / 2.0**64


@dataclass(frozen=True)
class HeldOutSplit:
    """`share` of the tasks held out of training (0: none drawn; marked calls still are)."""

    share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 0.5:
            raise ValueError(
                f"the held-out share must be between 0 and 0.5, not {self.share}: past half the "
                "tasks, more traffic would be measured than trained on"
            )

    def arm(
        self,
        owner: str | None,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[Any] | None,
        *,
        marked: bool = False,
    ) -> Arm | None:
        """None when the task trains as usual; else the arm of the held-out task. `marked`: the
        client marked the call held out (an evaluation run, `X-RLProxy-Held-Out`): held out
        whatever the share (0 included), in the arm its task draws."""
        if self.share <= 0.0 and not marked:
            return None
        held, arm = split_draws(owner, messages, tools)
        if held >= self.share and not marked:
            return None
        return "base" if arm < 0.5 else "policy"


NO_HELD_OUT = HeldOutSplit()
"""The split that holds nothing out (the judge's own chat service; RLPROXY_EVAL_SHARE=0)."""
