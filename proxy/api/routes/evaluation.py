"""`GET /rl/eval`: the held-out evaluation as JSON (what `rlproxy eval --json` prints).

    GET /rl/eval?limit=5000

    headline   "is it getting better?" in one line: the newest version with an interval against
               the base on held-out tasks (its re-runs' when they are of a version at least as
               new), its interval and verdict (better, worse, not shown,
               too few runs, no evidence, off)
    versions   per adapter version that served held-out tasks: its rewards, the base's over the
               same hours, the difference with a 95 % interval, and the difference of that gain
               with the previous evaluated version's
    reruns     per adapter version re-run by the client (every call pinned to it, marked held
               out): the tasks re-run on both it and the base, paired, with a 95 % interval;
               `reruns_evaluated` counts them per version
    evaluated  counted runs per version; `left_out` runs not counted, per reason
               (`left_out_reasons` says each one in words); `read` held-out trajectories read,
               at most `limit`, the newest

On demand, bounded by `limit` (`storage.held_out_runs`): the dashboard polls it with the
overview. An inference key sees the evaluation of its own traffic; an admin key (or an open
server) everyone's. The statistics are `proxy.adapters.evaluation`'s.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from proxy.adapters.evaluation import DEFAULT_LIMIT, evaluate
from proxy.api.auth import Caller
from proxy.api.deps import SettingsDep, StoreDep

router = APIRouter(prefix="/rl/eval")


@router.get("")
async def held_out_evaluation(
    store: StoreDep,
    settings: SettingsDep,
    caller: Caller,
    limit: Annotated[int, Query(ge=1, le=50_000)] = DEFAULT_LIMIT,
) -> dict[str, Any]:
    evaluation = await evaluate(
        store,
        policy=settings.model_name,
        reward_policy=settings.reward_policy,
        share=settings.eval.share,
        limit=limit,
        owner=caller.visible_owner(),
    )
    return evaluation.to_json()
