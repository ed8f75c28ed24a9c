"""Atomic adapter checkpoints: round trip, crash leftovers never returned, corrupt ones skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer import checkpoints
from trainer.checkpoints import (
    latest_checkpoint,
    read_adapter_config,
    read_adapter_state,
    read_optimizer_state,
    read_trainer_state,
    write_checkpoint,
)

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def _write(root: Path, step: int, value: float = 1.0) -> Path:
    return write_checkpoint(
        root,
        step,
        adapter_state={"base_model.model.q_proj.lora_A.weight": torch.full((2, 3), value)},
        adapter_config=ADAPTER_CONFIG,
        trainer_state={"group_ids": [f"g{step}"], "seed": 0},
        optimizer_state={"p.exp_avg": torch.full((2, 3), value / 2), "p.step": torch.tensor(3.0)},
    )


def test_round_trip(tmp_path: Path) -> None:
    path = _write(tmp_path, 1, value=0.25)
    assert path == tmp_path / "0001"
    assert sorted(p.name for p in path.iterdir()) == sorted(checkpoints.FILES)
    assert read_adapter_config(path) == ADAPTER_CONFIG
    assert read_trainer_state(path) == {"group_ids": ["g1"], "seed": 0, "step": 1}
    weights = read_adapter_state(path)
    assert torch.equal(weights["base_model.model.q_proj.lora_A.weight"], torch.full((2, 3), 0.25))
    optimizer = read_optimizer_state(path)
    assert torch.equal(optimizer["p.exp_avg"], torch.full((2, 3), 0.125))
    assert optimizer["p.step"].item() == 3.0
    assert latest_checkpoint(tmp_path) == path
    assert not list(tmp_path.glob(".tmp-*"))


def test_checkpoint_passes_the_serving_side_validation(tmp_path: Path) -> None:
    from trainer.checkpoints import validate_adapter

    validate_adapter(_write(tmp_path, 1))


def test_latest_is_the_highest_complete_version(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    for step in (1, 2, 10):
        _write(tmp_path, step)
    assert latest_checkpoint(tmp_path) == tmp_path / "0010"
    assert checkpoints.list_versions(tmp_path) == [1, 2, 10]


def test_a_crashed_write_is_never_returned_and_is_cleaned_by_the_next(tmp_path: Path) -> None:
    good = _write(tmp_path, 1)
    # A crash after every file was written but before the rename: a complete-looking tmp folder.
    crashed = tmp_path / ".tmp-0002-deadbeef"
    crashed.mkdir()
    for f in good.iterdir():
        (crashed / f.name).write_bytes(f.read_bytes())
    assert latest_checkpoint(tmp_path) == good
    assert crashed.exists()  # readers only ignore it
    _write(tmp_path, 2)
    assert not crashed.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "0002"


def test_truncated_weights_are_rejected_and_latest_falls_back(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    bad = _write(tmp_path, 2)
    weights = bad / checkpoints.ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8])  # the last tensor's bytes are cut short
    assert not checkpoints.is_complete(bad)
    with pytest.raises(checkpoints.CheckpointError, match="corrupt"):
        checkpoints.validate_checkpoint(bad)
    assert latest_checkpoint(tmp_path) == tmp_path / "0001"


@pytest.mark.parametrize("name", checkpoints.FILES)
def test_a_missing_file_makes_a_version_incomplete(tmp_path: Path, name: str) -> None:
    _write(tmp_path, 1)
    (_write(tmp_path, 2) / name).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "0001"


def test_a_version_is_never_overwritten_but_an_invalid_one_is_moved_aside(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    with pytest.raises(FileExistsError):
        _write(tmp_path, 1)
    (tmp_path / "0001" / checkpoints.TRAINER_STATE).write_text("{not json")
    path = _write(tmp_path, 1, value=2.0)
    assert json.loads((path / checkpoints.TRAINER_STATE).read_text())["step"] == 1
    assert len(list(tmp_path.glob(".rejected-0001-*"))) == 1
    assert latest_checkpoint(tmp_path) == path


def test_version_zero_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="start at 1"):
        _write(tmp_path, 0)
