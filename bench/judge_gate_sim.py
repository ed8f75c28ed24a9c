"""The judge gate's error rates and checks to a decision, simulated with the stand-in judge's
noise model against rlproxy's own check and gate code.

Each run is one new judge scoring a stream of groups of 8 live-traffic members. Truth is drawn
per member from a reward shaped like one of the two agents' base-model traffic (`TRUTHS`); the
default canary (`declined`: the task answered with a refusal) has the task's lowest reward, 0,
as the two agents' rewards give it. The judge is bench/standin_judge.py's `noisy_scores` at pair
accuracy p: each judge call is informed (scores = true rewards) with probability 2p - 1, else
blind (uniform scores); a re-ordering is a second, independent call. What runs is rlproxy's:
front-loading (`front_loaded`), the pairwise canary check (`judge_canary`), Kendall's tau-b
(`kendall_tau_b`) and the gate (`gate_decision`) on `JudgeChecksConfig()`'s defaults, with the
shares drawn as `JudgeChecker` draws them.

Per p and truth it reports: the share of runs in which the judge's scores ever trained, were
held with the judge failed at the end, the groups (and checks of each kind) until the gate first
decided both kinds, and the share of groups after that first decision that were held.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/judge_gate_sim.py --runs 1000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import provenance

from bench.standin_judge import noisy_scores
from storage.records import JudgeCheckRecord
from trainer.scoring import judge_stats as st
from trainer.scoring.judge_checks import (
    JudgeChecksConfig,
    front_loaded,
    gate_decision,
    judge_canary,
)


def arithmetic_member(rng: random.Random) -> float:
    """A base-model reply's reward under examples/arithmetic_agent.py's `reward`, roughly as the
    live runs' base traffic had them (mean about 0.07): most replies are 40+ characters with no
    right number (0), some shorter (0.1 x brevity), some hold the sum (0.2 + 0.2 x brevity),
    a few are a wrong number alone (0.25) or the sum alone (1)."""
    u = rng.random()
    if u < 0.45:
        return 0.0
    if u < 0.80:
        return 0.1 * rng.random()
    if u < 0.95:
        return 0.2 + 0.2 * rng.random()
    return 0.25 if u < 0.995 else 1.0


def lookup_member(rng: random.Random) -> float:
    """examples/lookup_agent.py's reward on base traffic: mostly 0.1 (the word found, the number
    not), sometimes 0 or 1."""
    u = rng.random()
    return 0.0 if u < 0.1 else 0.1 if u < 0.95 else 1.0


TRUTHS: dict[str, Callable[[random.Random], float]] = {
    "arithmetic": arithmetic_member,
    "lookup": lookup_member,
}
CANARY_TRUTH = 0.0  # a refusal with no tool call: 0 under both agents' rewards


def as_read(stored: list[JudgeCheckRecord], window: int, read: str) -> list[JudgeCheckRecord]:
    """What the gate reads from `stored` (newest first). "kinds", as `Store.checks_of_judge`
    reads: the newest `window` checks, and the newest `window` of each kind however far back
    they lie. "groups", the read before it, for comparison in the same run: the newest `window`
    checks, whatever they hold."""
    if read == "groups":
        return stored[:window]
    canaries = [c for c in stored if c.canary_passed is not None][:window]
    positions = [c for c in stored if c.position_tau is not None][:window]
    found = {id(c): c for c in [*stored[:window], *canaries, *positions]}
    return sorted(found.values(), key=lambda c: int(c.group_id), reverse=True)


def one_run(
    p: float, truth: str, groups: int, config: JudgeChecksConfig, rng: random.Random, read: str
) -> dict[str, Any]:
    draw = TRUTHS[truth]
    stored: list[JudgeCheckRecord] = []  # newest first, as Store.checks_of_judge gives them
    decisions: list[str] = []
    first_decided: int | None = None
    checks_at_decision: tuple[int, int] | None = None
    for g in range(groups):
        force_canary, force_position = front_loaded(as_read(stored, config.window, read), config)
        canary = force_canary or rng.random() < config.canary_share
        position = force_position or rng.random() < config.position_share
        truth_of = [draw(rng) for _ in range(8)]
        check = JudgeCheckRecord(group_id=str(g), judge_model="j", rubric_hash="r", member_count=8)
        shown = list(truth_of)
        source, at = rng.randrange(8), rng.randrange(9)
        if canary:
            shown.insert(at, CANARY_TRUTH)
        scores, _ = noisy_scores(shown, p, rng)
        if canary:
            real = scores[:at] + scores[at + 1 :]
            outcome = judge_canary(scores[at], real[source], scores)
            check.canary_kind = "declined"
            check.canary_score, check.canary_median = scores[at], real[source]
            check.canary_passed = outcome in ("below", "tie")
        if position:
            again, _ = noisy_scores(list(reversed(shown)), p, rng)
            check.position_tau = st.kendall_tau_b(scores, list(reversed(again)))
        gate = gate_decision([check, *as_read(stored, config.window, read)], config)
        stored.insert(0, check)
        decisions.append(gate.decision)
        decided = {gate.canary.verdict, gate.self_agreement.verdict} <= {"pass", "fail", "off"}
        if first_decided is None and (
            decided or "fail" in (gate.canary.verdict, gate.self_agreement.verdict)
        ):
            first_decided = g + 1
            checks_at_decision = (gate.canary.checks, gate.self_agreement.checks)
    final = gate_decision(as_read(stored, config.window, read), config)
    after = decisions[first_decided:] if first_decided is not None else []
    return {
        "ever_trained": "train" in decisions,
        "failed_at_end": "judge failed" in (final.reason or ""),
        "trained_at_end": final.decision == "train",
        "first_decided": first_decided,
        "checks_at_decision": checks_at_decision,
        "decided_pass": first_decided is not None and decisions[first_decided - 1] == "train",
        "held_share_after": (after.count("held") / len(after)) if after else None,
        "trained_groups": decisions.count("train"),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(runs)
    decided = [r for r in runs if r["first_decided"] is not None]
    groups_to = sorted(r["first_decided"] for r in decided)
    canaries_to = sorted(r["checks_at_decision"][0] for r in decided)
    taus_to = sorted(r["checks_at_decision"][1] for r in decided)
    after = [r["held_share_after"] for r in runs if r["held_share_after"] is not None]

    def q(values: list[int], x: float) -> int | None:
        return values[min(len(values) - 1, int(x * len(values)))] if values else None

    return {
        "runs": n,
        "first_decision_train": sum(r["decided_pass"] for r in runs) / n,
        "first_decision_held": sum(1 for r in decided if not r["decided_pass"]) / n,
        "never_decided": (n - len(decided)) / n,
        "ever_trained": sum(r["ever_trained"] for r in runs) / n,
        "trained_at_end": sum(r["trained_at_end"] for r in runs) / n,
        "failed_at_end": sum(r["failed_at_end"] for r in runs) / n,
        "groups_to_decision": {
            "median": q(groups_to, 0.5),
            "p90": q(groups_to, 0.9),
            "max": groups_to[-1] if groups_to else None,
        },
        "canaries_to_decision": {"median": q(canaries_to, 0.5), "p90": q(canaries_to, 0.9)},
        "reorderings_to_decision": {"median": q(taus_to, 0.5), "p90": q(taus_to, 0.9)},
        "held_share_after_decision": statistics.fmean(after) if after else None,
        "mean_trained_groups": statistics.fmean(r["trained_groups"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument(
        "--groups",
        type=int,
        default=600,
        help="groups a judge scores in a run (more than the gate's window of 200: what happens "
        "once front-loading has ended and the first checks have left a window of groups)",
    )
    parser.add_argument("--accuracies", default="0.5,0.6,0.75,0.9,1.0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reads",
        default="kinds,groups",
        help="the gate's reads to simulate: kinds (rlproxy's), groups (the newest window of "
        "groups, the read before it)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/judge_gate_sim.json"))
    args = parser.parse_args()
    config = JudgeChecksConfig()
    record = provenance.start(
        settings={},
        runs=args.runs,
        groups=args.groups,
        reads=args.reads,
        seed=args.seed,
        gate={
            "min_checks": config.min_checks,
            "max_checks": config.max_checks,
            "min_canary_pass": config.min_canary_pass,
            "min_self_tau": config.min_self_tau,
            "canary_share": config.canary_share,
            "position_share": config.position_share,
            "hold_unchecked": config.hold_unchecked,
            "hold_undecided": config.hold_undecided,
            "window": config.window,
            "canary_kinds": list(config.canary_kinds),
        },
    )
    results: dict[str, dict[str, Any]] = {}
    by_read: dict[str, dict[str, dict[str, Any]]] = {}
    for read in args.reads.split(","):
        found = by_read.setdefault(read, {})
        for truth in TRUTHS:
            for p in (float(x) for x in args.accuracies.split(",")):
                rng = random.Random(f"{args.seed}-{truth}-{p}")
                runs = [one_run(p, truth, args.groups, config, rng, read) for _ in range(args.runs)]
                found.setdefault(truth, {})[f"{p:g}"] = summary = summarise(runs)
                print(read, truth, p, json.dumps(summary), flush=True)
    results = by_read.get("kinds") or next(iter(by_read.values()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {**provenance.finish(record), "results": results, "results_by_read": by_read},
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
