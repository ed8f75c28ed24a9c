"""The canary rollout's test (`proxy.adapters.rollout_stats`) on hand-made numbers."""

from __future__ import annotations

import math

import pytest

from proxy.adapters.rollout_stats import (
    RolloutTest,
    compare,
    paired_differences,
    t_cdf,
    t_quantile,
)


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [
        (0.975, 10, 2.228139),  # two-sided 95 %, the textbook table
        (0.95, 5, 2.015048),
        (0.99, 2, 6.964557),
        (0.975, 1, 12.706205),
        (0.95, 1000, 1.646379),  # close to the normal 1.644854
        (0.05, 5, -2.015048),
    ],
)
def test_t_quantiles_match_the_tables(p: float, df: int, expected: float) -> None:
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-5)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_t_cdf_is_symmetric_and_centred() -> None:
    assert t_cdf(0.0, 3) == 0.5
    assert t_cdf(1.3, 7) + t_cdf(-1.3, 7) == pytest.approx(1.0, abs=1e-12)


def test_looks_double_from_min_to_max() -> None:
    assert RolloutTest(min_groups=8, max_groups=64).looks() == [8, 16, 32, 64]
    assert RolloutTest(min_groups=4, max_groups=10).looks() == [4, 8, 10]
    assert RolloutTest(min_groups=5, max_groups=5).looks() == [5]


def test_differences_are_new_mean_minus_old_mean_per_group() -> None:
    pairs = [([0.2, 0.4], [0.9]), ([1.0], [0.0, 0.5])]
    assert paired_differences(pairs) == pytest.approx([0.6, -0.75])


def test_waits_before_the_first_look() -> None:
    test = RolloutTest(margin=0.1, alpha=0.05, min_groups=4, max_groups=8)
    result = compare([([0.0], [1.0])] * 3, test)
    assert result.decision == "wait"
    assert result.n == 0 and result.groups == 3


def test_a_clearly_better_version_is_promoted() -> None:
    # d = 0.3, 0.5, 0.4, 0.2: mean 0.35, sd 0.1291; looks [4, 8], alpha per look 0.025,
    # t_{0.975, 3} = 3.182446: lower = 0.35 - 3.182446 * 0.1291 / 2 = 0.1446 > -0.1
    pairs = [([0.5], [0.8]), ([0.2], [0.7]), ([0.4], [0.8]), ([0.6], [0.8])]
    result = compare(pairs, RolloutTest(margin=0.1, alpha=0.05, min_groups=4, max_groups=8))
    assert result.decision == "promote"
    assert result.n == 4
    assert result.mean_diff == pytest.approx(0.35)
    assert result.sd_diff == pytest.approx(math.sqrt(0.05 / 3))
    assert result.t_critical == pytest.approx(3.182446, abs=1e-5)
    assert result.lower == pytest.approx(0.35 - 3.182446 * math.sqrt(0.05 / 3) / 2, abs=1e-5)
    assert result.alpha_per_look == pytest.approx(0.025)
    assert result.old_mean == pytest.approx(0.425) and result.new_mean == pytest.approx(0.775)


def test_a_clearly_worse_version_is_rolled_back() -> None:
    # d = -0.5, -0.4, -0.6, -0.5: mean -0.5, sd 0.0816; upper = -0.5 + 3.1824 * 0.0408 < 0
    pairs = [([0.9], [0.4]), ([0.8], [0.4]), ([0.7], [0.1]), ([1.0], [0.5])]
    result = compare(pairs, RolloutTest(margin=0.1, alpha=0.05, min_groups=4, max_groups=8))
    assert result.decision == "roll_back"
    assert result.upper is not None and result.upper < 0
    assert "worse" in result.reason


def test_slightly_worse_within_the_margin_is_promoted() -> None:
    # every d = -0.02 (sd 0): lower = upper = -0.02, above -0.05: non-inferior though worse
    pairs = [([0.5], [0.48])] * 4
    result = compare(pairs, RolloutTest(margin=0.05, alpha=0.05, min_groups=4, max_groups=8))
    assert result.decision == "promote"
    assert result.sd_diff == 0.0


def test_noise_waits_then_rolls_back_at_the_last_look() -> None:
    # d alternates +0.5 / -0.5: mean 0, wide bounds: undecided at 4, at 8 (max) rolled back
    noisy = [([0.25], [0.75]), ([0.75], [0.25])]
    test = RolloutTest(margin=0.05, alpha=0.05, min_groups=4, max_groups=8)
    assert compare(noisy * 2, test).decision == "wait"
    assert compare(noisy * 3, test).decision == "wait"  # 6 groups: still the look at 4
    final = compare(noisy * 4, test)
    assert final.decision == "roll_back"
    assert final.n == 8 and "not shown" in final.reason


def test_a_look_uses_only_its_first_n_groups() -> None:
    # groups 5..7 are terrible, but the look at 4 only sees the first four (all +0.4)
    pairs = [([0.1], [0.5])] * 4 + [([1.0], [0.0])] * 3
    result = compare(pairs, RolloutTest(margin=0.05, alpha=0.05, min_groups=4, max_groups=8))
    assert result.decision == "promote" and result.n == 4 and result.groups == 7


def test_groups_missing_a_version_count_nowhere() -> None:
    # The second and fourth entries hold one version only: the look at 4 uses the four
    # complete groups, and the means come from those same groups.
    same = ([0.5], [0.6])
    pairs = [same, ([], [0.0]), same, ([1.0], []), same, same]
    result = compare(pairs, RolloutTest(margin=0.05, alpha=0.05, min_groups=4, max_groups=8))
    assert result.groups == 4 and result.n == 4
    assert result.mean_diff == pytest.approx(0.1) and result.sd_diff == pytest.approx(0.0)
    assert result.old_mean == pytest.approx(0.5) and result.new_mean == pytest.approx(0.6)


def test_bad_parameters_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="min_groups"):
        RolloutTest(min_groups=1)
    with pytest.raises(ValueError, match="max_groups"):
        RolloutTest(min_groups=8, max_groups=4)
    with pytest.raises(ValueError, match="alpha"):
        RolloutTest(alpha=0.7)
