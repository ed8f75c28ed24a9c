"""How many groups (and conversations) a canary rollout's test needs to decide, and how often it
decides right, on simulated live traffic: each task asked once, its 0/1 reward posted, tasks
grouped in cohorts of 4 to 8 (the grouper's defaults, RLPROXY_GROUP_MIN_SIZE / MAX_SIZE), each
conversation served by the canary with probability `share`.

Compares the test rlproxy uses (`proxy.adapters.rollout_stats.compare`, a truncated SPRT, on
its defaults) with the one it replaced: a one-sided paired t-test for non-inferiority at margin
0.05, alpha 0.05 Bonferroni-split over looks at 8, 16, 32, 64 groups, rolling back a canary not
shown non-inferior at 64 (re-implemented below from its description, for this comparison only).

Only groups holding both versions are evidence, as on a real server; a group with one version
still costs its conversations.

    .venv/bin/python bench/rollout_sim.py [--runs 2000] [--out bench/results]

Writes `<out>/rollout_sim.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import provenance  # noqa: E402

from proxy.adapters.rollout_stats import RolloutTest, compare, paired_differences, t_quantile  # noqa: E402

SCENARIOS = [  # (old version's success rate, new version's)
    (0.5, 0.15),
    (0.5, 0.3),
    (0.5, 0.4),
    (0.5, 0.5),
    (0.5, 0.6),
    (0.5, 0.8),
    (0.65, 0.8),
    (0.8, 0.95),
    (0.9, 0.9),
]


def previous_test(pairs: list[tuple[list[float], list[float]]]) -> str:
    """The t-test rlproxy used before: 'promote', 'roll_back' or 'wait'."""
    looks, margin, alpha = [8, 16, 32, 64], 0.05, 0.05 / 4
    d = paired_differences(pairs)
    n = max((k for k in looks if k <= len(d)), default=0)
    if n == 0:
        return "wait"
    d = d[:n]
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))
    half = t_quantile(1 - alpha, n - 1) * sd / math.sqrt(n)
    if m - half > -margin:
        return "promote"
    if m + half < 0 or n >= 64:
        return "roll_back"
    return "wait"


def one_run(
    rng: random.Random, p_old: float, p_new: float, share: float, decide: Any
) -> tuple[str, int, int, int]:
    """Groups arrive until `decide` says; (decision, mixed groups, conversations, canary's)."""
    pairs: list[tuple[list[float], list[float]]] = []
    conversations = canary = 0
    while True:
        size = rng.randint(4, 8)
        old: list[float] = []
        new: list[float] = []
        for _ in range(size):
            if rng.random() < share:
                new.append(float(rng.random() < p_new))
            else:
                old.append(float(rng.random() < p_old))
        conversations += size
        canary += len(new)
        if old and new:
            pairs.append((old, new))
            decision = decide(pairs)
            if decision != "wait":
                return decision, len(pairs), conversations, canary
        if conversations > 100_000:
            return "wait", len(pairs), conversations, canary


def summarise(runs: list[tuple[str, int, int, int]]) -> dict[str, Any]:
    n = len(runs)

    def q(i: int, p: float) -> float:
        xs = sorted(r[i] for r in runs)
        return xs[min(n - 1, int(p * n))]

    return {
        "promoted": round(sum(r[0] == "promote" for r in runs) / n, 3),
        "rolled_back": round(sum(r[0] == "roll_back" for r in runs) / n, 3),
        "groups_median": q(1, 0.5),
        "groups_p90": q(1, 0.9),
        "conversations_median": q(2, 0.5),
        "conversations_p90": q(2, 0.9),
        "canary_conversations_median": q(3, 0.5),
        "canary_conversations_p90": q(3, 0.9),
        "canary_conversations_max": max(r[3] for r in runs),
        "conversations_mean": round(statistics.fmean(r[2] for r in runs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--share", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    record = provenance.start()
    test = RolloutTest()
    tests = {
        "sprt (rlproxy's test, defaults)": lambda pairs: compare(pairs, test).decision,
        "previous t-test (margin 0.05, looks 8/16/32/64)": previous_test,
    }
    rows = []
    for p_old, p_new in SCENARIOS:
        for name, decide in tests.items():
            rng = random.Random(f"{args.seed}:{p_old}:{p_new}:{name}")
            runs = [one_run(rng, p_old, p_new, args.share, decide) for _ in range(args.runs)]
            row = {"old": p_old, "new": p_new, "test": name, **summarise(runs)}
            rows.append(row)
            print(
                f"{p_old:.2f} -> {p_new:.2f}  {name[:30]:30s}  promoted {row['promoted']:.3f}  "
                f"rolled back {row['rolled_back']:.3f}  groups {row['groups_median']:>3} "
                f"(p90 {row['groups_p90']:>3})  conversations {row['conversations_median']:>4} "
                f"(p90 {row['conversations_p90']:>4})  "
                f"canary's {row['canary_conversations_median']:>3} "
                f"(p90 {row['canary_conversations_p90']:>3})",
                flush=True,
            )
    out = {
        **provenance.finish(record),
        "runs_per_scenario": args.runs,
        "share": args.share,
        "group_sizes": "uniform 4..8",
        "sprt_defaults": test.describe(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rollout_sim.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out / 'rollout_sim.json'}")


if __name__ == "__main__":
    main()
