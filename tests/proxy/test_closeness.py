"""The closeness bound (`proxy.adapters.closeness`) on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch

from proxy.adapters.closeness import episode_bound, sequence_kl, summarise


def test_an_episode_bound_is_pinsker_summed_over_its_calls_and_capped_at_one() -> None:
    assert episode_bound([0.02]) == pytest.approx(0.1)  # sqrt(0.02 / 2)
    assert episode_bound([0.02, 0.08]) == pytest.approx(0.1 + 0.2)
    assert episode_bound([0.0, 0.0]) == 0.0
    assert episode_bound([5.0]) == 1.0


def test_the_bound_is_the_mean_plus_two_standard_errors() -> None:
    episodes = [[0.0], [0.02], [0.0], [0.02]]  # bounds 0, 0.1, 0, 0.1
    result = summarise(episodes, left_out=1, min_episodes=4)
    sd = math.sqrt(4 * 0.05**2 / 3)
    assert result.mean == pytest.approx(0.05)
    assert result.bound == pytest.approx(0.05 + 2 * sd / 2)
    assert (result.episodes, result.calls, result.left_out) == (4, 4, 1)
    assert result.mean_kl_per_call == pytest.approx(0.01)


def test_too_few_episodes_give_no_bound() -> None:
    result = summarise([[0.0], [0.0]], left_out=3, min_episodes=4)
    assert result.bound is None and "2 of 4" in result.reason


def test_sequence_kl_sums_positions_and_tempers_both_rows() -> None:
    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    both = torch.stack([p, q])  # (2, T=2, V=2)
    kl = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert sequence_kl(both, 1.0) == pytest.approx(kl, abs=1e-6)
    # at temperature 0.5 the first row sharpens to (0.81, 0.01) / 0.82 at position 2
    sharp = torch.tensor([0.81, 0.01]) / 0.82
    expected = float((sharp * (sharp.log() - math.log(0.5))).sum())
    assert sequence_kl(both, 0.5) == pytest.approx(expected, abs=1e-6)
    assert sequence_kl(torch.stack([p, p]), 0.7) == pytest.approx(0.0, abs=1e-7)
