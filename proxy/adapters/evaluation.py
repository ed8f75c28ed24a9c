"""The held-out evaluation: is the model getting better on the user's own traffic?

A share of tasks never trains (`storage.held_out`, RLPROXY_EVAL_SHARE); half of them are
answered by the base model when they ask for the policy name (the control), the other half by
whatever the policy name serves. This module compares, for each adapter version N that served
held-out tasks, the rewards of those runs with the rewards of the base's held-out runs over the
same hours:

    runs of N      the held-out trajectories served by N alone, with a reward
    base runs      the held-out trajectories served by the base alone, with a reward, created
                   between N's first and last run (time-matched: the same traffic, the same
                   hours, so a change in what users ask moves both arms)
    vs base        mean(N) - mean(base), with a 95 % Welch t interval (unequal variances;
                   degrees of freedom by Welch-Satterthwaite, rounded down)
    vs previous    N's gain over its base minus the previous evaluated version's gain over its
                   own base (a difference of differences; the same t interval over the four
                   variances), since two versions rarely serve at the same time

Re-runs: where the user's agent can run a task again, it can evaluate on demand. It runs held-out
tasks (its own, or any marked `X-RLProxy-Held-Out: true`: held out whatever the draw) once
pinned to `NAME@base` and once to `NAME@N`, and posts the environment's rewards. Those runs
pair by task:

    re-runs of N   held-out trajectories whose every call pinned `NAME@N`, with a reward
    paired         the tasks run on both N and the base: per task, mean(N's) - mean(base's);
                   the mean of those differences with a paired t interval over the tasks
                   (n - 1 degrees of freedom), and the tasks run on one side only counted

Pairing takes the task's difficulty out of the comparison, so an evaluation of a hundred tasks
shows what the drawn arms need thousands of live runs for.

A run's reward is chosen by the reward policy (`trainer.scoring.pick_reward`); held-out runs are
never grouped, so the judge never scored one and the reward is the environment's (POST
/rl/trajectories/{id}/reward). Which runs are left out, and why, is counted (the denominator):
a call answered by an upstream model; pins that are not a re-run (only some calls pinned, or
pins of two versions); calls of more than one version (a swap mid-conversation); still
open without a reward; closed without a reward.

"Is it getting better?" is the newest version with an interval against the base: better when
the interval is above 0, worse when below, "not shown" when it holds 0; with fewer than
`MIN_RUNS` rewarded runs in either arm there is no interval. Why arms of tasks and not pairs of
one task: the arm is drawn per task, so every turn and every replica agree with no state, and
live traffic asks most tasks once; a task's runs are never split between arms.

Pure functions over `storage.held_out_runs.HeldOutRun`s (unit-tested on hand-made numbers),
plus `evaluate`, which reads them through the store. Not a gate: nothing here promotes, holds
or rolls back a version (the canary rollout does that, `proxy.adapters.rollout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from proxy.adapters.registry import version_label
from proxy.adapters.rollout_stats import t_quantile
from storage.held_out_runs import HeldOutRun
from storage.records import POLICY_ENGINES
from storage.store import Store
from trainer.scoring import pick_reward

MIN_RUNS = 2
"""Rewarded runs each arm needs before a comparison has an interval."""
LEVEL = 0.95
DEFAULT_LIMIT = 5000
"""The newest held-out trajectories read by default."""

LEFT_OUT = {
    "upstream": "a call was answered by an upstream model, not the policy",
    "pinned": "some of its calls pinned a version (NAME@N, NAME@base) and not all of them one",
    "several_versions": "served by more than one version (a swap mid-conversation)",
    "open": "still open, no reward yet",
    "no_reward": "closed without a reward from the environment",
}
"""Why a held-out trajectory is not evaluated, by key, in the order they are checked."""

Verdict = Literal["better", "worse", "not shown"]


@dataclass(frozen=True)
class Arm:
    """Rewards of one arm: how many, their mean and sample standard deviation."""

    n: int
    mean: float | None
    sd: float | None

    @classmethod
    def of(cls, rewards: Sequence[float]) -> Arm:
        n = len(rewards)
        if n == 0:
            return cls(0, None, None)
        mean = sum(rewards) / n
        sd = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else None
        return cls(n, mean, sd)

    @property
    def variance_of_mean(self) -> float:
        assert self.sd is not None
        return self.sd**2 / self.n


@dataclass(frozen=True)
class Interval:
    """An estimated difference with its two-sided t interval."""

    estimate: float
    low: float
    high: float
    df: int
    level: float = LEVEL

    @property
    def verdict(self) -> Verdict:
        if self.low > 0:
            return "better"
        if self.high < 0:
            return "worse"
        return "not shown"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def t_interval(estimate: float, parts: Sequence[Arm], level: float = LEVEL) -> Interval | None:
    """`estimate` (a sum of the arms' means, with signs) with a t interval whose variance is the
    sum of the arms' variances of the mean and whose degrees of freedom are Welch-Satterthwaite's
    (rounded down, at least 1). None when an arm has fewer than `MIN_RUNS` runs."""
    if any(a.n < MIN_RUNS or a.sd is None for a in parts):
        return None
    variances = [a.variance_of_mean for a in parts]
    total = sum(variances)
    if total == 0.0:  # every reward in every arm the same: no spread to put an interval on
        return Interval(estimate, estimate, estimate, sum(a.n - 1 for a in parts), level)
    df = total**2 / sum(v**2 / (a.n - 1) for v, a in zip(variances, parts, strict=True))
    whole = max(1, math.floor(df))
    half = t_quantile(1.0 - (1.0 - level) / 2.0, whole) * math.sqrt(total)
    return Interval(estimate, estimate - half, estimate + half, whole, level)


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval | None:
    """mean(a) - mean(b) with Welch's t interval; None with fewer than `MIN_RUNS` in either."""
    arm_a, arm_b = Arm.of(a), Arm.of(b)
    if arm_a.mean is None or arm_b.mean is None:
        return None
    return t_interval(arm_a.mean - arm_b.mean, [arm_a, arm_b], level)


@dataclass(frozen=True)
class Run:
    """A held-out trajectory that counts: the one version that served it, and its reward."""

    trajectory_id: str
    created_at: float
    version: int
    """0: the base model."""
    reward: float


@dataclass(frozen=True)
class Rerun:
    """A held-out trajectory whose every call pinned one version: a re-run of its task."""

    trajectory_id: str
    task: str
    """Its task signature: what pairs it with the base's re-run of the same task."""
    version: int
    reward: float


def classify(
    runs: Sequence[HeldOutRun], policy: str, reward_policy: str
) -> tuple[list[Run], list[Rerun], dict[str, int]]:
    """The drawn runs that count, the re-runs that count, and how many were left out for
    each reason of `LEFT_OUT`."""
    counted: list[Run] = []
    reruns: list[Rerun] = []
    left_out = dict.fromkeys(LEFT_OUT, 0)
    pin = f"{policy}@"
    for r in runs:
        versions = {s.version for s in r.served_by}
        reward, _ = pick_reward(reward_policy, r.explicit_reward, None)
        pinned = [s.model_requested.startswith(pin) for s in r.served_by]
        if any(s.engine not in POLICY_ENGINES for s in r.served_by):
            reason = "upstream"
        elif any(pinned) and not (all(pinned) and len(versions) == 1):
            reason = "pinned"
        elif len(versions) > 1:
            reason = "several_versions"
        elif reward is None or not versions:
            reason = "open" if r.status == "open" else "no_reward"
        elif all(pinned):
            task = r.task_signature or r.trajectory_id
            reruns.append(Rerun(r.trajectory_id, task, versions.pop(), reward))
            continue
        else:
            counted.append(Run(r.trajectory_id, r.created_at, versions.pop(), reward))
            continue
        left_out[reason] += 1
    return counted, reruns, left_out


@dataclass(frozen=True)
class RerunResult:
    """Version N's re-runs against the base's, paired by task."""

    version: int
    runs: int
    """N's re-runs (every task's)."""
    base_runs: int
    """The base's re-runs of the same tasks."""
    tasks: int
    """Tasks re-run on both: the pairs."""
    unpaired_tasks: int
    """Tasks N re-ran that the base did not: not in the comparison."""
    mean: float | None
    """N's mean reward over the paired tasks (each task's mean), and the base's."""
    base_mean: float | None
    vs_base: Interval | None

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "vs_base"},
            "vs_base": None if self.vs_base is None else self.vs_base.to_json(),
        }


