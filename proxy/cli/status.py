"""`rlproxy status`: where the loop stands, read from the database, as one table (or JSON).

    model           the base model the settings name; on the embedded SmolLM2-135M, its
                    8,192-token context and the setting that serves a longer one
    calls           stored, failed, in the last hour
    trajectories    per status
    groups          per status, how many a training step used
    rewards         explicit rewards and judge scores stored
    adapters        versions per status, the one activated last
    held            versions the forgetting check held back (the newest, with its reason)
    trainer         the newest version it wrote (its step metrics) and the groups waiting for it
    judge           which judge, the newest scored and failed group
    better?         is it getting better: the newest version against the base on held-out tasks,
                    with its 95 % interval (`rlproxy eval` for the table behind it)
    reward per version
                    mean ± standard error per adapter version (the dashboard's plot, as rows)

It reads the database only (no server is needed, none is asked): a running server's `/health`
says what it serves right now; the database knows the version activated last (a switch back to
the base model is not recorded there). Counting whole tables scans them, which is fine for a
command run by hand and is why the dashboard shows windowed figures instead.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from typing import Any, TextIO

from sqlalchemy.engine import make_url

from proxy.adapters.evaluation import Evaluation, evaluate
from proxy.adapters.held import held_record, shown_status
from proxy.errors import longer_context
from proxy.settings import EMBEDDED_CONTEXT, Settings
from proxy.telemetry.waiting import why_not_training
from storage.records import AdapterRecord
from storage.stats import GroupQueue, JudgeWork, Totals, VersionReward
from storage.store import Store
from trainer.scoring import gate_decision

LABEL = 14


async def status_command(
    settings: Settings, *, as_json: bool = False, out: TextIO = sys.stdout
) -> int:
    """Print the summary; return an exit code."""
    from proxy.database import opened_store

    async with opened_store(settings) as store:
        totals = await store.totals()
        last_hour = sum(m.calls for m in await store.calls_per_minute(minutes=60))
        queue = await store.group_queue()
        adapters = await store.list_adapters(settings.model_name)
        rewards = await store.reward_by_version()
        judged = await store.judge_work(since=time.time() - 3600)
        evaluation = await evaluate(
            store,
            policy=settings.model_name,
            reward_policy=settings.reward_policy,
            share=settings.eval.share,
        )
        gates = await judge_gates(store, settings)
    report = build_report(
        settings, totals, last_hour, queue, adapters, rewards, judged, evaluation, gates
    )
    if as_json:
        print(json.dumps(report, indent=2), file=out)
    else:
        print_report(report, out)
    return 0


async def judge_gates(store: Store, settings: Settings) -> list[dict[str, Any]]:
    """The gate of each judge model and rubric among the newest checks (`GET /rl/judge`'s
    `gate`): its decision and reason; while a judge is being proven the reason says how far."""
    config = settings.judge_checks.config()
    if config is None:
        return []
    newest = await store.newest_judge_checks(limit=config.window)
    gates = []
    for model, rubric in sorted({(c.judge_model, c.rubric_hash) for c in newest}):
        checks = await store.checks_of_judge(model, rubric, limit=config.window)
        gate = gate_decision(checks, config)
        gates.append(
            {
                "judge_model": model,
                "rubric_hash": rubric,
                "decision": gate.decision,
                "reason": gate.reason,
                "checks": gate.checks,
            }
        )
    return gates


def build_report(
    settings: Settings,
    totals: Totals,
    last_hour: int,
    queue: GroupQueue,
    adapters: list[AdapterRecord],
    rewards: list[VersionReward],
    judged: JudgeWork | None = None,
    evaluation: Evaluation | None = None,
    gates: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Everything `rlproxy status` shows, as plain JSON values."""
    activated = [a for a in adapters if a.activated_at is not None]
    last_active = max(activated, key=lambda a: a.activated_at or 0.0) if activated else None
    newest = adapters[-1] if adapters else None
    by_status: dict[str, int] = {}
    for a in adapters:
        by_status[shown_status(a)] = by_status.get(shown_status(a), 0) + 1
    return {
        "database": _shown_url(settings.resolved_database_url),
        "policy": settings.model_name,
        "model": base_model_report(settings),
        "calls": {"total": totals.calls, "failed": totals.calls_failed, "last_hour": last_hour},
        "trajectories": totals.trajectories,
        "groups": {**totals.groups, "trained_on": totals.groups_trained},
        "rewards": {"explicit": totals.rewards, "judge_scores": totals.scores},
        "adapters": {
            "versions": len(adapters),
            "by_status": by_status,
            "last_activated": None
            if last_active is None
            else {"version": last_active.version, "at": last_active.activated_at},
            "held": [_held(a) for a in adapters if held_record(a) is not None],
        },
        "trainer": {
            "runs_beside_serve": settings.trainer.enabled,
            "groups_per_step": settings.trainer.config.groups_per_step,
            "untrained_scored_groups": queue.untrained_scored,
            "newest_version": None
            if newest is None
            else {
                "version": newest.version,
                "status": newest.status,
                "written_at": newest.created_at,
                "metrics": newest.metrics,
            },
        },
        "judge": {
            "model": settings.judge.model or f"{settings.model_name} (the local base model)",
            "background_scoring": settings.judge.scoring,
            "pipeline": queue.counts,
            "last_scored": None if queue.last_scored is None else asdict(queue.last_scored),
            "last_failed": None if queue.last_failed is None else asdict(queue.last_failed),
            "last_hour": None if judged is None else asdict(judged),
            "gates": gates or [],
        },
        "reward_by_version": [asdict(r) for r in rewards],
        "better": None
        if evaluation is None
        else {
            **evaluation.headline.to_json(),
            "share": evaluation.share,
            "evaluated": evaluation.evaluated,
            "reruns_evaluated": evaluation.rerun_counts,
            "left_out": evaluation.left_out,
        },
        "waiting": asdict(queue.waiting),
        "why_not_training": [
            asdict(a) for a in why_not_training(queue.waiting, settings, judge=judged)
        ],
    }


