"""Which LoRA learning rate should `rlproxy serve` default to? The learning proof at several rates.

Runs `bench/learning_proof.py` (practice groups of one question, the environment's reward,
held-out questions never practised) once per rate for the same training budget, everything
else equal, one run after the other on this machine, and writes what each reached:

    OMP_NUM_THREADS=1 .venv/bin/python bench/lr_sweep.py \
        [--rates 1e-4,3e-4,6e-4,1.2e-3,2.4e-3] [--minutes 4] [--out bench/results]

Per rate: the held-out reward (sampled) of the base and of every evaluated version with its
standard error, the training minutes to each, the gain of the last version over the base in
standard errors, and the greedy exact share. The figure that decides: the gain reached within
the same training minutes (a rate that learns in fewer steps learns in fewer minutes on this
CPU, every step costing about the same). A rate so high that the last version writes one answer to
every question (every held-out answer scores the same, s.e. 0) is marked collapsed, not ranked by
its gain in standard errors. The canary rollout is off (`GUARD_OFF`). Writes
`<out>/lr_sweep.json` with the provenance of `bench/provenance.py`, and each run's own file
beside it (`lr_sweep_runs/learning_<rate>.json`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import provenance

REPO = Path(__file__).resolve().parent.parent
GUARD_OFF = {"RLPROXY_ROLLOUT": "false"}
"""The canary rollout decides which version serves, not how fast the optimizer learns; and the
learning proof waits for each version before its next practice round, so a canary waiting for
that round's evidence would stall it. Recorded in each run's file as a differing setting."""


def summarise(run: dict) -> dict:
    evals = run["evals"]
    base = evals[0]
    points = []
    for e in evals:
        se = math.hypot(base["stderr"], e["stderr"])
        points.append(
            {
                "version": e["version"],
                "train_minutes": e.get("train_minutes") or 0.0,
                "mean_reward": e["mean_reward"],
                "stderr": e["stderr"],
                "exact": e["exact"],
                "greedy_exact": e["greedy"]["exact"],
                "gain_in_standard_errors": (e["mean_reward"] - base["mean_reward"]) / se
                if se
                else None,
            }
        )
    return {
        "steps": run["steps"],
        "gain": run["gain"],
        "gain_in_standard_errors": run["gain_in_standard_errors"],
        "minutes_to_3_standard_errors": run["minutes_to_3_standard_errors"],
        # Every held-out answer scored the same: the version writes one answer to everything. Its
        # s.e. is 0, so its "gain in standard errors" is large and means nothing.
        "collapsed": points[-1]["stderr"] == 0,
        "evals": points,
    }


def verdict(summary: dict) -> str:
    """The gain column of the table: the last version's gain in standard errors, unless it
    collapsed."""
    if summary["collapsed"]:
        last = summary["evals"][-1]
        return f"collapsed: every held-out answer scored {last['mean_reward']:.3f}"
    return f"{summary['gain_in_standard_errors']:+.1f} s.e."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1e-4,3e-4,6e-4,1.2e-3,2.4e-3")
    parser.add_argument("--minutes", type=float, default=4.0, help="training budget per rate")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="run nothing: summarise the runs' files already in <out>/lr_sweep_runs/",
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    runs_dir = args.out / "lr_sweep_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    record = provenance.start(
        settings={"rollout.enabled": False},  # and each run's rate: see "rates"
        rates=rates,
        minutes_per_rate=args.minutes,
        note="the learning proof's own settings (groups of 8, polling 0.25 s) besides the rate",
        summarised_from_runs=args.from_runs,
    )
    results: dict[str, dict] = {}
    for rate in rates:
        tmp = runs_dir / f"tmp_{rate:g}"
        kept = runs_dir / f"learning_{rate:g}.json"
        exit_code = None
        if not args.from_runs:
            cmd = [
                sys.executable,
                str(REPO / "bench" / "learning_proof.py"),
                "--lr", f"{rate:g}",
                "--minutes", str(args.minutes),
                "--stop-at-exact", "2",  # never stop early: every rate gets the same budget
                "--eval-every", "4",
                "--out", str(tmp),
            ]  # fmt: skip
            print("running", " ".join(cmd), flush=True)
            exit_code = subprocess.run(cmd, cwd=REPO, env=os.environ | GUARD_OFF).returncode
        for found in (tmp / "learning.json", kept):  # a run that failed after writing counts
            if found.exists():
                run = json.loads(found.read_text())
                break
        else:
            results[f"{rate:g}"] = {"error": f"learning_proof exited {exit_code}, no result file"}
            continue
        kept.write_text(json.dumps(run, indent=2))
        results[f"{rate:g}"] = summarise(run) | {"learning_proof_exit_code": exit_code}
        for name in ("learning.json", "learning.png"):
            (tmp / name).unlink(missing_ok=True)
        if tmp.exists():
            tmp.rmdir()
        print(json.dumps({f"{rate:g}": results[f"{rate:g}"]["evals"][-1]}), flush=True)
    out = {**provenance.finish(record), "results": results}
    (args.out / "lr_sweep.json").write_text(json.dumps(out, indent=2))
    print("\n| rate | steps | last version | reward (base -> last) | gain | greedy exact |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rate, r in results.items():
        if "error" in r:
            print(f"| {rate} | {r['error']} |")
            continue
        first, last = r["evals"][0], r["evals"][-1]
        print(
            f"| {rate} | {r['steps']} | v{last['version']} ({last['train_minutes']:.1f} min) "
            f"| {first['mean_reward']:.3f} -> {last['mean_reward']:.3f} "
            f"| {verdict(r)} "
            f"| {first['greedy_exact']:.0%} -> {last['greedy_exact']:.0%} |"
        )
    print(f"wrote {args.out / 'lr_sweep.json'}")


if __name__ == "__main__":
    main()
