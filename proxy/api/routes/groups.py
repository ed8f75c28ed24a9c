"""`/rl/groups`: the groups RULER scores, with their members, scores and explanations (JSON).

    GET  /rl/groups                 list, newest first: ?status=&source=&limit=&cursor=
    GET  /rl/groups/{id}            one group: members (conversation, scores, rewards), status
    POST /rl/groups/{id}/score      score it now (or again), with the configured judge

Thin routes over `storage.Store` and the scoring room (`trainer.scoring`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from proxy.api.auth import Caller
from proxy.api.body import TextJSONRoute
from proxy.api.deps import ScorerDep, SettingsDep, StoreDep
from proxy.errors import InvalidRequestError, NotFoundError
from storage.records import GroupDetail, GroupMemberView, GroupSummary
from trainer.scoring import read_group

router = APIRouter(prefix="/rl/groups", route_class=TextJSONRoute)

Status = Literal["forming", "ready", "scoring", "scored", "failed", "expired", "held"]
Source = Literal["explicit", "task", "shadow", "cohort"]


@router.get("")
async def list_groups(
    store: StoreDep,
    caller: Caller,
    status: Status | None = None,
    source: Source | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: str | None = None,
) -> dict[str, Any]:
    try:
        page = await store.list_groups(
            status=status,
            source=source,
            limit=limit,
            cursor=cursor,
            owner=caller.visible_owner(),
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="cursor") from exc
    return {
        "object": "list",
        "data": [summary_json(g) for g in page.items],
        "next_cursor": page.next_cursor,
        "has_more": page.next_cursor is not None,
    }


@router.get("/{group_id}")
async def get_group(
    group_id: str, store: StoreDep, settings: SettingsDep, caller: Caller
) -> dict[str, Any]:
    group = await read_group(store, group_id, settings.reward_policy)
    if group is None or not caller.may_see(group.summary.owner_key_id):
        raise _not_found(group_id)
    return detail_json(group)


@router.post("/{group_id}/score")
async def score_group(group_id: str, store: StoreDep, scorer: ScorerDep) -> dict[str, Any]:
    if await store.get_group(group_id) is None:
        raise _not_found(group_id)
    scored = await scorer.score(group_id)
    if scored is None:
        raise InvalidRequestError(
            f"Group '{group_id}' cannot be scored now: it has fewer than two members or is "
            "being scored already.",
            param="group_id",
            code="group_not_scorable",
        )
    return detail_json(scored)


def summary_json(summary: GroupSummary) -> dict[str, Any]:
    return {"object": "rl.group", **asdict(summary)}


def member_json(member: GroupMemberView) -> dict[str, Any]:
    out = asdict(member)
    out.pop("turns")
    out["turns"] = [
        {
            "call_id": t.call_id,
            "adapter_version": t.adapter_version,
            "prompt_tokens": None if t.prompt_token_ids is None else len(t.prompt_token_ids),
            "completion_tokens": None
            if t.completion_token_ids is None
            else len(t.completion_token_ids),
        }
        for t in member.turns
    ]
    return out


def detail_json(group: GroupDetail) -> dict[str, Any]:
    return {**summary_json(group.summary), "members": [member_json(m) for m in group.members]}


def _not_found(group_id: str) -> NotFoundError:
    return NotFoundError(
        f"No group with id '{group_id}'.", param="group_id", code="group_not_found"
    )
