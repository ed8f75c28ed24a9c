"""`GET /rl/judge`: how honest the judge is, and what the gate on training decides (JSON).

    GET /rl/judge?window=200

    judges    per judge model and rubric seen among the newest `window` checks: canary pass
              rate with its 95 % Wilson bounds (and per canary kind), self-agreement (mean
              Kendall's tau between two orderings, 95 % bounds), agreement with the environment
              (mean Spearman and Kendall per day), the gate's decision and reason, held groups
    drift     the drift alarm: mean reward climbing while the canary pass rate or completion
              lengths collapse, with the two halves' figures
    held_groups  groups whose scores are held, not trained on

An inference key sees figures over its own groups' checks; the `gate` of each judge is the one
training obeys, over every group's checks (a judge's quality, not anyone's data). An admin key
(or an open server) sees everything. The rule is `trainer.scoring.judge_checks`; this route only
reads (`storage.judge_checks`, bounded by `window`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query

from proxy.api.auth import Caller
from proxy.api.deps import SettingsDep, StoreDep
from trainer.scoring import (
    GateDecision,
    JudgeChecksConfig,
    drift_report,
    gate_decision,
)

router = APIRouter(prefix="/rl/judge")


@router.get("")
async def judge(
    store: StoreDep,
    settings: SettingsDep,
    caller: Caller,
    window: Annotated[int, Query(ge=1, le=10_000)] = 200,
) -> dict[str, Any]:
    owner = caller.visible_owner()
    configured = settings.judge_checks.config()
    config = configured or JudgeChecksConfig()
    visible = await store.newest_judge_checks(limit=window, owner=owner)
    pairs = sorted({(c.judge_model, c.rubric_hash) for c in visible})
    judges = []
    for judge_model, rubric_hash in pairs:
        own = [c for c in visible if (c.judge_model, c.rubric_hash) == (judge_model, rubric_hash)]
        figures = gate_decision(own, config)
        everyone = await store.checks_of_judge(judge_model, rubric_hash, limit=config.window)
        gate = gate_decision(everyone, config)
        judges.append(
            {
                "judge_model": judge_model,
                "rubric_hash": rubric_hash,
                **_figures(figures),
                "gate": {"decision": gate.decision, "reason": gate.reason, "checks": gate.checks},
                "held_groups": await store.held_count(
                    owner=owner, judge_model=judge_model, rubric_hash=rubric_hash
                ),
                "newest_check_at": max(c.created_at for c in own),
            }
        )
    drift_rows = await store.newest_judge_checks(limit=2 * config.drift_window, owner=owner)
    drift = drift_report(drift_rows, config)
    return {
        "object": "rl.judge",
        "checks": configured is not None,
        "settings": {
            "canary_share": config.canary_share,
            "position_share": config.position_share,
            "gate": config.gate,
            "min_checks": config.min_checks,
            "min_canary_pass": config.min_canary_pass,
            "min_self_tau": config.min_self_tau,
            "window": config.window,
            "hold_unchecked": config.hold_unchecked,
            "hold_undecided": config.hold_undecided,
        },
        "judges": judges,
        "drift": asdict(drift),
        "held_groups": await store.held_count(owner=owner),
    }


def _figures(gate: GateDecision) -> dict[str, Any]:
    return {
        "checks": gate.checks,
        "canary": asdict(gate.canary),
        "self_agreement": asdict(gate.self_agreement),
        "environment": asdict(gate.environment),
    }
