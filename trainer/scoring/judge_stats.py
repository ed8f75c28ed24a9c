"""The statistics behind the judge checks: rank agreement and confidence bounds, pure functions.

    kendall_tau_b([1, 2, 3], [1, 3, 2])   # 0.333...: concordant minus discordant pairs, ties
                                          # corrected (Kendall's tau-b)
    spearman_rho([1, 2, 3], [3, 2, 1])    # -1.0: Pearson's r of the average ranks
    wilson_interval(18, 20)               # (0.699, 0.972): 95 % Wilson score interval
    mean_interval([0.5, 0.7, 0.9])        # (0.7, low, high): mean ± z standard errors

Nothing here knows about judges or the database; `trainer.scoring.judge_checks` applies these to
stored check rows. Undefined statistics (a constant series, too few values) are None, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z_95 = 1.959963984540054
"""The two-sided 95 % normal quantile: every bound here is a 95 % bound."""


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count). Raises on []."""
    if not values:
        raise ValueError("the median of no values is undefined")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def average_ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, tied values sharing the mean of the ranks they span ([5, 7, 5] -> 1.5, 3,
    1.5)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b of paired values: (concordant - discordant) / sqrt((n0 - tx)(n0 - ty)),
    where n0 is the number of pairs and tx, ty the pairs tied in x, in y. None when either
    series is constant or there are fewer than two pairs (no order to agree on).

    O(n^2) over the pairs: groups have a handful of members."""
    if len(x) != len(y):
        raise ValueError(f"paired series differ in length: {len(x)} and {len(y)}")
    n = len(x)
    concordant = discordant = tied_x = tied_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0:
                tied_x += 1
            if dy == 0:
                tied_y += 1
            if dx and dy:
                if (dx > 0) == (dy > 0):
                    concordant += 1
                else:
                    discordant += 1
    pairs = n * (n - 1) // 2
    denominator = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    if denominator == 0:
        return None
    return (concordant - discordant) / denominator


def spearman_rho(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation: Pearson's r of the average ranks (ties handled). None when
    either series is constant or there are fewer than two pairs."""
    if len(x) != len(y):
        raise ValueError(f"paired series differ in length: {len(x)} and {len(y)}")
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion: (low, high). (0, 1) when n is 0.

    Unlike the normal approximation it stays inside [0, 1] and is sensible at 0 or n successes,
    which is where a judge that always or never passes its checks sits."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, {n}], not {successes}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: Sequence[float], z: float = Z_95) -> tuple[float, float, float] | None:
    """(mean, mean - z·se, mean + z·se), se the sample standard deviation over sqrt(n) (a normal
    approximation; fine for the tens of checks the gate waits for). None for fewer than two
    values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def std(values: Sequence[float]) -> float:
    """The population standard deviation (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
