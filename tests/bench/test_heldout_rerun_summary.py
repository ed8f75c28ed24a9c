"""bench/heldout_rerun_summary.py on hand-made result files: each run's kind from its command,
the proof's target per kind, and the median and spread over a kind's runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PROOF = "python bench/heldout_rerun_proof.py"


def _evaluation(
    minutes: float, version: int, diff: float, se: float, greedy: float | None, tasks: int = 100
) -> dict[str, Any]:
    e: dict[str, Any] = {
        "practice_minutes": minutes,
        "version": version,
        "script": {"tasks": tasks, "reward_difference": diff, "reward_difference_se": se},
        "success": 0.2,
        "proxy_rerun": {"vs_base": {"low": diff - 2 * se, "high": diff + 2 * se}},
    }
    if greedy is not None:
        e["greedy"] = {"success": greedy, "base_success": 0.01}
    return e


def _write(results: Path, name: str, command: str, **fields: Any) -> None:
    body: dict[str, Any] = {"command": command, "stopped_early": None, "base": {"success": 0.04}}
    body |= {"base_greedy": {"success": 0.01}, "practice_rounds": [{"practice_minutes": 60.2}]}
    (results / name).write_text(json.dumps(body | fields))


def _summarise(results: Path) -> subprocess.CompletedProcess[str]:
    """The summary script run on `results`, as from the command line; it must succeed."""
    done = subprocess.run(
        [sys.executable, "bench/heldout_rerun_summary.py", "--results", str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_runs_are_told_apart_by_kind_and_held_to_their_kinds_target(tmp_path: Path) -> None:
    live = f"{PROOF} --traffic live --minutes 60 --eval-every 20"
    _write(
        tmp_path,
        "heldout_rerun_live_env_1.json",
        f"{live} --seed 1",
        adapters=[{"version": v, "metrics": {"seconds": 120.0}} for v in range(1, 10)],
        evaluations=[_evaluation(20, 4, 0.05, 0.03, 0.02), _evaluation(60, 9, 0.2, 0.05, 0.2)],
    )
    _write(  # +3 s.e. but greedy only 4 points up; a larger evaluation is the same kind
        tmp_path,
        "heldout_rerun_live_env_2.json",
        f"{live} --seed 2 --eval-tasks 300 --greedy-tasks 100",
        adapters=[{}] * 7,
        evaluations=[_evaluation(60, 7, 0.16, 0.04, 0.05, tasks=300)],
    )
    _write(  # a later evaluation past 60 minutes does not count
        tmp_path,
        "heldout_rerun_live_env_3.json",
        f"{live} --seed 3 --minutes 90",
        adapters=[{}] * 12,
        evaluations=[_evaluation(60, 8, 0.03, 0.03, 0.0), _evaluation(90, 12, 0.3, 0.05, 0.3)],
    )
    _write(  # the evaluation at the end of the round that crossed minute 60 counts
        tmp_path,
        "heldout_rerun_live_env_4.json",
        f"{live} --seed 4 --eval-every 60",
        adapters=[{}] * 12,
        evaluations=[_evaluation(61.27, 12, 0.044, 0.018, 0.01, tasks=300)],
        practice_rounds=[{"practice_minutes": m} for m in (1.3, 30.0, 58.19, 61.27)],
    )
    coin = f"{PROOF} --agent arithmetic --traffic live --reward judge --pair-accuracy 0.5"
    _write(tmp_path, "heldout_rerun_arithmetic_live_judge50_1.json", f"{coin} --seed 1")
    _write(
        tmp_path,
        "heldout_rerun_arithmetic_live_judge50_2.json",
        f"{coin} --seed 2",
        adapters=[{}],
    )
    shadow = f"{PROOF} --agent arithmetic --reward judge --set RLPROXY_SHADOW_SAMPLES=4 --seed 1"
    _write(tmp_path, "heldout_rerun_arithmetic_practice_judge90_shadow_samples4_1.json", shadow)

    done = _summarise(tmp_path)
    summary = json.loads((tmp_path / "heldout_rerun_summary.json").read_text())
    kinds = summary["kinds"]
    assert set(kinds) == {
        "lookup live env",
        "arithmetic live judge50",
        "arithmetic practice judge90 RLPROXY_SHADOW_SAMPLES=4",
    }
    env = kinds["lookup live env"]
    assert env["runs"] == 4 and env["target_met"] == 1
    assert env["z"]["median"] == pytest.approx((0.044 / 0.018 + 4.0) / 2)
    assert env["z"]["low"] == 1.0 and env["z"]["high"] == 4.0
    by_file = {r["file"]: r for r in summary["runs"]}
    assert by_file["heldout_rerun_live_env_1.json"]["target"]["why"] == "+3 s.e. at v9 (60 min)"
    assert "greedy not 10 points up" in by_file["heldout_rerun_live_env_2.json"]["target"]["why"]
    assert by_file["heldout_rerun_live_env_3.json"]["last_within_60"]["version"] == 8
    assert by_file["heldout_rerun_live_env_4.json"]["last_within_60"]["version"] == 12
    # the trainer's step minutes before each evaluated version: v4 after 4 steps of 2 minutes
    first, last = by_file["heldout_rerun_live_env_1.json"]["evaluations"]
    assert (first["trainer_minutes"], last["trainer_minutes"]) == (8.0, 18.0)
    assert by_file["heldout_rerun_live_env_2.json"]["last_within_60"]["trainer_minutes"] is None
    assert "v9 at 60 min (18 of training)" in done.stdout
    assert "+0.200 [+0.100, +0.300] on 100 tasks" in done.stdout
    assert "+0.160 [+0.080, +0.240] on 300 tasks" in done.stdout
    assert kinds["arithmetic live judge50"]["target_met"] == 1  # the run with no version
    assert "### lookup live env: 1 of 4 runs met the target" in done.stdout


def test_each_run_says_how_long_its_versions_waited_to_serve(tmp_path: Path) -> None:
    """The minutes from a version's checkpoint to its serving the policy name (its canary trial),
    for every version that served; the median per run, shown beside the versions written."""
    live = f"{PROOF} --traffic live --minutes 60 --eval-every 60"
    t0 = 1_000_000.0
    adapters = [
        {"version": 1, "created_at": t0, "activated_at": t0 + 600},  # 10 minutes
        {"version": 2, "created_at": t0 + 300},  # never served
        {"version": 3, "created_at": t0 + 900, "activated_at": t0 + 900 + 240},  # 4
        {"version": 4, "created_at": t0 + 1500, "activated_at": t0 + 1500 + 480},  # 8
    ]
    _write(
        tmp_path,
        "heldout_rerun_live_env_1.json",
        f"{live} --seed 1",
        adapters=adapters,
        evaluations=[_evaluation(60, 4, 0.05, 0.03, 0.02)],
    )
    _write(  # a run from before the times were kept: none known
        tmp_path,
        "heldout_rerun_live_env_2.json",
        f"{live} --seed 2",
        adapters=[{}] * 3,
        evaluations=[_evaluation(60, 3, 0.05, 0.03, 0.02)],
    )
    done = _summarise(tmp_path)
    summary = json.loads((tmp_path / "heldout_rerun_summary.json").read_text())
    by_file = {r["file"]: r for r in summary["runs"]}
    waited = by_file["heldout_rerun_live_env_1.json"]["minutes_to_serve"]
    assert waited == {"versions": 3, "median": 8.0, "low": 4.0, "high": 10.0}
    assert by_file["heldout_rerun_live_env_2.json"]["minutes_to_serve"] is None
    row = "| `heldout_rerun_live_env_1.json` (?) | 4 (3 served; median 8 min to serve) |"
    assert row in done.stdout
    assert "| `heldout_rerun_live_env_2.json` (?) | 3 |" in done.stdout