def _held(record: AdapterRecord) -> dict[str, Any]:
    """A version the forgetting check held: why, and its divergence beside the limit."""
    verdict = held_record(record) or {}
    divergence = verdict.get("divergence") or {}
    return {
        "version": record.version,
        "reason": record.error,
        "mean_kl": divergence.get("mean_kl"),
        "max_kl": verdict.get("max_kl"),
        "at": verdict.get("at"),
    }


def base_model_report(settings: Settings) -> dict[str, Any]:
    """The base model RLPROXY_BASE_MODEL names here. Only the embedded model's context is known
    without loading a model: too short for Claude Code's and Codex's prompts (about 12,500 and
    9,200 tokens), so its fix comes with it."""
    embedded = settings.base_model is None
    return {
        "base_model": settings.base_model_name,
        "context": EMBEDDED_CONTEXT if embedded else None,
        "longer_context": longer_context(EMBEDDED_CONTEXT) if embedded else None,
    }


def print_report(report: dict[str, Any], out: TextIO) -> None:
    now = time.time()

    def line(label: str, text: str) -> None:
        print(f"{label:<{LABEL}}{text}", file=out)

    calls, groups = report["calls"], dict(report["groups"])
    trained_on = groups.pop("trained_on")
    print(f"rlproxy status: {report['policy']} in {report['database']}", file=out)
    served = report["model"]
    if served["context"] is None:
        line("model", f"{served['base_model']} (RLPROXY_BASE_MODEL)")
    else:
        line(
            "model",
            f"{served['base_model']}, context {served['context']:,} tokens: too short for Claude "
            f"Code's and Codex's prompts; for those, {served['longer_context']}",
        )
    failed, last_hour = calls["failed"], calls["last_hour"]
    line("calls", f"{calls['total']} stored ({failed} failed), {last_hour} in the last hour")
    line("trajectories", _counts(report["trajectories"]))
    line("groups", f"{_counts(groups)}; {trained_on} trained on")
    rewards = report["rewards"]
    line(
        "rewards", f"{rewards['explicit']} explicit rewards, {rewards['judge_scores']} judge scores"
    )
    adapters = report["adapters"]
    active = adapters["last_activated"]
    activated = f"; last activated v{active['version']} {_ago(active['at'], now)}" if active else ""
    if adapters["versions"]:
        n = adapters["versions"]
        versions = f"{n} version{'' if n == 1 else 's'} ({_breakdown(adapters['by_status'])})"
    else:
        versions = "no versions yet"
    line("adapters", versions + activated)
    if adapters["held"]:
        newest_held = adapters["held"][-1]
        more = len(adapters["held"]) - 1
        others = f" ({more} more held before it)" if more else ""
        line("held", f"v{newest_held['version']}: {newest_held['reason']}{others}")
    trainer = report["trainer"]
    newest = trainer["newest_version"]
    if newest is None:
        wrote = "no version written yet"
    else:
        metrics = newest["metrics"] or {}
        figures = ", ".join(
            f"{k.replace('_', ' ')} {_num(metrics[k])}"
            for k in ("loss", "mean_reward")
            if isinstance(metrics.get(k), int | float)
        )
        wrote = (
            f"newest v{newest['version']} ({newest['status']}) {_ago(newest['written_at'], now)}"
        )
        wrote += f": {figures}" if figures else ""
    waiting = (
        f"{trainer['untrained_scored_groups']} scored groups wait for a step "
        f"({trainer['groups_per_step']} per step)"
    )
    beside = "" if trainer["runs_beside_serve"] else " (RLPROXY_TRAIN=false: serve runs none)"
    line("trainer", f"{wrote}; {waiting}{beside}")
    judge = report["judge"]
    parts = [
        judge["model"],
        "background scoring "
        + {True: "on", False: "off"}.get(
            judge["background_scoring"], "auto (while a trainer runs)"
        ),
    ]
    parts.append("groups " + _breakdown(judge["pipeline"]))
    if judge["last_scored"]:
        parts.append(f"last scored {_ago(judge['last_scored']['at'], now)}")
    if judge["last_failed"]:
        failed = judge["last_failed"]
        parts.append(f"last failure {_ago(failed['at'], now)}: {failed['failure'] or '?'}")
    line("judge", "; ".join(parts))
    for gate in judge.get("gates", []):
        verdict = "trains" if gate["decision"] == "train" else "HELD"
        reason = gate["reason"].replace("judge not proven yet, ", "") if gate["reason"] else None
        line(
            "judge gate",
            f"{gate['judge_model']} (rubric {gate['rubric_hash']}): {verdict}"
            + (f", {reason}" if reason else ", its checks pass"),
        )
    work = judge.get("last_hour")
    if work is not None:
        line(
            "background",
            f"judge: {work['groups']} groups, {work['calls']} calls, {work['seconds']:.0f} s in "
            "the last hour; the local judge and the trainer give way to serving (GET /rl/stats "
            "for what runs now)",
        )
    if report.get("better") is not None:
        line("better?", report["better"]["line"])
    print_waiting(report["why_not_training"], out)
    print_rewards(report["reward_by_version"], out)


