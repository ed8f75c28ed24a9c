"""The canary rollout's test (`proxy.adapters.rollout_stats`) on hand-made numbers."""

from __future__ import annotations

import math

import pytest

from proxy.adapters.rollout_stats import (
    RolloutTest,
    at_budget,
    compare,
    log_likelihood_ratio,
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


def test_walds_bounds_follow_alpha_and_beta() -> None:
    test = RolloutTest(alpha=0.05, beta=0.1)
    assert test.roll_back_at == pytest.approx(math.log(0.9 / 0.05))  # 2.890
    assert test.promote_at == pytest.approx(math.log(0.1 / 0.95))  # -2.251


def test_the_log_likelihood_ratio_by_hand() -> None:
    # margin 0.2, sd 0.5: each d adds (-0.2 d - 0.02) / 0.25
    assert log_likelihood_ratio([0.0], 0.2, 0.5) == pytest.approx(-0.08)
    assert log_likelihood_ratio([-0.2], 0.2, 0.5) == pytest.approx(0.08)
    assert log_likelihood_ratio([-0.1], 0.2, 0.5) == pytest.approx(0.0)  # halfway: no evidence
    assert log_likelihood_ratio([0.5, -0.5], 0.2, 0.5) == pytest.approx(-0.16)


def test_differences_are_new_mean_minus_old_mean_per_group() -> None:
    pairs = [([0.2, 0.4], [0.9]), ([1.0], [0.0, 0.5])]
    assert paired_differences(pairs) == pytest.approx([0.6, -0.75])


def test_waits_before_min_groups() -> None:
    test = RolloutTest(min_groups=4, max_groups=8)
    result = compare([([0.0], [1.0])] * 3, test)
    assert result.decision == "wait" and result.llr is None
    assert result.groups == 3 and "3 of 4" in result.reason


def test_a_clearly_better_version_is_promoted() -> None:
    # d = 0.3, 0.5, 0.4, 0.2: mean 0.35, sd 0.1291 (below min_sd 0.25, so 0.25 is used):
    # LLR = sum(-0.2 d - 0.02) / 0.0625 = (-0.28 - 0.08) / 0.0625 = -5.76 <= -2.251
    pairs = [([0.5], [0.8]), ([0.2], [0.7]), ([0.4], [0.8]), ([0.6], [0.8])]
    result = compare(pairs, RolloutTest(min_groups=4, max_groups=8))
    assert result.decision == "promote"
    assert result.groups == 4
    assert result.mean_diff == pytest.approx(0.35)
    assert result.sd_diff == pytest.approx(math.sqrt(0.05 / 3))
    assert result.llr == pytest.approx(-5.76)
    half = t_quantile(0.95, 3) * math.sqrt(0.05 / 3) / 2
    assert result.lower == pytest.approx(0.35 - half) and result.upper == pytest.approx(0.35 + half)
    assert result.old_mean == pytest.approx(0.425) and result.new_mean == pytest.approx(0.775)
    assert "not harmful" in result.reason


def test_a_clearly_worse_version_is_rolled_back() -> None:
    # d = -0.5, -0.4, -0.6, -0.5 (sd 0.0816 -> 0.25): LLR = (0.4 - 0.08) / 0.0625 = 5.12
    pairs = [([0.9], [0.4]), ([0.8], [0.4]), ([0.7], [0.1]), ([1.0], [0.5])]
    result = compare(pairs, RolloutTest(min_groups=4, max_groups=8))
    assert result.decision == "roll_back"
    assert result.llr == pytest.approx(5.12)
    assert result.reason.startswith("harmful")


def test_the_noise_estimate_is_used_once_above_min_sd() -> None:
    # d alternate +0.6 / -0.6 around a mean of -0.1 (halfway to the margin): no evidence
    # either way however many groups come, until the budget; sd about 0.62 > min_sd
    pairs = [([0.0], [0.5]), ([0.7], [0.0])] * 3
    result = compare(pairs, RolloutTest(min_groups=4, max_groups=8))
    assert result.sd_diff is not None and result.sd_diff > 0.5
    assert result.llr == pytest.approx(0.0, abs=1e-9)
    assert result.decision == "wait" and "undecided" in result.reason


def test_at_max_groups_the_likelier_hypothesis_wins() -> None:
    test = RolloutTest(min_groups=4, max_groups=8)
    # mean -0.05 (above -margin/2): likelier as good -> promote at the 8th group
    good = [([0.5], [1.0]), ([0.6], [0.0])] * 4  # d = +0.5, -0.6
    result = compare(good, test)
    assert result.groups == 8 and result.decision == "promote"
    assert "at the budget of 8 groups" in result.reason
    # mean -0.15 (below -margin/2): likelier harmful -> roll back
    bad = [([0.5], [0.9]), ([0.7], [0.0])] * 4  # d = +0.4, -0.7
    result = compare(bad, test)
    assert result.decision == "roll_back" and "likelier harmful" in result.reason


def test_groups_after_the_budget_change_nothing() -> None:
    test = RolloutTest(min_groups=4, max_groups=8)
    pairs = [([0.5], [1.0]), ([0.6], [0.0])] * 4 + [([1.0], [0.0])] * 5
    result = compare(pairs, test)
    assert result.groups == 8 and result.decision == "promote"


def test_groups_missing_a_version_count_nowhere() -> None:
    same = ([0.5], [0.6])
    pairs = [same, ([], [0.0]), same, ([1.0], []), same, same]
    result = compare(pairs, RolloutTest(min_groups=4, max_groups=8))
    assert result.groups == 4
    assert result.mean_diff == pytest.approx(0.1) and result.sd_diff == pytest.approx(0.0)
    assert result.old_mean == pytest.approx(0.5) and result.new_mean == pytest.approx(0.6)


def test_a_paused_canary_with_too_little_evidence_is_rolled_back() -> None:
    test = RolloutTest(min_groups=4, max_groups=8)
    waiting = compare([([0.5], [0.6])] * 2, test)
    final = at_budget(waiting, test, calls=200)
    assert final.decision == "roll_back"
    assert "no evidence after its budget of 200 calls" in final.reason
    assert "2 of 4" in final.reason


def test_a_paused_canary_with_evidence_goes_to_the_likelier_side() -> None:
    test = RolloutTest(min_groups=4, max_groups=8)
    undecided = compare([([0.5], [1.0]), ([0.6], [0.0])] * 2, test)  # mean -0.05
    assert undecided.decision == "wait"
    assert at_budget(undecided, test, calls=50).decision == "promote"
    worse = compare([([0.5], [0.9]), ([0.7], [0.0])] * 2, test)  # mean -0.15
    assert worse.decision == "wait"
    final = at_budget(worse, test, calls=50)
    assert final.decision == "roll_back" and "likelier harmful" in final.reason


def test_bad_parameters_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="min_groups"):
        RolloutTest(min_groups=1)
    with pytest.raises(ValueError, match="max_groups"):
        RolloutTest(min_groups=8, max_groups=4)
    with pytest.raises(ValueError, match="alpha"):
        RolloutTest(alpha=0.7)
    with pytest.raises(ValueError, match="beta"):
        RolloutTest(beta=0.0)
    with pytest.raises(ValueError, match="margin"):
        RolloutTest(margin=0.0)
