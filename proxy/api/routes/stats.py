"""`GET /rl/stats`: the figures the dashboard shows that no other route gives (JSON).

    GET /rl/stats?minutes=60&window=1000

    calls     calls and failed calls per minute over the last `minutes` (at most 24 hours)
    rewards   per adapter version (0: the base model), mean ± standard error of the newest
              `window` explicit rewards and, separately, of the newest `window` judge scores
    groups    groups forming, ready and being scored; scored groups not yet trained on (among
              the newest 500); the newest scored and failed group; `waiting`: trajectories
              alone or in groups below the ready size, and since when, ready groups only a
              judge can score, skipped and held groups; `why_not_training`: those figures read
              against the settings, as {what, fix} sentences (`proxy.telemetry.waiting`)
    judge     which judge scores groups, whether background scoring runs, the reward policy
    background
              what runs beside serving and what it costs (`proxy.telemetry.background`): the
              engine's background rows (running, paused for users, waiting) and its share of
              the engine over the last minute; the judge's state ("judging", "idle", "waiting"
              for a trainer, "backing off" after failing its checks, with why and its next try)
              and its calls and time in the last hour; the trainer child's niceness and CPU;
              the server's CPU (cores)
    trainer   the trainer child's state (as /health reports it), the newest version, and the
              staleness bound's counts over the trainer's run (groups trained on, dropped and
              down-weighted for being more than max_staleness versions behind; null before
              the trainer counted them)
    active_version
              the version the policy name serves (0: the base model)

Every figure is a bounded query (`storage.stats`): polling this route costs the same on a
fresh database as on one with millions of calls. An inference key sees its own calls, rewards
and groups; an admin key (or an open server) sees everything.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query

from proxy.api.auth import Caller
from proxy.api.deps import Registry, RuntimeDep, SettingsDep, StoreDep, TrainerDep
from proxy.telemetry.metrics import StaleGroups
from proxy.telemetry.waiting import why_not_training

router = APIRouter(prefix="/rl/stats")

UNTRAINED_WINDOW = 500
TRAINER_FIELDS = (
    "state",
    "started_at",
    "restarts",
    "exits_in_a_row",
    "last_exit_code",
    "last_error",
    "next_restart_at",
)
"""What the dashboard shows of the supervisor's status (its log tail stays on /health)."""


@router.get("")
async def stats(
    store: StoreDep,
    settings: SettingsDep,
    registry: Registry,
    trainer: TrainerDep,
    caller: Caller,
    runtime: RuntimeDep,
    minutes: Annotated[int, Query(ge=1, le=24 * 60)] = 60,
    window: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    owner = caller.visible_owner()
    now = time.time()
    per_minute = await store.calls_per_minute(minutes=minutes, now=now, owner=owner)
    rewards = await store.reward_by_version(window=window, owner=owner)
    queue = await store.group_queue(owner=owner, untrained_window=UNTRAINED_WINDOW)
    newest = await store.latest_adapter(registry.policy)
    stale = StaleGroups.from_step(newest.metrics if newest is not None else None)
    background = runtime.background.report() if runtime.background is not None else None
    judged = runtime.scorer.work_last_hour() if runtime.scorer is not None else None
    return {
        "object": "rl.stats",
        "now": now,
        "active_version": registry.active or 0,
        "calls": {
            "minutes": minutes,
            "total": sum(m.calls for m in per_minute),
            "errors": sum(m.errors for m in per_minute),
            "per_minute": [asdict(m) for m in per_minute],
        },
        "rewards": {
            "window": window,
            "policy": settings.reward_policy,
            "by_version": [asdict(v) for v in rewards],
        },
        "groups": {
            **asdict(queue),
            "last_scored": asdict(queue.last_scored) if queue.last_scored else None,
            "last_failed": asdict(queue.last_failed) if queue.last_failed else None,
            "why_not_training": [
                asdict(a) for a in why_not_training(queue.waiting, settings, now=now, judge=judged)
            ],
        },
        "judge": {
            "model": settings.judge.model or f"{settings.model_name} (local base model)",
            "local": not settings.judge.model,
            "scoring": settings.judge.scoring,
            "judges_explicit_groups": settings.judge.explicit_groups,
        },
        "background": background,
        "trainer": {
            **_trainer_state(trainer.status() if trainer is not None else {"state": "off"}),
            "newest_version": None
            if newest is None
            else {
                "version": newest.version,
                "status": newest.status,
                "created_at": newest.created_at,
                "metrics": newest.metrics,
            },
            "stale_groups": None
            if stale is None
            else {**asdict(stale), "dropped_share": stale.dropped_share},
        },
    }


def _trainer_state(status: dict[str, Any]) -> dict[str, Any]:
    return {k: status.get(k) for k in TRAINER_FIELDS}