def print_waiting(reasons: list[dict[str, str]], out: TextIO) -> None:
    """Why traffic waits instead of training (`proxy.telemetry.waiting`), when it does."""
    if not reasons:
        return
    print(file=out)
    print("why traffic is not training yet:", file=out)
    for reason in reasons:
        print(f"  - {reason['what']}", file=out)
        print(f"    {reason['fix']}", file=out)


def print_rewards(rows: list[dict[str, Any]], out: TextIO) -> None:
    print(file=out)
    if not rows:
        print("reward per version: no rewards or judge scores yet", file=out)
        return
    print("reward per version (mean ± standard error, n; the newest 1000 of each kind)", file=out)
    cells: dict[int, dict[str, str]] = {}
    for r in rows:
        spread = "" if r["stderr"] is None else f" ± {_num(r['stderr'])}"
        cells.setdefault(r["version"], {})[r["source"]] = f"{_num(r['mean'])}{spread} (n {r['n']})"
    row = "{:<9} {:<24} {}"
    print(row.format("version", "environment", "RULER score"), file=out)
    for version, by_source in sorted(cells.items()):
        name = f"v{version}" if version else "base"
        print(
            row.format(name, by_source.get("explicit", "-"), by_source.get("ruler", "-")), file=out
        )


def _breakdown(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _counts(counts: dict[str, int]) -> str:
    return f"{sum(counts.values())} ({_breakdown(counts)})" if counts else "0"


def _num(x: float) -> str:
    return f"{x:.3f}"


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "at an unknown time"
    s = max(0.0, now - at)
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    if s < 172800:
        return f"{s / 3600:.0f} h ago"
    return time.strftime("on %Y-%m-%d %H:%M", time.localtime(at))


def _shown_url(url: str) -> str:
    """The database URL without its password."""
    return make_url(url).render_as_string(hide_password=True)
