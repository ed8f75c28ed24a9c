"""The held-out re-run proofs per run and per kind of run, read from their result files.

Reads every `bench/results/heldout_rerun*.json` that bench/heldout_rerun_proof.py wrote. A kind
of run is its agent, traffic, reward (the environment's, or the stand-in judge's pair accuracy)
and any `--set` settings, read from the run's recorded command with the proof's own parser; the
runs of a kind differ by seed. Per run: each evaluation's paired reward difference against the
run's own base (and in standard errors), sampled and greedy success, the trainer's step minutes
before the evaluated version was written (the trainer keeps training while practice pauses for a
re-run, so these can differ from the practice minutes), the versions written, how many served
and the median minutes from a version's checkpoint to its serving (the canary trial's length,
with the rollout on), and whether the run met the proof's target within 60 practice minutes:

- environment rewards: +3 standard errors, with greedy success 10 points above the base's at
  the same evaluation;
- a judge right on 75 % of pairs or more: +3 standard errors;
- a coin-flip judge (pair accuracy 0.5): no version written.

Per kind: the number of runs, how many met the target, and the median and the spread (lowest to
highest) of each run's last evaluation within 60 practice minutes: the last one taken at the
end of a round that began before minute 60 (the proof evaluates when a round ends past each
mark). A run stopped early is counted and says so.

    .venv/bin/python bench/heldout_rerun_summary.py [--results bench/results]

Writes `<results>/heldout_rerun_summary.json` (with `bench/provenance.py`'s record) and prints
one Markdown table per kind.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import provenance
from heldout_rerun_proof import build_parser

TARGET_MINUTES = 60.0
TARGET_Z = 3.0
TARGET_GREEDY_POINTS = 0.10


def kind_of(command: str) -> tuple[str, argparse.Namespace]:
    """A run's kind (e.g. "arithmetic live judge90") and its options, from its command."""
    words = shlex.split(command)
    args = build_parser().parse_args(words[2:] if words[1].endswith(".py") else words[1:])
    reward = "env" if args.reward == "env" else f"judge{round(args.pair_accuracy * 100)}"
    kind = f"{args.agent} {args.traffic} {reward}"
    if args.set:
        kind += " " + " ".join(sorted(args.set))
    return kind, args


def trainer_minutes(adapters: list[dict[str, Any]], version: int) -> float | None:
    """The trainer's step time spent before `version` was written: the steps of every version up
    to it (versions are numbered in the order they were written). None when a step's time was
    not recorded."""
    seconds = [
        (a.get("metrics") or {}).get("seconds")
        for a in adapters
        if a.get("version") is not None and a["version"] <= version
    ]
    if not seconds or any(s is None for s in seconds):
        return None
    return float(sum(s for s in seconds if s is not None)) / 60


def evaluation(
    e: dict[str, Any], base_greedy: dict[str, Any] | None, adapters: list[dict[str, Any]]
) -> dict[str, Any] | None:
    script = e.get("script")
    if not script:
        return None  # no version served yet at this evaluation
    se = script["reward_difference_se"]
    interval = e.get("proxy_rerun", {}).get("vs_base", {})
    greedy = e.get("greedy") or {}
    return {
        "practice_minutes": e["practice_minutes"],
        "version": e["version"],
        "trainer_minutes": trainer_minutes(adapters, e["version"]),
        "tasks": script["tasks"],
        "difference": script["reward_difference"],
        "se": se,
        "z": script["reward_difference"] / se if se else None,
        "low": interval.get("low"),
        "high": interval.get("high"),
        "success": e.get("success"),
        "greedy_success": greedy.get("success"),
        "greedy_base_success": (base_greedy or {}).get("success"),
    }


