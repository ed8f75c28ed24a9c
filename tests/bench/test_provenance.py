"""What every proof's result file records about its run (bench/provenance.py): the settings that
differ from `rlproxy serve`'s defaults, read by the settings class itself, the commit, the
command and the load; and a whole run of a benchmark script writes them into its own file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import provenance  # noqa: E402


def test_only_settings_that_change_something_are_reported() -> None:
    env = {
        "RLPROXY_TRAIN": "true",  # serve's default: not reported
        "RLPROXY_ROLLOUT": "false",
        "RLPROXY_TRAINER": json.dumps({"learning_rate": 3e-4, "groups_per_step": 4}),
        "RLPROXY_PORT": "1234",  # where, not how
        "RLPROXY_DATA_DIR": "/tmp/elsewhere",
        "RLPROXY_SCORING_INTERVAL_S": "0.25",
    }
    assert provenance.settings_differing(env) == {
        "judge.scoring_interval_s": 0.25,
        "rollout.enabled": False,
        "trainer.config.learning_rate": 3e-4,  # groups_per_step 4 is the default
    }
    assert provenance.settings_differing({}) == {}


def test_the_callers_environment_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPROXY_EVAL_SHARE", "0.2")
    assert provenance.settings_differing({"RLPROXY_ROLLOUT": "false"}) == {"rollout.enabled": False}
    assert os.environ["RLPROXY_EVAL_SHARE"] == "0.2"
    assert "RLPROXY_ROLLOUT" not in os.environ


def test_a_record_names_the_commit_command_settings_and_load() -> None:
    record = provenance.start({"rollout.enabled": False}, seed=3)
    done = provenance.finish(record, stopped_early="interrupted by hand")
    assert len(done["commit"]) == 40 and isinstance(done["uncommitted_changes"], bool)
    assert done["settings_differing_from_defaults"] == {"rollout.enabled": False}
    assert done["seed"] == 3 and done["stopped_early"] == "interrupted by hand"
    assert len(done["load_average_at_start"]) == 3 and len(done["load_average_at_end"]) == 3
    assert "_t0" not in done and done["wall_s"] >= 0


def test_a_benchmark_run_writes_its_record_into_its_result_file(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "bench/rollout_sim.py", "--runs", "20", "--out", str(tmp_path)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    written = json.loads((tmp_path / "rollout_sim.json").read_text())
    assert written["command"].endswith(f"rollout_sim.py --runs 20 --out {tmp_path}")
    assert written["settings_differing_from_defaults"] == {}
    assert written["stopped_early"] is None
    assert {"commit", "load_average_at_start", "load_average_at_end", "wall_s"} <= set(written)
