"""The statistics of the judge checks on hand-made numbers (worked out by hand in the comments)."""

from __future__ import annotations

import math

import pytest

from trainer.scoring.judge_stats import (
    average_ranks,
    kendall_tau_b,
    mean_interval,
    median,
    spearman_rho,
    std,
    wilson_interval,
)


def test_median_of_odd_and_even_counts() -> None:
    assert median([0.9, 0.1, 0.5]) == 0.5
    assert median([0.2, 0.8, 0.4, 0.6]) == 0.5  # (0.4 + 0.6) / 2
    with pytest.raises(ValueError):
        median([])


def test_tied_values_share_the_mean_of_their_ranks() -> None:
    assert average_ranks([5, 7, 5]) == [1.5, 3.0, 1.5]
    assert average_ranks([3, 1, 2]) == [3.0, 1.0, 2.0]


def test_kendall_tau_b_counts_concordant_and_discordant_pairs() -> None:
    assert kendall_tau_b([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau_b([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # pairs (a,b) concordant, (a,c) concordant, (b,c) discordant: (2 - 1) / 3
    assert kendall_tau_b([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_kendall_tau_b_corrects_for_ties() -> None:
    # x = [1, 1, 2]: pair (0,1) tied in x; (0,2), (1,2) concordant. n0 = 3, tx = 1, ty = 0:
    # 2 / sqrt((3 - 1) * (3 - 0)) = 0.8165
    assert kendall_tau_b([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))


def test_kendall_tau_b_is_undefined_for_a_constant_ranking() -> None:
    assert kendall_tau_b([0.5, 0.5, 0.5], [0.1, 0.2, 0.3]) is None
    assert kendall_tau_b([1.0], [1.0]) is None
    with pytest.raises(ValueError):
        kendall_tau_b([1, 2], [1])


def test_spearman_is_pearson_on_average_ranks() -> None:
    # ranks of y = [5, 6, 7, 8, 7] are [1, 2, 3.5, 5, 3.5]; deviations from 3:
    # x: -2 -1 0 1 2, y: -2 -1 .5 2 .5 -> sxy = 8, sxx = 10, syy = 9.5 -> 8 / sqrt(95)
    assert spearman_rho([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert spearman_rho([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman_rho([1, 2, 3], [2, 2, 2]) is None
    assert spearman_rho([1], [1]) is None


def test_wilson_interval_on_known_values() -> None:
    # 18 of 20: centre (0.9 + 1.9208/20) / (1 + 3.8415/20) = 0.8357, half-width 0.1365
    low, high = wilson_interval(18, 20)
    assert low == pytest.approx(0.6990, abs=1e-4)
    assert high == pytest.approx(0.9721, abs=1e-4)
    # 0 of 20: the lower bound is 0 and the upper is z^2 / (n + z^2) = 3.8415 / 23.8415
    low, high = wilson_interval(0, 20)
    assert low == 0.0
    assert high == pytest.approx(0.16113, abs=1e-4)
    assert wilson_interval(20, 20)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_mean_interval_is_mean_plus_minus_z_standard_errors() -> None:
    # mean 0.7, sample sd 0.2, se 0.2 / sqrt(3) = 0.11547, half-width 1.96 * se = 0.22632
    mean, low, high = mean_interval([0.5, 0.7, 0.9]) or (0.0, 0.0, 0.0)
    assert mean == pytest.approx(0.7)
    assert low == pytest.approx(0.7 - 0.22632, abs=1e-4)
    assert high == pytest.approx(0.7 + 0.22632, abs=1e-4)
    assert mean_interval([0.3]) is None


def test_population_std() -> None:
    assert std([2, 4, 4, 4, 5, 5, 7, 9]) == 2.0
    assert std([3]) == 0.0