def paired_interval(differences: Sequence[float], level: float = LEVEL) -> Interval | None:
    """The mean of `differences` with a paired t interval (n - 1 degrees of freedom); None
    with fewer than `MIN_RUNS` pairs. When every difference is the same there is no spread for
    a t interval: a nonzero one counts as shown (the interval is the point) only when a sign
    test would say so at `level` (all n of one sign: 2 * 0.5**n below 1 - level, so n >= 6 at
    95 %); with fewer pairs, None."""
    n = len(differences)
    if n < MIN_RUNS:
        return None
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    if sd == 0.0:
        if mean != 0.0 and 2.0 * 0.5**n >= 1.0 - level:
            return None
        return Interval(mean, mean, mean, n - 1, level)
    half = t_quantile(1.0 - (1.0 - level) / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n - 1, level)


def compare_reruns(reruns: Sequence[Rerun], level: float = LEVEL) -> list[RerunResult]:
    """Each version's re-runs against the base's re-runs of the same tasks, oldest first."""
    by: dict[int, dict[str, list[float]]] = {}
    for r in reruns:
        by.setdefault(r.version, {}).setdefault(r.task, []).append(r.reward)
    base = by.get(0, {})
    out: list[RerunResult] = []
    for version in sorted(v for v in by if v != 0):
        mine = by[version]
        paired = sorted(t for t in mine if t in base)
        ours = [sum(mine[t]) / len(mine[t]) for t in paired]
        theirs = [sum(base[t]) / len(base[t]) for t in paired]
        out.append(
            RerunResult(
                version=version,
                runs=sum(len(v) for v in mine.values()),
                base_runs=sum(len(base[t]) for t in paired),
                tasks=len(paired),
                unpaired_tasks=len(mine) - len(paired),
                mean=sum(ours) / len(ours) if ours else None,
                base_mean=sum(theirs) / len(theirs) if theirs else None,
                vs_base=paired_interval([a - b for a, b in zip(ours, theirs, strict=True)], level),
            )
        )
    return out


