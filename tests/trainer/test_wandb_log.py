"""Weights & Biases logging of training steps, in W&B's offline mode (no account, no network).

The run W&B writes under WANDB_DIR is read back record by record (`wandb_history`), so the test
checks what W&B stored, not what was handed to it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from trainer.loop import StepReport
from trainer.wandb_log import WandbLog


def wandb_history(wandb_dir: Path, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The history rows of the one offline run under `wandb_dir`, with their step.

    W&B's writer is a process of its own, which may still be writing when `run.finish()` has
    returned (seen on a loaded machine: no history rows read back). So this reads until the
    file holds the run's `exit` record, written after every history row, for at most
    `timeout_s`, and fails saying so if it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
        if len(files) == 1:
            kinds, rows = _records(files[0])
            if "exit" in kinds:
                return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"no finished W&B run under {wandb_dir} after {timeout_s} s")
        time.sleep(0.2)


def _records(path: Path) -> tuple[set[str], list[dict[str, Any]]]:
    """The kinds of record in a `.wandb` file and its history rows.

    A `.wandb` file is W&B's header (":W&B", a 2-byte magic, a version byte) and then LevelDB's
    log format: 32 KiB blocks of records, each with a 7-byte header (crc32, length, type: 1 a
    whole record, 2/3/4 its first, middle and last pieces), each a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if len(data) < 7:
        return set(), []
    assert data[:4] == b":W&B"
    block, header, pos = 32768, 7, 7
    raws, partial = [], b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # the rest of a block too small for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 1:
            raws.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            raws.append(partial + chunk)
    rows, kinds = [], set()
    for raw in raws:
        record = pb.Record()
        try:
            record.ParseFromString(raw)
        except Exception:  # a record still being written: read it on the next pass
            continue
        kind = record.WhichOneof("record_type")
        kinds.add(kind or "")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            rows.append({"step": record.history.step.num, **items})
    return kinds, rows


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'rlproxy[wandb]'")
    monkeypatch.setenv("WANDB_PROJECT", "rlproxy-test")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def _report(version: int, loss: float) -> StepReport:
    metrics = {"loss": loss, "mean_reward": 0.25 * version, "groups": 4, "note": "text"}
    return StepReport(version, Path("."), ["g"], [], 0.25 * version, metrics)


def test_each_step_is_logged_at_its_version(offline: Path) -> None:
    log = WandbLog.from_env({"learning_rate": 1e-4}, policy="rlproxy")
    assert log is not None
    log(_report(1, 0.5))
    log(_report(2, 0.25))
    log.close()
    rows = wandb_history(offline)
    assert [r["step"] for r in rows] == [1, 2]
    assert [float(r["train/loss"]) for r in rows] == [0.5, 0.25]
    assert [float(r["train/mean_reward"]) for r in rows] == [0.25, 0.5]
    assert "train/note" not in rows[0]  # only numbers are logged


def test_without_wandb_project_nothing_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert WandbLog.from_env({}, policy="rlproxy") is None
