"""The test a canary must pass: is the new adapter version harmful, compared with the one it would
replace?

Pure functions over numbers; the evidence comes from `storage.rollout.paired_rewards`.

The data: groups scored together that hold members of both versions. Each such group g gives one
paired difference

    d_g = mean(rewards of the new version's members in g) - mean(rewards of the old's in g)

so the group's own difficulty (the task, the judge's mood on that call, the hour's traffic)
cancels out.

The test: Wald's sequential probability ratio test (SPRT), truncated. The two hypotheses are

    H0: the mean difference is 0 (the new version is as good; better is better still)
    H1: the mean difference is -margin (the new version is harmful: worse by `margin`)

with the d_g taken as normal with standard deviation sigma. After n groups the log likelihood
ratio of H1 to H0 is

    LLR_n = sum_g ( -margin * d_g - margin^2 / 2 ) / sigma^2

and the test, run after every new group once `min_groups` are in,

- rolls back when LLR_n >= log((1 - beta) / alpha): the evidence favours "harmful";
- promotes   when LLR_n <= log(beta / (1 - alpha)): the evidence favours "as good";
- at `max_groups`, decides by the sign of LLR_n (the budget is spent: the likelier hypothesis
  wins; LLR_n > 0 means the mean difference is below -margin / 2);
- otherwise waits.

Wald's bounds keep the chance of rolling back a version as good as the old one near `alpha`, and
of promoting one worse by `margin` near `beta`. A better version drives LLR_n down faster than an
equal one, a much worse one up faster than one just `margin` worse: the test spends evidence where
the answer is unclear, not on every version alike. Measured against the fixed-look t-test it
replaced (non-inferiority at margin 0.05, Bonferroni over 8/16/32/64 groups) on simulated live
traffic: `bench/rollout_sim.py`.

sigma is the sample standard deviation of the d_g seen so far, never below `min_sd` (a handful
of identical differences is not evidence of zero noise).

Shown beside each decision: the mean difference with a two-sided 90 % t interval, for people to
read; the decision does not use it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

Decision = Literal["promote", "roll_back", "wait"]


@dataclass(frozen=True)
class RolloutTest:
    """The stated test's parameters (settings `rollout_*`)."""

    margin: float = 0.2
    """How much worse (in reward units) counts as harmful: H1's mean difference is -margin."""
    alpha: float = 0.05
    """Chance of rolling back a version as good as the one it would replace."""
    beta: float = 0.1
    """Chance of promoting a version worse by `margin`."""
    min_groups: int = 4
    """No decision before this many mixed groups (the noise estimate needs a few)."""
    max_groups: int = 32
    """The budget: at this many mixed groups the likelier hypothesis wins."""
    min_sd: float = 0.25
    """The smallest noise (standard deviation of d_g) the test assumes."""

    def __post_init__(self) -> None:
        if not self.margin > 0:
            raise ValueError("the harm margin must be > 0 (reward units)")
        if not 0.0 < self.alpha < 0.5:
            raise ValueError("alpha must be between 0 and 0.5")
        if not 0.0 < self.beta < 0.5:
            raise ValueError("beta must be between 0 and 0.5")
        if self.min_groups < 2:
            raise ValueError("min_groups must be at least 2 (the noise needs two differences)")
        if self.max_groups < self.min_groups:
            raise ValueError("max_groups must be >= min_groups")
        if not self.min_sd > 0:
            raise ValueError("min_sd must be > 0")

    @property
    def roll_back_at(self) -> float:
        """Wald's upper bound on LLR_n: at or above it, roll back."""
        return math.log((1.0 - self.beta) / self.alpha)

    @property
    def promote_at(self) -> float:
        """Wald's lower bound on LLR_n: at or below it, promote."""
        return math.log(self.beta / (1.0 - self.alpha))

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "truncated sequential probability ratio test on paired group differences",
            "harmful_if_worse_by": self.margin,
            "alpha": self.alpha,
            "beta": self.beta,
            "min_groups": self.min_groups,
            "max_groups": self.max_groups,
            "roll_back_at_llr": round(self.roll_back_at, 4),
            "promote_at_llr": round(self.promote_at, 4),
        }


