"""Why traffic is not training: the store's waiting figures read against the settings."""

from __future__ import annotations

from pathlib import Path

from proxy.settings import Settings
from proxy.telemetry.waiting import why_not_training
from storage.stats import Waiting

NOW = 1_000_000.0


def _reasons(waiting: Waiting, tmp_path: Path, **settings: object) -> list[str]:
    s = Settings(data_dir=tmp_path, **settings)  # type: ignore[arg-type]
    return [f"{a.what} | {a.fix}" for a in why_not_training(waiting, s, now=NOW)]


def test_tasks_asked_once_with_cohorts_off_are_told_what_would_train_them(
    tmp_path: Path,
) -> None:
    """The issue's finding: 40 questions asked once, groups forming forever, no word why."""
    (reason,) = _reasons(
        Waiting(alone=40, alone_since=NOW - 300), tmp_path, groups={"cohort": False}
    )
    assert "40 trajectories wait alone in their task's group (the oldest for 5 min)" in reason
    assert "RLPROXY_GROUP_COHORT=true" in reason and "X-RLProxy-Group" in reason


def test_with_cohorts_on_a_lone_task_is_told_when_it_moves(tmp_path: Path) -> None:
    (reason,) = _reasons(Waiting(alone=1, alone_since=NOW - 12), tmp_path)
    assert "1 trajectory waits for another run of its task" not in reason  # wording: "their"
    assert reason.startswith("1 trajectory waits for another run of their task (the oldest")
    assert "RLPROXY_GROUP_ALONE_S (60 s)" in reason


def test_ready_groups_without_rewards_name_the_missing_judge_or_reward(tmp_path: Path) -> None:
    (off,) = _reasons(Waiting(unrewarded_ready=3), tmp_path, judge={"scoring": False})
    assert "3 ready groups have members with no reward" in off and "/reward" in off
    (local,) = _reasons(Waiting(unrewarded_ready=1), tmp_path)
    assert "the local base model" in local and "RLPROXY_JUDGE_MODEL" in local
    assert _reasons(Waiting(unrewarded_ready=1), tmp_path, judge={"model": "openai/o3"}) == []


def test_small_groups_skipped_and_held_groups_each_say_what_to_change(tmp_path: Path) -> None:
    reasons = _reasons(
        Waiting(small=3, small_since=NOW - 3600, equal_rewards=5, held=2, alone_cohort=1),
        tmp_path,
        trainer={"enabled": False},
    )
    assert len(reasons) == 5
    assert reasons[0].startswith("This server runs no trainer")
    assert "1 trajectory is the only one of its agent in a cohort" in reasons[1]
    assert "below RLPROXY_GROUP_MIN_SIZE (4) members (the oldest for 60 min)" in reasons[2]
    assert "5 of the newest scored groups gave every member the same reward" in reasons[3]
    assert "2 groups are held" in reasons[4]


def test_nothing_waiting_says_nothing_but_open_trajectories_are_explained(tmp_path: Path) -> None:
    assert _reasons(Waiting(), tmp_path) == []
    (reason,) = _reasons(Waiting(open_trajectories=2), tmp_path)
    assert "2 trajectories are still open" in reason and "IDLE_TIMEOUT_S (600 s)" in reason
