"""Why traffic is not training: the store's `Waiting` figures read against the settings, as
short sentences of what is happening and what to change.

`rlproxy status`, `GET /rl/stats` (`groups.why_not_training`) and the dashboard's overview all
print the same list, so a user whose traffic forms no usable group is told so in each place:
how many trajectories wait, in what, since when, and which setting or reward would make them
train. Pure: no store, no HTTP; the figures come from `storage.stats.Waiting`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from proxy.settings import Settings
from storage.stats import JudgeWork, Waiting


@dataclass(frozen=True)
class Advice:
    """One reason traffic waits: what is happening, and what would change it."""

    what: str
    fix: str


def why_not_training(
    waiting: Waiting,
    settings: Settings,
    *,
    now: float | None = None,
    judge: JudgeWork | None = None,
) -> list[Advice]:
    """The reasons, most blocking first; [] when nothing waits for a reason of its own.
    `judge`: what the judge did in the last hour (the local judge's cost is stated with it)."""
    now = time.time() if now is None else now
    out: list[Advice] = []
    if not settings.trainer.enabled:
        waits = (
            " Its judge waits for one: with RLPROXY_SCORING=auto ready groups are judged only "
            "while a trainer (here, on another replica, or `rlproxy train`) uses the scores."
            if settings.judge.scoring == "auto"
            else ""
        )
        out.append(
            Advice(
                "This server runs no trainer (RLPROXY_TRAIN=false)." + waits,
                "Run `rlproxy train` against the same database, or serve with training on.",
            )
        )
    if waiting.alone:
        waited = _for(now, waiting.alone_since)
        if not settings.groups.cohort:
            out.append(
                Advice(
                    f"{_n(waiting.alone)} wait{_s(waiting.alone, 's', '')} alone in their task's "
                    f"group{waited}: no other run of the same task came, and a group needs two "
                    "runs to compare.",
                    "Set RLPROXY_GROUP_COHORT=true so that a task asked once joins its agent's "
                    "cohort, run each task several times, or send X-RLProxy-Group to group "
                    "runs yourself.",
                )
            )
        else:
            out.append(
                Advice(
                    f"{_n(waiting.alone)} wait{_s(waiting.alone, 's', '')} for another run of "
                    f"their task{waited}.",
                    f"Nothing to do: after RLPROXY_GROUP_ALONE_S ({settings.groups.alone_s:g} s) "
                    "each joins its agent's cohort.",
                )
            )
    if waiting.alone_cohort:
        out.append(
            Advice(
                f"{_n(waiting.alone_cohort)} {_s(waiting.alone_cohort, 'is', 'are each')} the "
                "only one of its agent in a cohort: a cohort is the same API key, system prompt "
                "(dates, paths and numbers aside) and tool names.",
                "Send more traffic from the same agent, or X-RLProxy-Group with one key per "
                "agent when its system prompt changes in other ways.",
            )
        )
    if waiting.small:
        out.append(
            Advice(
                f"{_n(waiting.small)} {_s(waiting.small, 'is', 'are')} in groups below "
                f"RLPROXY_GROUP_MIN_SIZE ({settings.groups.min_size}) members"
                f"{_for(now, waiting.small_since)}.",
                f"A group is ready at {settings.groups.min_size} members, or with 2 after "
                f"RLPROXY_GROUP_WINDOW_S ({settings.groups.window_s:g} s); lower either to train "
                "sooner.",
            )
        )
    if waiting.unrewarded_ready:
        groups = f"{waiting.unrewarded_ready} ready group{_s(waiting.unrewarded_ready, '', 's')}"
        if settings.judge.scoring is False:
            out.append(
                Advice(
                    f"{groups} {_s(waiting.unrewarded_ready, 'has', 'have')} members with no "
                    "reward, and background scoring is off (RLPROXY_SCORING=false).",
                    "Post each episode's reward (POST /rl/trajectories/{id}/reward), or turn "
                    "RLPROXY_SCORING on with a judge (RLPROXY_JUDGE_MODEL).",
                )
            )
        elif not settings.judge.model:
            out.append(
                Advice(
                    f"{groups} wait for the judge, and the judge is the local base model: a "
                    f"placeholder that is rarely a useful judge. {placeholder_cost(judge)}",
                    "Post each episode's reward, or set RLPROXY_JUDGE_MODEL to a capable model.",
                )
            )
    if waiting.equal_rewards:
        out.append(
            Advice(
                f"{waiting.equal_rewards} of the newest scored groups gave every member the same "
                "reward and taught nothing (skipped).",
                "Usual when every run fails, or every one succeeds: a reward with partial "
                "credit, or tasks the model sometimes solves, gives groups something to compare.",
            )
        )
    if waiting.held:
        out.append(
            Advice(
                f"{waiting.held} group{_s(waiting.held, ' is', 's are')} held: the judge failed "
                "its checks, or has not had enough of them yet (its first "
                f"{settings.judge_checks.gate_min_checks} groups), so its scores are not trained "
                "on.",
                "See GET /rl/judge for which. A judge not proven yet needs no change: its held "
                "groups are judged again once it passes. A failing one: use a better judge "
                "(RLPROXY_JUDGE_MODEL) or post rewards.",
            )
        )
    if not out and waiting.open_trajectories:
        out.append(
            Advice(
                f"{waiting.open_trajectories} trajector"
                f"{_s(waiting.open_trajectories, 'y is', 'ies are')} still open.",
                "A trajectory joins a group when it closes: on a reward, an explicit end, or "
                f"after RLPROXY_TRAJECTORY_IDLE_TIMEOUT_S ({settings.trajectory_idle_timeout_s:g}"
                " s) with no new call.",
            )
        )
    return out


def placeholder_cost(judge: JudgeWork | None) -> str:
    """What the local judge costs, in one sentence: measured over the last hour when it
    judged, else what a group takes."""
    gives_way = "it runs on the serving engine only while no user's request waits"
    if judge is None or not judge.groups:
        return (
            "Each group costs one to four judge calls on the serving engine (tens of seconds "
            f"each on a 2-core CPU); {gives_way}."
        )
    return (
        f"In the last hour it judged {judge.groups} group{_s(judge.groups, '', 's')} in "
        f"{judge.calls} call{_s(judge.calls, '', 's')}, {judge.seconds:.0f} s of the engine's "
        f"time; {gives_way}."
    )


def _n(count: int) -> str:
    return f"{count} trajector{_s(count, 'y', 'ies')}"


def _s(count: int, one: str, many: str) -> str:
    return one if count == 1 else many


def _for(now: float, since: float | None) -> str:
    if since is None:
        return ""
    seconds = max(0.0, now - since)
    if seconds < 120:
        return f" (the oldest for {seconds:.0f} s)"
    if seconds < 7200:
        return f" (the oldest for {seconds / 60:.0f} min)"
    return f" (the oldest for {seconds / 3600:.1f} h)"
