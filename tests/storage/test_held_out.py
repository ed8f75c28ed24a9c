"""The held-out split's rule: stable, by task and key, its share, arms independent of it."""

from __future__ import annotations

from typing import Any

import pytest

from storage.held_out import HeldOutSplit, split_draws

TOOLS = [{"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}]


def _task(i: int, system: str = "You look things up.") -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"task {i}"}]


def test_off_holds_nothing_out() -> None:
    assert all(HeldOutSplit(0.0).arm(None, _task(i), TOOLS) is None for i in range(200))


def test_about_the_share_of_tasks_is_held_out_and_half_of_them_go_to_the_base() -> None:
    split = HeldOutSplit(0.2)
    arms = [split.arm(None, _task(i), TOOLS) for i in range(4000)]
    held = [a for a in arms if a is not None]
    assert 0.17 < len(held) / len(arms) < 0.23
    assert 0.42 < held.count("base") / len(held) < 0.58


def test_every_turn_of_a_task_draws_the_same() -> None:
    first = _task(7)
    later = [*first, {"role": "assistant", "content": "find"}, {"role": "user", "content": "go"}]
    assert split_draws(None, first, TOOLS) == split_draws(None, later, TOOLS)


def test_the_same_task_under_two_keys_draws_twice() -> None:
    draws = {split_draws(owner, _task(1), TOOLS) for owner in (None, "key-a", "key-b")}
    assert len(draws) == 3


def test_another_agent_with_the_same_question_draws_again() -> None:
    assert split_draws(None, _task(1), TOOLS) != split_draws(None, _task(1, "Other."), TOOLS)


def test_raising_the_share_adds_tasks_and_moves_none_between_arms() -> None:
    small, large = HeldOutSplit(0.1), HeldOutSplit(0.3)
    for i in range(1000):
        before, after = small.arm(None, _task(i), TOOLS), large.arm(None, _task(i), TOOLS)
        if before is not None:
            assert after == before


@pytest.mark.parametrize("share", [-0.1, 0.6])
def test_a_share_out_of_bounds_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="held-out share"):
        HeldOutSplit(share)
