"""`/rl/trajectories`: read stored trajectories, reward them, end them (JSON).

    GET  /rl/trajectories                 list, newest first: ?status=&group_key=&model=&since=
                                          &until=&parent=&limit=&cursor= (since/until: epoch
                                          seconds; parent: the trajectories that one started)
    GET  /rl/trajectories/{id}            one trajectory: its turns in order, its rewards
    POST /rl/trajectories/{id}/reward     {"reward": float, "source": str}; closes it
    POST /rl/trajectories/{id}/end        closes it

Where a route takes a trajectory id it also takes the id any of its calls returned
(`chatcmpl-...`, `resp_...`, `msg_...`), so an agent that knows nothing of rlproxy can reward
the run behind a response it received.

Thin routes over `storage.Store`: the store owns the SQL and the linking,
this module only parses, maps store errors to OpenAI-shaped ones, and shapes the JSON.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field, StrictFloat

from proxy.api.auth import Caller, Principal
from proxy.api.body import TextJSONRoute
from proxy.api.deps import StoreDep, TelemetryDep
from proxy.errors import InvalidRequestError, NotFoundError
from proxy.protocols.chat import ID_PREFIXES
from storage.errors import TrajectoryNotFound
from storage.records import MAX_ABS_REWARD, TrajectoryDetail, TrajectorySummary
from storage.store import Store

router = APIRouter(prefix="/rl/trajectories", route_class=TextJSONRoute)


class RewardBody(BaseModel):
    reward: StrictFloat = Field(
        allow_inf_nan=False,
        ge=-MAX_ABS_REWARD,
        le=MAX_ABS_REWARD,
        description="The trajectory's reward (any scale within ±1e6: GRPO normalises per group).",
    )
    source: str = Field("api", min_length=1, max_length=200, description="Who gave it.")
    explanation: str | None = Field(None, description="Why (optional).")


@router.get("")
async def list_trajectories(
    store: StoreDep,
    caller: Caller,
    status: Literal["open", "closed"] | None = None,
    group_key: str | None = None,
    model: str | None = None,
    since: float | None = None,
    until: float | None = None,
    parent: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: str | None = None,
) -> dict[str, Any]:
    try:
        page = await store.list_trajectories(
            status=status,
            group_key=group_key,
            model=model,
            since=since,
            until=until,
            limit=limit,
            cursor=cursor,
            owner=caller.visible_owner(),
            parent=parent,
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="cursor") from exc
    return {
        "object": "list",
        "data": [summary_json(s) for s in page.items],
        "next_cursor": page.next_cursor,
        "has_more": page.next_cursor is not None,
    }


@router.get("/{trajectory_id}")
async def get_trajectory(trajectory_id: str, store: StoreDep, caller: Caller) -> dict[str, Any]:
    detail = await store.get_trajectory(await resolve(store, caller, trajectory_id))
    if detail is None:
        raise _not_found(trajectory_id)
    return detail_json(detail)


async def resolve(store: Store, caller: Principal, trajectory_id: str) -> str:
    """A trajectory id as given, or the trajectory of a call's id as its client received it
    (`chatcmpl-...`, `resp_...`, `msg_...`: whichever protocol it came in by).

    Another key's trajectory is "not found" to a non-admin key (its existence is not told)."""
    given = trajectory_id
    if trajectory_id.startswith(tuple(ID_PREFIXES.values())):
        found = await store.trajectory_of_completion(trajectory_id)
        if found is not None:
            trajectory_id = found
    if not caller.sees_all:
        exists, owner = await store.trajectory_owner(trajectory_id)
        if not exists or not caller.may_see(owner):
            raise _not_found(given)
    return trajectory_id


@router.post("/{trajectory_id}/reward")
async def add_reward(
    trajectory_id: str, body: RewardBody, store: StoreDep, caller: Caller, telemetry: TelemetryDep
) -> dict[str, Any]:
    trajectory_id = await resolve(store, caller, trajectory_id)
    try:
        reward_id = await store.add_reward(
            trajectory_id, body.reward, body.source, body.explanation
        )
    except TrajectoryNotFound as exc:
        raise _not_found(trajectory_id) from exc
    telemetry.reward_added(trajectory_id, reward_id, body.reward, body.source, body.explanation)
    return {
        "object": "rl.reward",
        "id": reward_id,
        "trajectory_id": trajectory_id,
        "reward": body.reward,
        "source": body.source,
        "status": "closed",
    }


@router.post("/{trajectory_id}/end")
async def end_trajectory(trajectory_id: str, store: StoreDep, caller: Caller) -> dict[str, Any]:
    trajectory_id = await resolve(store, caller, trajectory_id)
    try:
        was_open = await store.end_trajectory(trajectory_id)
    except TrajectoryNotFound as exc:
        raise _not_found(trajectory_id) from exc
    return {
        "object": "rl.trajectory",
        "id": trajectory_id,
        "status": "closed",
        "was_open": was_open,
    }


def summary_json(summary: TrajectorySummary) -> dict[str, Any]:
    return {"object": "rl.trajectory", **asdict(summary)}


def detail_json(detail: TrajectoryDetail) -> dict[str, Any]:
    return {
        **summary_json(detail.summary),
        "turns": [asdict(t) for t in detail.turns],
        "rewards": [asdict(r) for r in detail.rewards],
    }


def _not_found(trajectory_id: str) -> NotFoundError:
    return NotFoundError(
        f"No trajectory with id '{trajectory_id}'.",
        param="trajectory_id",
        code="trajectory_not_found",
    )