def minutes_to_serve(adapters: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How long the versions that served waited from their checkpoint (`created_at`) to serving
    the policy name (`activated_at`: promoted after the canary trial, or at once with the rollout
    off): the count, median and spread in minutes. None when no version recorded both."""
    waits = [
        (a["activated_at"] - a["created_at"]) / 60
        for a in adapters
        if a.get("activated_at") is not None and a.get("created_at") is not None
    ]
    if not waits:
        return None
    return {"versions": len(waits), **(spread(waits) or {})}


def _round_began(rounds: list[dict[str, Any]], e: dict[str, Any]) -> float:
    """The practice minute at which the round that ended at evaluation `e` began. The proof
    evaluates at the end of the first round past each `--eval-every` mark, so its evaluation at
    the 60-minute mark ends a round that began before minute 60 and itself ends a little after:
    that evaluation is within 60 minutes, a later one is not."""
    ends = [r["practice_minutes"] for r in rounds if "practice_minutes" in r]
    return max((m for m in ends if m < e["practice_minutes"] - 0.005), default=0.0)


def one_run(path: Path) -> dict[str, Any]:
    d = json.loads(path.read_text())
    kind, args = kind_of(d["command"])
    evaluations = [
        x
        for e in d.get("evaluations") or []
        if (x := evaluation(e, d.get("base_greedy"), d.get("adapters") or [])) is not None
    ]
    rounds = d.get("practice_rounds") or [{}]
    within = [e for e in evaluations if _round_began(rounds, e) < TARGET_MINUTES]
    versions = len(d.get("adapters") or [])
    practised = rounds[-1].get("practice_minutes", 0.0)
    if args.reward == "judge" and args.pair_accuracy == 0.5:
        met = versions == 0 and d.get("stopped_early") is None
        why = f"{versions} versions written in {practised:.0f} practice minutes"
    else:
        hits = [e for e in within if (e["z"] or 0) >= TARGET_Z]
        greedy_hits = [e for e in hits if _greedy_points(e) >= TARGET_GREEDY_POINTS]
        met = bool(greedy_hits if args.reward == "env" else hits)
        first = (greedy_hits if args.reward == "env" else hits) or hits
        why = (
            f"+3 s.e. at v{first[0]['version']} ({first[0]['practice_minutes']:.0f} min)"
            if first
            else f"not +3 s.e. within 60 practice minutes ({practised:.0f} practised)"
        )
        if args.reward == "env" and hits and not greedy_hits:
            measured = any(e["greedy_success"] is not None for e in hits)
            why += "; greedy not 10 points up" if measured else "; greedy not measured"
    base, greedy = d.get("base") or {}, d.get("base_greedy") or {}
    return {
        "file": path.name,
        "kind": kind,
        "seed": args.seed,
        "commit": d.get("commit"),
        "uncommitted_changes": d.get("uncommitted_changes"),
        "wall_s": d.get("wall_s"),
        "stopped_early": d.get("stopped_early"),
        "load_average_at_start": d.get("load_average_at_start"),
        "load_average_at_end": d.get("load_average_at_end"),
        "practice_minutes": practised,
        "versions_written": versions,
        "minutes_to_serve": minutes_to_serve(d.get("adapters") or []),
        "base": {"success": base.get("success"), "greedy_success": greedy.get("success")},
        "evaluations": evaluations,
        "last_within_60": within[-1] if within else None,
        "target": {"met": met, "why": why},
    }


def _greedy_points(e: dict[str, Any]) -> float:
    if e["greedy_success"] is None or e["greedy_base_success"] is None:
        return float("-inf")
    return float(e["greedy_success"] - e["greedy_base_success"])


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def per_kind(runs: list[dict[str, Any]]) -> dict[str, Any]:
    last = [r["last_within_60"] for r in runs if r["last_within_60"] is not None]
    return {
        "runs": len(runs),
        "seeds": sorted(r["seed"] for r in runs),
        "stopped_early": sum(r["stopped_early"] is not None for r in runs),
        "target_met": sum(r["target"]["met"] for r in runs),
        "versions_written": spread([float(r["versions_written"]) for r in runs]),
        "difference": spread([e["difference"] for e in last]),
        "z": spread([e["z"] for e in last if e["z"] is not None]),
        "greedy_points": spread([p for e in last if (p := _greedy_points(e)) != float("-inf")]),
    }


def table(kind: str, runs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        f"### {kind}: {summary['target_met']} of {summary['runs']} runs met the target",
        "",
        "| run (commit; +: with uncommitted changes) | versions | last evaluation within 60 min "
        "| difference [95 %], paired by task | s.e.s | success sampled | success greedy | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        e = r["last_within_60"]
        stopped = " (stopped early)" if r["stopped_early"] else ""
        if e is None:
            cells = ["no version served", "", "", "", ""]
        else:
            cells = [
                f"v{e['version']} at {e['practice_minutes']:.0f} min"
                + (
                    f" ({e['trainer_minutes']:.0f} of training)"
                    if e["trainer_minutes"] is not None
                    else ""
                ),
                (
                    f"{e['difference']:+.3f} [{e['low']:+.3f}, {e['high']:+.3f}]"
                    if e["low"] is not None
                    else f"{e['difference']:+.3f}"
                )
                + f" on {e['tasks']} tasks",
                f"{e['z']:+.1f}" if e["z"] is not None else "",
                f"{r['base']['success']:.0%} → {e['success']:.0%}",
                f"{e['greedy_base_success']:.0%} → {e['greedy_success']:.0%}"
                if e["greedy_success"] is not None and e["greedy_base_success"] is not None
                else "",
            ]
        met = "met" if r["target"]["met"] else "not met"
        commit = (r["commit"] or "?")[:7] + ("+" if r["uncommitted_changes"] else "")
        versions = str(r["versions_written"])
        if r["minutes_to_serve"]:
            served = r["minutes_to_serve"]
            versions += (
                f" ({served['versions']} served; median {served['median']:.0f} min to serve)"
            )
        lines.append(
            f"| `{r['file']}` ({commit}){stopped} | {versions} | "
            + " | ".join(cells)
            + f" | {met}: {r['target']['why']} |"
        )
    z = summary["z"]
    if z:
        lines += [
            "",
            f"median {z['median']:+.1f} s.e. (spread {z['low']:+.1f} to {z['high']:+.1f})",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    record = provenance.start({})
    files = sorted(args.results.glob("heldout_rerun*.json"))
    runs = [one_run(f) for f in files if f.name != "heldout_rerun_summary.json"]
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        kinds.setdefault(r["kind"], []).append(r)
    summaries = {kind: per_kind(rs) for kind, rs in sorted(kinds.items())}
    for kind, rs in sorted(kinds.items()):
        print(table(kind, rs, summaries[kind]) + "\n")
    out = args.results / "heldout_rerun_summary.json"
    out.write_text(
        json.dumps({**provenance.finish(record), "kinds": summaries, "runs": runs}, indent=1) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
