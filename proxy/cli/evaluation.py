"""`rlproxy eval`: is the model getting better on held-out tasks of the user's own traffic?

    rlproxy eval [--json] [--limit N]

Reads the newest N held-out trajectories from the database (`storage.held_out`: tasks kept out
of training by RLPROXY_EVAL_SHARE) and prints, per adapter version that served them, its mean
reward against the base's over the same hours with a 95 % interval, the comparison with the
version before it, what was evaluated and what was left out and why, then the one line
`rlproxy status` and the dashboard show. The statistics are `proxy.adapters.evaluation`'s.
Like `rlproxy status`, it reads the database only: no server is needed, none is asked, and no
engine is loaded.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from proxy.adapters.evaluation import DEFAULT_LIMIT, evaluate
from proxy.settings import Settings


async def eval_command(
    settings: Settings,
    *,
    as_json: bool = False,
    limit: int = DEFAULT_LIMIT,
    out: TextIO = sys.stdout,
) -> int:
    """Print the evaluation; return an exit code."""
    from proxy.database import opened_store

    async with opened_store(settings) as store:
        evaluation = await evaluate(
            store,
            policy=settings.model_name,
            reward_policy=settings.reward_policy,
            share=settings.eval.share,
            limit=limit,
        )
    report = evaluation.to_json()
    if as_json:
        print(json.dumps(report, indent=2), file=out)
    else:
        print_report(report, out)
    return 0


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}"


def _mean(arm: dict[str, Any]) -> str:
    return "-" if arm["mean"] is None else f"{arm['mean']:.3f} (n {arm['n']})"


def _interval(iv: dict[str, Any] | None) -> str:
    if iv is None:
        return "-"
    low, high = _signed(iv["low"]), _signed(iv["high"])
    return f"{_signed(iv['estimate'])} [{low}, {high}] {iv['verdict']}"


def print_report(report: dict[str, Any], out: TextIO) -> None:
    share = report["share"]
    print(
        f"held-out evaluation: {share:.0%} of tasks kept out of training (RLPROXY_EVAL_SHARE), "
        f"half of them answered by the base; reward policy {report['reward_policy']}",
        file=out,
    )
    read, limit = report["read"], report["limit"]
    newest = f" (the newest {limit})" if read >= limit else ""
    evaluated = ", ".join(
        f"{'base' if label == 'base' else 'v' + label} {n}"
        for label, n in report["evaluated"].items()
    )
    print(f"read {read} held-out trajectories{newest}; evaluated: {evaluated or 'none'}", file=out)
    reran = ", ".join(
        f"{'base' if label == 'base' else 'v' + label} {n}"
        for label, n in (report.get("reruns_evaluated") or {}).items()
    )
    if reran:
        print(f"re-runs (every call pinned to one version): {reran}", file=out)
    left = {k: n for k, n in report["left_out"].items() if n}
    if left:
        print("left out:", file=out)
        for key, n in left.items():
            print(f"  {n:>6}  {report['left_out_reasons'][key]}", file=out)
    versions = report["versions"]
    if versions:
        print(file=out)
        level = f"{report['level']:.0%}"
        row = "{:<8} {:<18} {:<18} {:<36} {}"
        print(
            row.format(
                "version", "mean reward", "base, same hours", f"vs base ({level})", "vs previous"
            ),
            file=out,
        )
        for v in versions:
            previous = _interval(v["vs_previous"])
            if v["previous"] is not None:
                previous = f"v{v['previous']}: {previous}"
            print(
                row.format(
                    f"v{v['version']}",
                    _mean(v["runs"]),
                    _mean(v["base"]),
                    _interval(v["vs_base"]),
                    previous,
                ),
                file=out,
            )
    reruns = report.get("reruns") or []
    if reruns:
        print(file=out)
        print("re-runs pinned to a version, paired by task with the base's:", file=out)
        level = f"{report['level']:.0%}"
        row = "{:<8} {:<8} {:<14} {:<14} {}"
        print(row.format("version", "tasks", "mean reward", "base", f"vs base ({level})"), file=out)
        for r in reruns:
            tasks = str(r["tasks"]) + (f" (+{r['unpaired_tasks']})" if r["unpaired_tasks"] else "")
            mean = "-" if r["mean"] is None else f"{r['mean']:.3f}"
            base = "-" if r["base_mean"] is None else f"{r['base_mean']:.3f}"
            print(
                row.format(f"v{r['version']}", tasks, mean, base, _interval(r["vs_base"])), file=out
            )
        print("(+K: tasks this version re-ran that the base did not, not compared)", file=out)
    print(file=out)
    print(f"is it getting better? {report['headline']['line']}", file=out)
