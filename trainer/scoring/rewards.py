"""Which reward a group member trains on: the environment's, or the judge's score.

    group = await read_group(store, group_id, "explicit")   # members' `reward` chosen
    reward, source = pick_reward("ruler", explicit=1.0, judged=0.4)   # (0.4, "ruler")

The reward policy (`RLPROXY_REWARD_POLICY`) is decided here and only here; storage returns what
was posted and what was judged, side by side, and never chooses. "explicit" takes the reward
the environment posted for a trajectory member and falls back to the judge's score; "ruler" the
other way round. A sampled answer (a shadow member) has only the judge's score: an explicit
reward rewards the whole trajectory, not one of the answers sampled at a turn.

Training (`trainer.loop`), the judge's checks (its agreement with posted rewards), the canary
rollout's comparison of two versions and the group routes all read rewards through this module.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Literal, get_args

from storage.records import GroupDetail, PairedMember
from storage.store import Store

RewardPolicy = Literal["explicit", "ruler"]
RewardSource = Literal["explicit", "ruler"]
REWARD_POLICIES: tuple[str, ...] = get_args(RewardPolicy)


def pick_reward(
    policy: str, explicit: float | None, judged: float | None
) -> tuple[float | None, RewardSource | None]:
    """The training reward and where it came from, or (None, None) when there is neither."""
    if policy not in REWARD_POLICIES:
        raise ValueError(f"reward policy must be one of {REWARD_POLICIES}, not {policy!r}")
    order: tuple[RewardSource, RewardSource] = (
        ("explicit", "ruler") if policy == "explicit" else ("ruler", "explicit")
    )
    for source in order:
        value = explicit if source == "explicit" else judged
        if value is not None:
            return float(value), source
    return None, None


def choose_rewards(group: GroupDetail, policy: str) -> GroupDetail:
    """`group` with each member's `reward` and `reward_source` set by `policy` (in place)."""
    for m in group.members:
        judged = m.ruler.score if m.ruler is not None else None
        m.reward, m.reward_source = pick_reward(policy, m.explicit_reward, judged)
    return group


async def read_group(store: Store, group_id: str, policy: str) -> GroupDetail | None:
    """A group as training and the API see it: its members' rewards chosen by `policy`."""
    group = await store.get_group(group_id)
    return None if group is None else choose_rewards(group, policy)


def version_rewards(
    members: Iterable[PairedMember], old: int, new: int | Collection[int], policy: str
) -> tuple[list[float], list[float]]:
    """The rewards of the members served by version `old` and by `new` in one group (a canary
    rollout's paired evidence; several new versions: the rollout's watch, any of them counts);
    members with neither reward are left out."""
    news = {new} if isinstance(new, int) else set(new)
    old_rewards: list[float] = []
    new_rewards: list[float] = []
    for m in members:
        value, _ = pick_reward(policy, m.explicit, m.judged)
        if value is None:
            continue
        if m.version == old:
            old_rewards.append(value)
        elif m.version in news:
            new_rewards.append(value)
    return old_rewards, new_rewards