@dataclass(frozen=True)
class VersionResult:
    """One version against the base's held-out runs over the same hours."""

    version: int
    since: float
    until: float
    """Its first and last held-out run's creation time (the base runs compared were created
    between them)."""
    runs: Arm
    base: Arm
    vs_base: Interval | None
    previous: int | None = None
    """The evaluated version before it that `vs_previous` compares with."""
    vs_previous: Interval | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "since": self.since,
            "until": self.until,
            "runs": asdict(self.runs),
            "base": asdict(self.base),
            "vs_base": None if self.vs_base is None else self.vs_base.to_json(),
            "previous": self.previous,
            "vs_previous": None if self.vs_previous is None else self.vs_previous.to_json(),
        }


def compare_versions(runs: Sequence[Run], level: float = LEVEL) -> list[VersionResult]:
    """Each adapter version that served counted runs, oldest version first, against the base's
    runs created between its first and last run; and against the previous version that has an
    interval against its base."""
    base = sorted((r.created_at, r.reward) for r in runs if r.version == 0)
    by_version: dict[int, list[Run]] = {}
    for r in runs:
        if r.version != 0:
            by_version.setdefault(r.version, []).append(r)
    out: list[VersionResult] = []
    last: VersionResult | None = None
    for version in sorted(by_version):
        mine = by_version[version]
        since = min(r.created_at for r in mine)
        until = max(r.created_at for r in mine)
        arm = Arm.of([r.reward for r in mine])
        control = Arm.of([reward for at, reward in base if since <= at <= until])
        vs_base = None
        if arm.mean is not None and control.mean is not None:
            vs_base = t_interval(arm.mean - control.mean, [arm, control], level)
        vs_previous = None
        if vs_base is not None and last is not None and last.vs_base is not None:
            gain = vs_base.estimate - last.vs_base.estimate
            vs_previous = t_interval(gain, [arm, control, last.runs, last.base], level)
        result = VersionResult(
            version,
            since,
            until,
            arm,
            control,
            vs_base,
            previous=last.version if vs_previous is not None and last is not None else None,
            vs_previous=vs_previous,
        )
        out.append(result)
        if vs_base is not None:
            last = result
    return out


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def _bracketed(iv: Interval) -> str:
    return f"{_signed(iv.estimate)} [{_signed(iv.low)}, {_signed(iv.high)}]"


@dataclass(frozen=True)
class Headline:
    """'Is it getting better?' in one line, and the verdict it states."""

    line: str
    verdict: Verdict | Literal["too few runs", "no evidence", "off"]
    version: int | None = None
    interval: Interval | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "line": self.line,
            "verdict": self.verdict,
            "version": self.version,
            "interval": None if self.interval is None else self.interval.to_json(),
        }


