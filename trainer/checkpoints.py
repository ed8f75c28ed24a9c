"""Adapter checkpoints on disk: written atomically, found again after a crash.

This module is the one owner of the checkpoint folder layout: the trainer writes through it and
the serving side (`proxy.adapters.manager`) finds and validates versions through it. Layout under
one root (`<data-dir>/checkpoints/<policy>/`):

    <root>/0001/adapter_config.json        PEFT's adapter config     } exactly what the engine
    <root>/0001/adapter_model.safetensors  PEFT's adapter weights    } loads (`validate_adapter`)
    <root>/0001/trainer_state.json         step, config, metrics, group ids used, seed
    <root>/0001/optimizer.safetensors      optimizer state as named tensors
    <root>/.tmp-0002-k3j9x/                a write in progress (or one a crash interrupted)

The folder name is the version: the training step that produced it, four digits, from 0001.
A write builds everything in a `.tmp-NNNN-*` sibling, fsyncs every file and the folder, renames
it into place and fsyncs the root, so a numbered folder is either complete or absent. Nothing
is pickled. Leftover `.tmp-*` folders are never read; `write_checkpoint` and
`remove_incomplete` delete them, which assumes one writer (one trainer) per root.

Validation (`is_complete`) reads every tensor of both safetensors files (`validate_adapter`,
serving's check, reads the adapter's): a header alone does not reveal a truncated file, and the
files are a few MB. A numbered folder that fails it (a disk that lied about fsync,
a hand edit) is skipped by `latest_checkpoint`, which falls back to the previous version.

This module stores and finds files, and turns an optimizer's state into named tensors and back;
it knows nothing about models or how the adapter dicts are made.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.safetensors"
FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINER_STATE, OPTIMIZER_STATE)
TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, incomplete or corrupt."""


class CheckpointMissing(CheckpointError):
    """No folder for that version."""


def version_dir(root: Path, step: int) -> Path:
    return root / f"{step:04d}"


def write_checkpoint(
    root: Path,
    step: int,
    adapter_state: dict[str, torch.Tensor],
    adapter_config: dict[str, Any],
    trainer_state: dict[str, Any],
    optimizer_state: dict[str, torch.Tensor],
) -> Path:
    """Write version `step` atomically and return its folder.

    `trainer_state` is stored as given, with "step" set to `step`. A complete folder for this
    step already there is an error; an invalid one is moved aside to `.rejected-NNNN-*`.
    """
    if step < 1:
        raise ValueError(f"checkpoint versions start at 1, got step {step}")
    root.mkdir(parents=True, exist_ok=True)
    remove_incomplete(root)
    target = version_dir(root, step)
    if target.exists():
        if is_complete(target):
            raise FileExistsError(f"checkpoint {target} already exists; versions are never reused")
        aside = root / f".rejected-{step:04d}-{secrets.token_hex(4)}"
        logger.warning("moving invalid checkpoint %s aside to %s", target, aside)
        os.rename(target, aside)

    tmp = root / f"{TMP_PREFIX}{step:04d}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _write_json(tmp / ADAPTER_CONFIG, adapter_config)
        _write_tensors(tmp / ADAPTER_WEIGHTS, adapter_state)
        _write_json(tmp / TRAINER_STATE, {**trainer_state, "step": step})
        _write_tensors(tmp / OPTIMIZER_STATE, optimizer_state)
        _fsync_dir(tmp)
        os.rename(tmp, target)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote checkpoint %s", target)
    return target


def remove_incomplete(root: Path) -> None:
    """Delete `.tmp-*` folders left by interrupted writes (only the writer may call this)."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith(TMP_PREFIX) and path.is_dir():
            logger.info("removing incomplete checkpoint %s", path)
            shutil.rmtree(path, ignore_errors=True)


def list_versions(root: Path) -> list[int]:
    """Versions renamed into place, ascending (complete or not: see `latest_checkpoint`)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def latest_checkpoint(root: Path) -> Path | None:
    """The highest version whose files all validate, or None when there is none."""
    for version in reversed(list_versions(root)):
        path = version_dir(root, version)
        try:
            validate_checkpoint(path)
        except CheckpointError as exc:
            logger.warning("skipping checkpoint %s: %s", path, exc)
            continue
        return path
    return None


