"""The arithmetic agent's reward (examples/arithmetic_agent.py) pays for the task the prompt asks
for: the right number alone, clearly above the right number inside a sentence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from arithmetic_agent import held_out, practice_pairs, reward


@pytest.mark.parametrize("reply", ["25", " 25\n", "25."])
def test_the_right_number_alone_earns_full_reward(reply: str) -> None:
    assert reward(reply, 25) == 1.0


def test_a_sentence_holding_the_right_number_earns_well_below_the_exact_answer() -> None:
    sentences = ["11 + 14 = 25", "The answer is 25.", "25 is the sum of 11 and 14, of course."]
    assert all(0.2 <= reward(s, 25) <= 0.4 for s in sentences)


def test_shorter_replies_earn_more_within_each_kind() -> None:
    assert reward("11+14=25", 25) > reward("11 + 14 = 25", 25) > reward("The sum is 25 here", 25)
    assert reward("hm", 25) > reward("I am not sure what you mean", 25)


def test_ordering_exact_then_half_right_then_wrong_text() -> None:
    exact, wrong_alone = reward("25", 25), reward("24", 25)
    right_in_text, wrong_text = reward("11 + 14 = 25", 25), reward("11 + 14 = 24", 25)
    assert exact > right_in_text > wrong_text
    assert exact > wrong_alone > wrong_text


def test_no_wrong_number_alone_earns_less_than_a_quarter() -> None:
    """Below the right number in a sentence (0.25 * closeness was tried), the policy keeps
    "11 + 14 = 25" and never tries the bare number (measured: 0 % exact after 10 training
    minutes)."""
    assert min(reward(str(n), 25) for n in range(-50, 200) if n != 25) == 0.25


def test_a_long_ramble_without_the_answer_earns_nothing() -> None:
    assert reward("To add 11 and 14, we can do it manually just like this", 25) == 0.0


def test_held_out_questions_are_never_practised() -> None:
    assert not set(held_out()) & set(practice_pairs())
    assert len(held_out()) == 100