def headline(
    results: Sequence[VersionResult],
    share: float,
    base_runs: int,
    reruns: Sequence[RerunResult] = (),
    base_reruns: int = 0,
) -> Headline:
    """The newest version with an interval against the base, in one line: from its re-runs
    (paired) when they are of a version at least as new as the drawn arms' newest, else from
    the drawn arms."""
    if share <= 0 and not results and not reruns and not base_reruns:
        return Headline("held-out evaluation is off (RLPROXY_EVAL_SHARE=0)", "off")
    shown = [r for r in results if r.vs_base is not None]
    paired = [r for r in reruns if r.vs_base is not None]
    if paired and (not shown or paired[-1].version >= shown[-1].version):
        p = paired[-1]
        iv = p.vs_base
        assert iv is not None
        line = (
            f"v{p.version} vs base, re-run on {p.tasks} held-out tasks (paired): "
            f"{_bracketed(iv)}: {iv.verdict}"
        )
        return Headline(line, iv.verdict, p.version, iv)
    if shown:
        r = shown[-1]
        iv = r.vs_base
        assert iv is not None
        line = (
            f"v{r.version} vs base on held-out tasks: {_bracketed(iv)} "
            f"(n={r.runs.n} vs {r.base.n}): {iv.verdict}"
        )
        return Headline(line, iv.verdict, r.version, iv)
    if results:
        r = results[-1]
        line = (
            f"v{r.version} vs base on held-out tasks: too few rewarded runs for an interval "
            f"(n={r.runs.n} vs {r.base.n}; at least {MIN_RUNS} each)"
        )
        return Headline(line, "too few runs", r.version)
    if reruns:
        p = reruns[-1]
        line = (
            f"v{p.version} vs base, re-run: too few tasks re-run on both for an interval "
            f"({p.tasks}; at least {MIN_RUNS})"
        )
        return Headline(line, "too few runs", p.version)
    line = (
        f"no version has served rewarded held-out tasks yet ({base_runs} base run"
        f"{'' if base_runs == 1 else 's'} rewarded"
        + (f", {base_reruns} base re-run{'' if base_reruns == 1 else 's'}" if base_reruns else "")
        + ")"
    )
    return Headline(line, "no evidence")


@dataclass
class Evaluation:
    """What `rlproxy eval`, `GET /rl/eval`, `rlproxy status` and the dashboard show."""

    share: float
    reward_policy: str
    limit: int
    read: int
    """Held-out trajectories read (the newest `limit`)."""
    evaluated: dict[str, int]
    """Counted runs per version, by its label (`base`, `3`)."""
    left_out: dict[str, int]
    versions: list[VersionResult]
    headline: Headline
    level: float = LEVEL
    since: float | None = None
    """The oldest held-out trajectory read (None: none)."""
    reasons: dict[str, str] = field(default_factory=lambda: dict(LEFT_OUT))
    reruns: list[RerunResult] = field(default_factory=list)
    """Re-runs pinned to a version, paired by task with the base's."""
    rerun_counts: dict[str, int] = field(default_factory=dict)
    """Counted re-runs per version, by its label."""

    def to_json(self) -> dict[str, Any]:
        return {
            "object": "rl.eval",
            "share": self.share,
            "reward_policy": self.reward_policy,
            "level": self.level,
            "limit": self.limit,
            "read": self.read,
            "since": self.since,
            "evaluated": self.evaluated,
            "left_out": self.left_out,
            "left_out_reasons": self.reasons,
            "versions": [v.to_json() for v in self.versions],
            "reruns_evaluated": self.rerun_counts,
            "reruns": [r.to_json() for r in self.reruns],
            "headline": self.headline.to_json(),
        }


def _count_by_version(versions: Sequence[int]) -> dict[str, int]:
    """How many runs each version has, by its label (`base`, `3`), oldest version first."""
    counts: dict[str, int] = {}
    for version in sorted(versions):
        label = version_label(version or None)
        counts[label] = counts.get(label, 0) + 1
    return counts


def evaluate_runs(
    runs: Sequence[HeldOutRun],
    *,
    policy: str,
    reward_policy: str,
    share: float,
    limit: int = DEFAULT_LIMIT,
    level: float = LEVEL,
) -> Evaluation:
    """The whole evaluation of `runs` (as `Store.held_out_runs` reads them)."""
    counted, pinned, left_out = classify(runs, policy, reward_policy)
    evaluated = _count_by_version([r.version for r in counted])
    rerun_counts = _count_by_version([p.version for p in pinned])
    results = compare_versions(counted, level)
    reruns = compare_reruns(pinned, level)
    return Evaluation(
        share=share,
        reward_policy=reward_policy,
        limit=limit,
        read=len(runs),
        evaluated=evaluated,
        left_out=left_out,
        versions=results,
        headline=headline(
            results, share, evaluated.get("base", 0), reruns, rerun_counts.get("base", 0)
        ),
        level=level,
        since=min((r.created_at for r in runs), default=None),
        reruns=reruns,
        rerun_counts=rerun_counts,
    )


async def evaluate(
    store: Store,
    *,
    policy: str,
    reward_policy: str,
    share: float,
    limit: int = DEFAULT_LIMIT,
    owner: str | None = None,
) -> Evaluation:
    """Read the newest `limit` held-out trajectories (of API key `owner` only, unless None)
    and evaluate them."""
    runs = await store.held_out_runs(limit=limit, owner=owner)
    return evaluate_runs(runs, policy=policy, reward_policy=reward_policy, share=share, limit=limit)