def validate_adapter(path: Path) -> None:
    """What serving needs of a version (it may have been written by hand, with PEFT alone): the
    adapter's config parses and every tensor of its weights reads. Raises CheckpointMissing or
    CheckpointError with the reason."""
    if not path.is_dir():
        raise CheckpointMissing(f"no adapter at {path}")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise CheckpointError(f"adapter at {path} is incomplete: {name} is missing")
    try:
        if not isinstance(json.loads((path / ADAPTER_CONFIG).read_text()), dict):
            raise ValueError(f"{ADAPTER_CONFIG} is not a JSON object")
        _read_tensors(path / ADAPTER_WEIGHTS)
    except Exception as exc:  # OSError, JSON's ValueError, safetensors' SafetensorError
        raise CheckpointError(f"adapter at {path} is corrupt: {exc}") from exc


def is_complete(path: Path) -> bool:
    try:
        validate_checkpoint(path)
    except CheckpointError:
        return False
    return True


def validate_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file is present, parses, and every tensor reads."""
    for name in FILES:
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
    try:
        for name in (ADAPTER_CONFIG, TRAINER_STATE):
            if not isinstance(json.loads((path / name).read_text()), dict):
                raise ValueError(f"{name} is not a JSON object")
        for name in (ADAPTER_WEIGHTS, OPTIMIZER_STATE):
            _read_tensors(path / name)
    except Exception as exc:  # OSError, JSON's ValueError, safetensors' SafetensorError
        raise CheckpointError(f"{path} is corrupt: {exc}") from exc


def read_trainer_state(path: Path) -> dict[str, Any]:
    state = json.loads((path / TRAINER_STATE).read_text())
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / TRAINER_STATE} is not a JSON object")
    return state


def parent_version(root: Path, version: int) -> int:
    """The version `version` was trained from (0: fresh LoRA weights): its trainer state's
    `parent`; the version before it when there is none or the state cannot be read (each step
    continued the previous one's weights before the trainer recorded parents)."""
    try:
        state = read_trainer_state(version_dir(root, version))
    except (OSError, ValueError, CheckpointError):
        return version - 1
    parent = state.get("parent")
    return parent if isinstance(parent, int) and 0 <= parent < version else version - 1


def rolled_back_ancestor(
    root: Path, version: int, rolled_back: Collection[int], trusted: Collection[int] = ()
) -> int | None:
    """The first version of `rolled_back` on `version`'s lineage (itself, its parent, ...),
    walking down to fresh weights or to a `trusted` version (one that served as active: what
    lies below it was accepted already). None when the lineage is clean."""
    current = version
    while current > 0 and current not in trusted:
        if current in rolled_back:
            return current
        current = parent_version(root, current)
    return None


def read_adapter_config(path: Path) -> dict[str, Any]:
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / ADAPTER_CONFIG} is not a JSON object")
    return config


def read_adapter_state(path: Path) -> dict[str, torch.Tensor]:
    return _read_tensors(path / ADAPTER_WEIGHTS)


def read_optimizer_state(path: Path) -> dict[str, torch.Tensor]:
    return _read_tensors(path / OPTIMIZER_STATE)


# ----------------------------------------------------------------- optimizer state


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    """An optimizer's per-parameter state as tensors named `<parameter name>.<state key>`
    (e.g. `...lora_A.default.weight.exp_avg`). Names, not positions, so a reordering of the
    parameters cannot silently pair a state with the wrong tensor. Hyperparameters are not
    stored: they come from the trainer's config."""
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        for key, value in optimizer.state.get(param, {}).items():
            out[f"{name}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer,
    params: dict[str, torch.nn.Parameter],
    tensors: dict[str, torch.Tensor],
) -> None:
    """The inverse of `optimizer_tensors`; `params` in the order they were given to `optimizer`."""
    per_param: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in tensors.items():
        name, state_key = key.rsplit(".", 1)
        if name not in params:
            raise CheckpointError(f"optimizer state names an unknown parameter {name}")
        per_param[name][state_key] = value
    index = {name: i for i, name in enumerate(params)}
    state_dict = optimizer.state_dict()
    state_dict["state"] = {index[name]: state for name, state in per_param.items()}
    optimizer.load_state_dict(state_dict)


# ----------------------------------------------------------------- files


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    # safetensors refuses shared storage and non-contiguous views; copy to plain CPU tensors.
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(plain, str(path), metadata={"format": "pt"})
    _fsync_file(path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