@dataclass(frozen=True)
class Comparison:
    """The figures of one look, kept with every decision."""

    decision: Decision
    reason: str
    groups: int
    """Mixed groups used (all of them: the test looks after every group)."""
    mean_diff: float | None
    sd_diff: float | None
    old_mean: float | None
    new_mean: float | None
    llr: float | None
    """LLR_n, harmful against as good; None before `min_groups`."""
    lower: float | None
    """The 90 % interval of the mean difference (shown, not decided on)."""
    upper: float | None
    margin: float

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def paired_differences(pairs: list[tuple[list[float], list[float]]]) -> list[float]:
    """d_g = mean(new) - mean(old) per group; `pairs` holds (old rewards, new rewards)."""
    return [sum(new) / len(new) - sum(old) / len(old) for old, new in pairs if old and new]


def log_likelihood_ratio(diffs: list[float], margin: float, sd: float) -> float:
    """LLR_n of "mean -margin" against "mean 0" for normal differences of standard deviation sd."""
    return sum(-margin * d - margin * margin / 2.0 for d in diffs) / (sd * sd)


def compare(pairs: list[tuple[list[float], list[float]]], test: RolloutTest) -> Comparison:
    """Run the test on the groups in `pairs` (oldest first): (old rewards, new rewards). Only
    the first `max_groups` count: a decision taken at the budget does not change after it."""
    pairs = [(old, new) for old, new in pairs if old and new][: test.max_groups]
    diffs = paired_differences(pairs)
    n = len(diffs)
    old_mean = _mean([x for old, _ in pairs for x in old])
    new_mean = _mean([x for _, new in pairs for x in new])
    m = _mean(diffs)
    if n < test.min_groups:
        return Comparison(
            "wait",
            f"{n} of {test.min_groups} groups holding both versions",
            n,
            m,
            None,
            old_mean,
            new_mean,
            None,
            None,
            None,
            test.margin,
        )
    assert m is not None
    sd = math.sqrt(sum((x - m) ** 2 for x in diffs) / (n - 1))
    llr = log_likelihood_ratio(diffs, test.margin, max(sd, test.min_sd))
    half = t_quantile(0.95, n - 1) * sd / math.sqrt(n)
    lower, upper = m - half, m + half
    shown = f"mean difference {m:+.3f} (90 % interval {lower:+.3f}..{upper:+.3f}, n={n})"
    if llr >= test.roll_back_at:
        decision: Decision = "roll_back"
        reason = f"harmful: {shown}; evidence {llr:.2f} >= {test.roll_back_at:.2f}"
    elif llr <= test.promote_at:
        decision = "promote"
        reason = f"not harmful: {shown}; evidence {llr:.2f} <= {test.promote_at:.2f}"
    elif n >= test.max_groups:
        decision = "roll_back" if llr > 0 else "promote"
        verdict = "likelier harmful" if llr > 0 else "likelier not harmful"
        reason = f"{verdict} at the budget of {n} groups: {shown}; evidence {llr:.2f}"
    else:
        decision = "wait"
        reason = (
            f"undecided: {shown}; evidence {llr:.2f} between "
            f"{test.promote_at:.2f} and {test.roll_back_at:.2f}"
        )
    return Comparison(
        decision, reason, n, m, sd, old_mean, new_mean, llr, lower, upper, test.margin
    )


def at_budget(result: Comparison, test: RolloutTest, calls: int | None) -> Comparison:
    """The decision when a paused canary's evidence has stopped coming (it spent its call budget,
    `calls`, and what it served has been scored): the likelier hypothesis wins, as at
    `max_groups`; with fewer than `min_groups` mixed groups, roll back (nothing showed the
    version is not harmful)."""
    spent = f"after its budget of {calls} calls" if calls is not None else "at its budget"
    if result.llr is None:
        return replace(
            result,
            decision="roll_back",
            reason=f"no evidence {spent}: {result.groups} of {test.min_groups} groups "
            "holding both versions",
        )
    decision: Decision = "roll_back" if result.llr > 0 else "promote"
    verdict = "likelier harmful" if result.llr > 0 else "likelier not harmful"
    return replace(
        result,
        decision=decision,
        reason=f"{verdict} {spent}, its evidence complete: {result.reason.split(': ', 1)[-1]}",
    )


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# --- Student's t distribution (for the interval shown) -----------------------------------


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom, through the regularized
    incomplete beta function: P(|T| > |t|) = I_{df/(df+t^2)}(df/2, 1/2)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (bisection on `t_cdf`, to 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2.0


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), by its continued fraction (modified Lentz), using the symmetry
    I_x(a, b) = 1 - I_{1-x}(b, a) where the fraction converges slowly."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h
