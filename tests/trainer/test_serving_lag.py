"""The trainer against what serves: each step records how far its weights were ahead of the
version serving the policy name, and with `max_ahead_of_serving` it waits while that far ahead
and serving still has a newer version to decide on, never longer than
`max_wait_for_serving_s`, never when nothing is pending. The store is a real SQLite file; the
trainer is tests/trainer/test_staleness.py's recording stand-in (no model)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from storage import Store
from storage.records import AdapterRecord
from tests.trainer.test_staleness import _loop_at_version, _scored_group, _trained_step
from trainer.config import TrainerConfig

on_loop = pytest.mark.asyncio(loop_scope="session")


async def _serving(store: Store, active: int, canary: int | None, newest: tuple[int, str]) -> None:
    """Serving's state as the publisher writes it, and the newest version's record."""
    await store.set_policy_state(
        "rlproxy", active_version=active, canary_version=canary, canary_share=0.25
    )
    now = time.time()
    version, status = newest
    await store.record_adapter(
        AdapterRecord("rlproxy", version, f"/v{version}", "written", now, now)
    )
    if status != "written":
        await store.update_adapter("rlproxy", version, status=status)


@on_loop
async def test_each_step_records_how_far_ahead_of_serving_it_was(
    store: Store, tmp_path: Path
) -> None:
    group = await _scored_group(store, "g", 5)
    loop, _ = await _loop_at_version(store, tmp_path / "ckpt", 5)
    assert await loop.serving_lag() == (None, None, False)  # nothing publishes: no state
    await _serving(store, active=1, canary=4, newest=(5, "written"))
    assert await loop.serving_lag() == (1, 4, True)
    report = await loop.step_once()  # max_ahead_of_serving is off by default: it trains
    assert report is not None and report.group_ids == [group]
    assert (report.metrics["serving_version"], report.metrics["ahead_of_serving"]) == (1, 4)


@on_loop
async def test_far_ahead_with_a_canary_on_trial_it_waits_until_serving_catches_up(
    store: Store, tmp_path: Path
) -> None:
    group = await _scored_group(store, "g", 5)
    loop, trainer = await _loop_at_version(store, tmp_path / "ckpt", 5, max_ahead_of_serving=4)
    await _serving(store, active=1, canary=4, newest=(5, "written"))
    assert await loop.step_once() is None
    assert trainer.seen == [] and await _trained_step(store, group) is None
    await store.set_policy_state("rlproxy", active_version=4, canary_version=None)
    report = await loop.step_once()  # v4 promoted: one version behind
    assert report is not None and report.metrics["ahead_of_serving"] == 1


@on_loop
@pytest.mark.parametrize(
    "state",
    [
        {"active": 1, "canary": None, "newest": (5, "rejected")},  # nothing left to decide
        {"active": 1, "canary": None, "newest": (5, "loaded")},
        {"active": 2, "canary": 4, "newest": (5, "written")},  # 3 ahead: within the bound
    ],
)
async def test_it_never_waits_when_serving_has_nothing_to_decide_or_is_close(
    store: Store, tmp_path: Path, state: dict[str, Any]
) -> None:
    await _scored_group(store, "g", 5)
    loop, _ = await _loop_at_version(store, tmp_path / "ckpt", 5, max_ahead_of_serving=4)
    await _serving(store, **state)
    assert await loop.step_once() is not None


@on_loop
async def test_a_wait_ends_after_max_wait_for_serving_s(store: Store, tmp_path: Path) -> None:
    await _scored_group(store, "g", 5)
    config = {"max_ahead_of_serving": 2, "max_wait_for_serving_s": 0.2}
    loop, _ = await _loop_at_version(store, tmp_path / "ckpt", 5, **config)
    await _serving(store, active=1, canary=4, newest=(5, "written"))
    assert await loop.step_once() is None
    await asyncio.sleep(0.3)
    assert await loop.step_once() is not None  # a canary that never ends stops nothing


def test_the_settings_are_checked() -> None:
    for bad in ({"max_ahead_of_serving": 0}, {"max_wait_for_serving_s": 0.0}):
        with pytest.raises(ValueError, match="must be"):
            TrainerConfig(**bad)  # type: ignore[arg-type]
