"""The test a canary must pass: is the new adapter version not worse than the one it replaces?

Pure functions over numbers; the evidence comes from `storage.rollout.paired_rewards`.

The data: groups scored together that hold members of both versions. Each such group g gives one
paired difference

    d_g = mean(rewards of the new version's members in g) - mean(rewards of the old's in g)

so the group's own difficulty (the task, the judge's mood on that call) cancels out.

The test: a one-sided paired t-test on the d_g with a non-inferiority margin `margin` (> 0, in
reward units), run at a few fixed looks n = min_groups, 2 min_groups, 4 min_groups, ... and
max_groups (K looks in all), each at level alpha / K (Bonferroni over the looks, so that
looking several times keeps the overall chance of a wrong promotion, and of a wrong rollback,
at most alpha). At a look with the first n differences, mean m, standard deviation s and
t = t_{1 - alpha/K, n-1} (Student's t quantile):

    lower = m - t s / sqrt(n),   upper = m + t s / sqrt(n)

- promote   when lower > -margin: H0 "the new version is worse by margin or more" is rejected
            (non-inferiority shown);
- roll back when upper < 0: H0 "the new version is not worse" is rejected (it is worse);
- roll back at the last look (n = max_groups) when neither holds: non-inferiority was not
  shown with as many samples as the rollout allows (the safe side: the old version was fine);
- otherwise wait for the next look.

Promotion is checked first: a version worse by less than the margin is accepted, which is what
the margin means.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

Decision = Literal["promote", "roll_back", "wait"]


@dataclass(frozen=True)
class RolloutTest:
    """The stated test's parameters (settings `rollout_*`)."""

    margin: float = 0.05
    alpha: float = 0.05
    min_groups: int = 8
    max_groups: int = 64

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError("the non-inferiority margin must be >= 0")
        if not 0.0 < self.alpha < 0.5:
            raise ValueError("alpha must be between 0 and 0.5")
        if self.min_groups < 2:
            raise ValueError("min_groups must be at least 2 (a t-test needs two differences)")
        if self.max_groups < self.min_groups:
            raise ValueError("max_groups must be >= min_groups")

    def looks(self) -> list[int]:
        """The sample sizes at which the test is run: min_groups doubled up to max_groups."""
        out, n = [], self.min_groups
        while n < self.max_groups:
            out.append(n)
            n *= 2
        return [*out, self.max_groups]


@dataclass(frozen=True)
class Comparison:
    """The figures of one look, kept with every decision."""

    decision: Decision
    reason: str
    groups: int
    """Mixed groups available."""
    n: int
    """Differences used at this look (the largest look <= groups; 0 before the first look)."""
    mean_diff: float | None
    sd_diff: float | None
    old_mean: float | None
    new_mean: float | None
    lower: float | None
    upper: float | None
    t_critical: float | None
    alpha_per_look: float
    margin: float

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def paired_differences(pairs: list[tuple[list[float], list[float]]]) -> list[float]:
    """d_g = mean(new) - mean(old) per group; `pairs` holds (old rewards, new rewards)."""
    return [sum(new) / len(new) - sum(old) / len(old) for old, new in pairs if old and new]


def compare(pairs: list[tuple[list[float], list[float]]], test: RolloutTest) -> Comparison:
    """Run the test on the groups in `pairs` (oldest first): (old rewards, new rewards)."""
    pairs = [(old, new) for old, new in pairs if old and new]  # as the differences count them
    diffs = paired_differences(pairs)
    looks = test.looks()
    alpha = test.alpha / len(looks)
    n = max((k for k in looks if k <= len(diffs)), default=0)
    if n == 0:
        return Comparison(
            "wait",
            f"{len(diffs)} of {test.min_groups} groups holding both versions",
            len(diffs),
            0,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            alpha,
            test.margin,
        )
    used = pairs[:n]
    d = diffs[:n]
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    t = t_quantile(1.0 - alpha, n - 1)
    half = t * sd / math.sqrt(n)
    lower, upper = m - half, m + half
    old_mean = _mean([x for old, _ in used for x in old])
    new_mean = _mean([x for _, new in used for x in new])
    if lower > -test.margin:
        decision: Decision = "promote"
        reason = (
            f"not worse: lower bound {lower:+.3f} of the mean difference is above "
            f"-{test.margin:g} (n={n})"
        )
    elif upper < 0:
        decision = "roll_back"
        reason = f"worse: upper bound {upper:+.3f} of the mean difference is below 0 (n={n})"
    elif n >= test.max_groups:
        decision = "roll_back"
        reason = (
            f"not shown to be non-inferior after {n} groups: lower bound {lower:+.3f} "
            f"<= -{test.margin:g}"
        )
    else:
        decision = "wait"
        reason = f"undecided at n={n} (lower {lower:+.3f}, upper {upper:+.3f}); next look"
    return Comparison(
        decision,
        reason,
        len(diffs),
        n,
        m,
        sd,
        old_mean,
        new_mean,
        lower,
        upper,
        t,
        alpha,
        test.margin,
    )


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# --- Student's t distribution ------------------------------------------------------------


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
