"""Settings by concern (proxy/settings.py): every variable keeps its one name and reaches the
field of its concern, the typed configurations are built from the concerns, a misspelt
`RLPROXY_TRAINER` key is refused naming the nearest key, and unknown `RLPROXY_` variables are
named with the nearest known one."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.adapters.rollout import rollout_config
from proxy.chat.request import RequestLimits
from proxy.settings import (
    CONCERNS,
    NOT_SETTINGS,
    Settings,
    error_lines,
    known_variables,
    unknown_variables,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_rlproxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees only the variables it sets."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("RLPROXY_"):
            monkeypatch.delenv(name)


def _at(settings: Settings, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(
    ("variable", "raw", "path", "value"),
    [
        ("RLPROXY_PORT", "9001", "port", 9001),
        ("RLPROXY_JUDGE_MODEL", "openai/o3", "judge.model", "openai/o3"),
        ("RLPROXY_JUDGE_VOTES", "5", "judge.votes", 5),
        ("RLPROXY_SCORING", "false", "judge.scoring", False),
        ("RLPROXY_SCORING_INTERVAL_S", "2.5", "judge.scoring_interval_s", 2.5),
        ("RLPROXY_JUDGE_CHECKS", "false", "judge_checks.enabled", False),
        ("RLPROXY_JUDGE_GATE_MIN_CHECKS", "7", "judge_checks.gate_min_checks", 7),
        ("RLPROXY_JUDGE_DRIFT_WINDOW", "9", "judge_checks.drift_window", 9),
        ("RLPROXY_GROUP_MIN_SIZE", "3", "groups.min_size", 3),
        ("RLPROXY_SHADOW_SAMPLES", "4", "groups.shadow_samples", 4),
        ("RLPROXY_ROLLOUT", "true", "rollout.enabled", True),
        ("RLPROXY_ROLLOUT_SHARE", "0.5", "rollout.share", 0.5),
        ("RLPROXY_VLLM_URLS", '["http://a:8000"]', "vllm.urls", ["http://a:8000"]),
        ("RLPROXY_VLLM_AFFINITY_SLACK", "2", "vllm.affinity_slack", 2),
        ("RLPROXY_MAX_N", "3", "limits.max_n", 3),
        ("RLPROXY_CALLER_CONCURRENCY", "5", "limits.caller_concurrency", 5),
        ("RLPROXY_HEADER_TIMEOUT_S", "3", "limits.header_timeout_s", 3.0),
        ("RLPROXY_METRICS_AUTH", "admin", "telemetry.metrics_auth", "admin"),
        ("RLPROXY_TELEMETRY_CAPTURE_CONTENT", "true", "telemetry.capture_content", True),
        ("RLPROXY_TRAIN", "false", "trainer.enabled", False),
        ("RLPROXY_TRAIN_POLL_S", "0.5", "trainer.poll_s", 0.5),
        ("RLPROXY_TRAIN_THREADS", "2", "trainer.threads", 2),
        ("RLPROXY_TRAINER_NICE", "19", "trainer.nice", 19),
        ("RLPROXY_TRAINER_PROCESSES", "2", "trainer.processes", 2),
        ("RLPROXY_TRAINER", '{"groups_per_step": 2}', "trainer.config.groups_per_step", 2),
    ],
)
def test_a_variable_sets_the_field_of_its_concern(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str, path: str, value: Any
) -> None:
    monkeypatch.setenv(variable, raw)
    assert _at(Settings(), path) == value
    assert known_variables()[variable] == path.removesuffix(".groups_per_step")


def test_every_concern_variable_is_named_by_its_prefix_or_its_alias() -> None:
    known = known_variables()
    assert len(known) == len(set(known.values()))  # one variable per field, one field each
    for attr, concern in CONCERNS.items():
        for name, variable in concern.env_names().items():
            assert known[variable] == f"{attr}.{name}"
            assert variable.startswith("RLPROXY_")
    assert known["RLPROXY_JUDGE_GATE_WINDOW"] == "judge_checks.gate_window"
    assert known["RLPROXY_ROLLOUT"] == "rollout.enabled"


def test_a_concern_given_in_code_still_reads_its_other_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RLPROXY_JUDGE_TIMEOUT_S", "7")
    settings = Settings(judge={"model": "openai/o3"})
    assert (settings.judge.model, settings.judge.timeout_s) == ("openai/o3", 7.0)


def test_a_flat_keyword_of_a_concern_field_is_refused() -> None:
    with pytest.raises(ValidationError, match="judge_model"):
        Settings(judge_model="openai/o3")  # type: ignore[call-arg]


def test_the_typed_configurations_come_from_their_concerns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPROXY_JUDGE_GATE_MIN_CHECKS", "11")
    monkeypatch.setenv("RLPROXY_JUDGE_MODE", "turns")
    monkeypatch.setenv("RLPROXY_REWARD_POLICY", "ruler")
    monkeypatch.setenv("RLPROXY_GROUP_ALONE_S", "5")
    monkeypatch.setenv("RLPROXY_MAX_SCHEMA_DEPTH", "12")
    settings = Settings()
    scoring = settings.scoring_config()
    assert (scoring.mode, scoring.reward_policy) == ("turns", "ruler")
    assert scoring.checks is not None and scoring.checks.min_checks == 11
    assert settings.groups.grouper().alone_s == 5.0
    assert RequestLimits(**settings.limits.request_bounds()).max_schema_depth == 12
    guard = rollout_config(settings.rollout, settings.reward_policy)  # on by default
    assert guard is not None and guard.reward_policy == "ruler" and guard.max_calls == 200
    off = Settings(judge_checks={"enabled": False}, rollout={"enabled": False})
    assert off.scoring_config().checks is None and off.judge_checks.config() is None
    assert rollout_config(off.rollout, off.reward_policy) is None


def test_a_misspelt_trainer_key_is_refused_naming_the_nearest_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RLPROXY_TRAINER", '{"learning_rat": 1e-4}')
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert error_lines(caught.value) == [
        "RLPROXY_TRAINER: unknown trainer config field 'learning_rat' "
        "(did you mean 'learning_rate'?)"
    ]


def test_a_bad_value_is_worded_by_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPROXY_ROLLOUT_SHARE", "2")
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert error_lines(caught.value) == ["RLPROXY_ROLLOUT_SHARE: Input should be less than 1"]
    monkeypatch.delenv("RLPROXY_ROLLOUT_SHARE")
    with pytest.raises(ValidationError) as given:
        Settings(groups={"min_size": 1}, port=0)
    assert sorted(error_lines(given.value)) == [
        "RLPROXY_GROUP_MIN_SIZE: Input should be greater than or equal to 2",
        "RLPROXY_PORT: Input should be greater than or equal to 1",
    ]


def test_status_reads_groups_per_step_from_the_trainer_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer.config import TrainerConfig

    assert Settings().trainer.config.groups_per_step == TrainerConfig().groups_per_step
    monkeypatch.setenv("RLPROXY_TRAINER", '{"groups_per_step": 9}')
    assert Settings().trainer.config.groups_per_step == 9


def test_unknown_variables_are_named_with_the_nearest_known_one() -> None:
    environ = {
        "RLPROXY_GROUP_MIN_SIZ": "2",
        "rlproxy_judge_modle": "x",
        "RLPROXY_PORT": "8000",  # a setting
        "RLPROXY_TEST_MODEL_DIR": "/m",  # a test variable, not a setting
        "RLPROXY_ZZZZZZZZZZ": "1",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        "unknown environment variable RLPROXY_GROUP_MIN_SIZ (did you mean "
        "RLPROXY_GROUP_MIN_SIZE?); rlproxy ignores it",
        "unknown environment variable RLPROXY_ZZZZZZZZZZ; rlproxy ignores it",
        "unknown environment variable rlproxy_judge_modle (did you mean "
        "RLPROXY_JUDGE_MODE?); rlproxy ignores it",
    ]


def test_every_rlproxy_variable_the_repository_names_is_known() -> None:
    """A variable read outside the settings (deploy, tests, tools) belongs in NOT_SETTINGS, so
    that serve does not warn about it."""
    files = subprocess.run(
        ["git", "ls-files", "proxy", "trainer", "storage", "tests", "bench", "deploy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    named: set[str] = set()
    misspelt_on_purpose = {"tests/proxy/test_settings.py", "tests/e2e/test_settings_at_start.py"}
    for name in set(files) - misspelt_on_purpose:
        path = ROOT / name
        if path.suffix in {".py", ".sh", ".yaml", ".yml", ".cfg", ".example", ""} and path.exists():
            named |= set(re.findall(r"RLPROXY_[A-Z0-9_]+", path.read_text(errors="ignore")))
    named = {n for n in named if not n.endswith("_")}  # "RLPROXY_GROUP_*" in prose
    constants = {"RLPROXY_ENV"}  # a dict's name in tests/deploy/test_compose_vllm.py
    strays = named - set(known_variables()) - NOT_SETTINGS - constants
    assert strays == set()
